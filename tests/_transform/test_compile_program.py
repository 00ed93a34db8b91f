"""``curvature(..., compile=True)``: one traced, ``torch.compile(fullgraph=True)``
program per input signature. Results equal eager's (Monte-Carlo ones from the same
generators) and the brute-force oracle; the same signature does not compile again, a new
batch size compiles a new program; a user's ``torch.compile(fullgraph=True)`` step calling
``f`` works; what is not compiled is refused at ``curvature`` time. Most cases use the
``aot_eager`` backend (the traced graph and Dynamo's fullgraph pass, fast on CPU); one uses
inductor."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import _pytree as pytree

from curvlib import CurvatureError, CurvatureTypeError, curvature, extensions as E

from oracles.on_device import seeded
from oracles.reference import assert_matches, assert_same, reference

FAST = {"backend": "aot_eager"}


def _supported(seed: int = 0) -> list:
    gens = [seeded(seed + i) for i in range(4)]
    return [E.BatchGrad(), E.BatchL2Grad(), E.SumGradSquared(), E.Variance(), E.DiagGGNExact(),
            E.BatchDiagGGNExact(), E.KFLR(), E.SqrtGGNExact(), E.DiagGGNMC(generator=gens[0]),
            E.BatchDiagGGNMC(generator=gens[1]), E.KFAC(generator=gens[2]), E.SqrtGGNMC(mc_samples=2, generator=gens[3])]


def _mlp(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(dtype)
    return model, torch.randn(7, 5, dtype=dtype), torch.randint(0, 3, (7,))


def _cnn(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Linear(3 * 2 * 2, 4)).to(dtype)
    with torch.no_grad():  # statistics that are not the defaults (read as program inputs)
        model[1].running_mean.normal_()
        model[1].running_var.uniform_(0.5, 2.0)
    return model.eval(), torch.randn(5, 2, 6, 6, dtype=dtype), torch.randint(0, 4, (5,))


def _both(model, lossfn, X, y, compile_options, keep=lambda e: True):
    """(compiled result, eager result) of every supported extension, the same random draws."""
    torch.manual_seed(3)
    got = curvature(model, lossfn, [e for e in _supported() if keep(e)], compile=compile_options)(X, y)
    torch.manual_seed(3)
    want = curvature(model, lossfn, [e for e in _supported() if keep(e)])(X, y)
    return got, want


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("build", [_mlp, _cnn], ids=["mlp", "cnn"])
def test_compiled_equals_eager_and_oracle(build, dtype):
    model, X, y = build(dtype)
    got, want = _both(model, nn.CrossEntropyLoss(), X, y, FAST)
    assert_same(got, want, "compiled", rtol=1e-10 if dtype == torch.float64 else 1e-5)
    if dtype == torch.float64:
        assert_matches(got, reference(model, nn.CrossEntropyLoss(), X, y, hessian=False), "compiled vs oracle")


@pytest.mark.parametrize("lossfn", [nn.MSELoss(reduction="sum"), nn.CrossEntropyLoss(ignore_index=1),
                                    nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64))],
                         ids=["mse", "ce-ignore", "ce-weight"])
def test_compiled_losses(lossfn):
    """The reduction factor of class indices is read from the targets inside the program."""
    model, X, y = _mlp(torch.float64)
    if isinstance(lossfn, nn.MSELoss):
        y = torch.randn(7, 3, dtype=torch.float64)
    weighted = getattr(lossfn, "weight", None) is not None
    got, want = _both(model, lossfn, X, y, FAST, keep=lambda e: not (weighted and e.name.startswith("sqrt")))
    assert_same(got, want, "compiled", rtol=1e-10)
    if weighted:  # the weights' signs are not read when traced: the square root is refused, loudly
        with pytest.raises(CurvatureError, match="SqrtGGNExact"):
            curvature(model, lossfn, [E.SqrtGGNExact()], compile=FAST)(X, y)
    y2 = torch.zeros_like(y) if y.dtype == torch.long else y * 2  # same signature, other values
    f = curvature(model, lossfn, [E.DiagGGNExact()], compile=FAST)
    f(X, y)
    assert_same(f(X, y2), curvature(model, lossfn, [E.DiagGGNExact()])(X, y2), "new targets", rtol=1e-10)


@pytest.mark.slow
def test_inductor_cnn():
    """The default backend (inductor) on the conv model, float64, against eager."""
    model, X, y = _cnn(torch.float64)
    exts = [E.BatchGrad(), E.DiagGGNExact(), E.KFAC(generator=seeded(0))]
    got = curvature(model, nn.CrossEntropyLoss(), exts, compile=True)(X, y)
    exts[2].generator.manual_seed(0)
    assert_same(got, curvature(model, nn.CrossEntropyLoss(), exts)(X, y), "inductor", rtol=1e-9)


def test_one_compile_per_signature():
    """Same shapes: the program is reused (no recompile); a new batch size: a new one, correct."""
    model, X, y = _mlp(torch.float64)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    f = curvature(model, nn.CrossEntropyLoss(), [E.BatchGrad(), E.DiagGGNExact()], compile={"backend": counter})
    f(X, y)
    assert counter.frame_count == 1
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            f(X + 1.0, y)
    assert counter.frame_count == 1
    got = f(X[:4], y[:4])
    assert counter.frame_count == 2
    assert_same(got, curvature(model, nn.CrossEntropyLoss(), [E.BatchGrad(), E.DiagGGNExact()])(X[:4], y[:4]),
                "new batch size", rtol=1e-10)
    with torch.no_grad():  # parameters are inputs: an update is seen, nothing recompiles
        model[0].weight.add_(0.1)
    assert_same(f(X, y), curvature(model, nn.CrossEntropyLoss(), [E.BatchGrad(), E.DiagGGNExact()])(X, y),
                "updated parameters", rtol=1e-10)
    assert counter.frame_count == 2


@pytest.mark.parametrize("ext", [E.BatchGrad(), E.DiagGGNExact(), E.KFAC(), E.DiagGGNMC()], ids=lambda e: type(e).__name__)
def test_user_fullgraph_step(ext):
    """``torch.compile(step, fullgraph=True)`` around a step that calls a compiled ``f``
    (after one eager call with that signature) equals the eager step, and does not recompile."""
    model, X, y = _mlp(torch.float64)
    f = curvature(model, nn.CrossEntropyLoss(), [ext], compile=FAST)
    f(X, y)

    def step(X, y):
        return sum(v.square().sum() for v in pytree.tree_leaves(f(X, y)))

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.manual_seed(5)
    got = compiled(X, y)
    torch.manual_seed(5)
    want = step(X, y)
    if isinstance(ext, E.DiagGGNMC):  # Dynamo's own random stream: same distribution, check finite only
        assert torch.isfinite(got)
    else:
        assert torch.allclose(got, want, rtol=1e-10, atol=0)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled(X * 2, y)


@pytest.mark.parametrize("ext", [E.KFRA(), E.GGNMP(), E.HMP(), E.PCHMP()],
                         ids=lambda e: type(e).__name__)
def test_refused_extensions(ext):
    model, _, _ = _mlp(torch.float64)
    with pytest.raises(CurvatureError, match=type(ext).__name__ + ".*supported are"):
        curvature(model, nn.CrossEntropyLoss(), [E.BatchGrad(), ext], compile=True)


def test_refused_arguments_and_inputs():
    model, X, y = _mlp(torch.float64)
    with pytest.raises(CurvatureError, match="generic loss|lossfn"):
        curvature(model, lambda o, t: ((o - t) ** 2).sum(), [E.BatchGrad()], compile=True)
    with pytest.raises(CurvatureError, match="batch_chunk_size"):
        curvature(model, nn.CrossEntropyLoss(), [E.BatchGrad()], batch_chunk_size=2, compile=True)
    with pytest.raises(CurvatureTypeError, match="compile"):
        curvature(model, nn.CrossEntropyLoss(), [E.BatchGrad()], compile="yes")
    with pytest.raises(CurvatureError, match="fullgraph"):
        curvature(model, nn.CrossEntropyLoss(), [E.BatchGrad()], compile={"fullgraph": False})
    f = curvature(model, nn.CrossEntropyLoss(), [E.BatchGrad()], compile=FAST)
    with pytest.raises(CurvatureError, match="not differentiable"):
        f(X.requires_grad_(True), y)
    dropout = nn.Sequential(nn.Linear(5, 6), nn.Dropout(0.5), nn.Linear(6, 3)).double().train()
    with pytest.raises(CurvatureError, match="dropout"):
        curvature(dropout, nn.CrossEntropyLoss(), [E.BatchGrad()], compile=FAST)(X.detach(), y)


@pytest.mark.parametrize("first_under_mode", [False, True], ids=["built-before", "built-under-mode"])
def test_under_a_dispatch_mode(first_under_mode):
    """Under a ``TorchDispatchMode`` (a FLOP counter, an operator counter) the program's
    aten graph runs uncompiled (Dynamo skips frames under such a mode, which with
    fullgraph raised and then broke ``f`` for good); before and after, the compiled one."""
    from torch.utils.flop_counter import FlopCounterMode

    model, X, y = _mlp(torch.float64)
    exts = [E.BatchGrad(), E.DiagGGNExact(), E.KFLR()]
    f = curvature(model, nn.CrossEntropyLoss(), exts, compile=FAST)
    want = curvature(model, nn.CrossEntropyLoss(), exts)(X, y)
    if not first_under_mode:
        assert_same(f(X, y), want, rtol=1e-10)
    counter = FlopCounterMode(display=False)
    with counter:
        assert_same(f(X, y), want, rtol=1e-10)
    assert counter.get_total_flops() > 0  # the mode saw the program's operations
    assert_same(f(X, y), want, rtol=1e-10)


def test_cpu_inductor_defaults():
    """Inductor on CPU gets CPU_INDUCTOR_DEFAULTS unless the caller says otherwise."""
    from curvlib._transform.compiled import device_options

    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert device_options({}, cpu) == {"options": {"layout_optimization": False, "max_fusion_size": 2}}
    assert device_options({"options": {"layout_optimization": True, "max_fusion_size": 64}}, cpu) == \
        {"options": {"layout_optimization": True, "max_fusion_size": 64}}
    assert device_options({"backend": "aot_eager"}, cpu) == {"backend": "aot_eager"}
    assert device_options({"mode": "max-autotune"}, cpu) == {"mode": "max-autotune"}
    assert device_options({}, meta) == {}


def _residual_models():
    """Models whose Hessian has residual terms (curvature inside the model): element-wise
    (tanh, sigmoid after a conv), a normalisation (LayerNorm) and softmax attention."""
    torch.manual_seed(1)
    d = torch.float64
    return {
        "tanh": (nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(d), torch.randn(6, 4, dtype=d)),
        "sigmoid-conv": (nn.Sequential(nn.Conv2d(2, 3, 3), nn.Sigmoid(), nn.Flatten(), nn.Linear(12, 3)).to(d),
                         torch.randn(6, 2, 4, 4, dtype=d)),
        "layernorm": (nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.GELU(), nn.Linear(5, 3)).to(d),
                      torch.randn(6, 4, dtype=d)),
        "attention": (nn.Sequential(nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True),
                                    nn.Flatten(), nn.Linear(12, 3)).to(d), torch.randn(6, 3, 4, dtype=d)),
    }


@pytest.mark.parametrize("loss", ["ce", "ce-weight", "mse"])
@pytest.mark.parametrize("name", ["tanh", "sigmoid-conv", "layernorm",
                                  pytest.param("attention", marks=pytest.mark.slow)])  # ~60 s to trace
def test_compiled_hessian_diagonals(name, loss):
    """DiagHessian / BatchDiagHessian compiled: equal to eager and to torch.func.hessian,
    also for new values under the same signature (no recompile): the traced program reads
    no values (residual eigenvalue signs, a weighted loss's scale signs)."""
    model, X = _residual_models()[name]
    gen = seeded(2)
    if loss == "mse":
        lossfn, y = nn.MSELoss(), torch.randn(6, 3, dtype=torch.float64)
    else:
        weight = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64) if loss == "ce-weight" else None
        lossfn, y = nn.CrossEntropyLoss(weight=weight), torch.tensor([0, 1, 2, 1, 0, 2])
    exts = [E.DiagHessian(), E.BatchDiagHessian(), E.DiagGGNExact()]
    f = curvature(model, lossfn, exts, compile=FAST)
    got = f(X, y)
    assert_same(got, curvature(model, lossfn, exts)(X, y), "compiled", rtol=1e-10)
    with sdpa_kernel([SDPBackend.MATH]):  # the oracle's double backward: the fused CPU kernel has none
        assert_matches(got, reference(model, lossfn, X, y, pchmp=False), "compiled vs oracle")
    X2 = torch.randn(X.shape, dtype=X.dtype, generator=gen) * 3
    with torch._dynamo.config.patch(error_on_recompile=True):
        again = f(X2, y)
    with sdpa_kernel([SDPBackend.MATH]):
        assert_matches(again, reference(model, lossfn, X2, y, pchmp=False), "new values vs oracle")


@pytest.mark.slow
def test_compiled_hessian_inductor():
    """DiagHessian through inductor on the residual models, float64, against eager."""
    for name, (model, X) in _residual_models().items():
        y = torch.tensor([0, 1, 2, 1, 0, 2])
        exts = [E.DiagHessian(), E.BatchDiagHessian()]
        got = curvature(model, nn.CrossEntropyLoss(), exts, compile=True)(X, y)
        assert_same(got, curvature(model, nn.CrossEntropyLoss(), exts)(X, y), name, rtol=1e-9)
