"""Models and inputs that used to break curvlib, against brute-force float64 oracles.

* spectral norm in training mode (its ``u``/``v`` buffers must not move);
* KFRA through in-place activations;
* custom ``autograd.Function``s (their backward, not their forward's ops);
* ``Variance`` with one sample;
* hooked and BackPACK-extended models;
* ``X`` as a dict / tuple / ``UserDict`` of tensors.
"""

from __future__ import annotations

import copy
import warnings
from collections import UserDict

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.nn.utils import spectral_norm as hooked_spectral_norm
from torch.nn.utils.parametrizations import spectral_norm

from curvlib import CurvatureError, curvature
from curvlib.extensions import (
    GGNMP, HMP, KFLR, KFRA, PCHMP, BatchDiagHessian, BatchGrad, DiagGGNExact, DiagHessian, SumGradSquared, Variance,
)

from helpers import _assert_same_state, state_snapshot
from oracles import first_order_reference
from oracles_all import assert_close, assert_matches, assert_same, exact_extensions, kflr_map, reference
from oracles_second import kfra_reference, loss_hessian_blocks

DT = torch.float64


def _data(n=5, d=3, seed=1, classes=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=DT), torch.randint(0, classes, (n,), generator=g)


def _shapes(model):
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------- spectral norm


def _spectral(which: str, frozen: bool = False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    (spectral_norm if which == "parametrization" else hooked_spectral_norm)(model[0])
    if frozen:
        model[0].requires_grad_(False)
    return model.train()


def _spectral_oracle_model(model, X):
    """The weight of one ``model(X)`` from the current state: ``W / σ`` with ``u, v`` after
    one power iteration, held constant (as torch does); then those ``u, v`` fixed (eval)."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        ref(X)
    ref[0].eval()
    if hasattr(ref[0], "parametrizations"):
        ref[0].parametrizations.weight[0].eval()
    return ref


@pytest.mark.parametrize("which", ["parametrization", "hook"])
@pytest.mark.parametrize("frozen", [False, True])
def test_spectral_norm_in_training_mode(which, frozen):
    """Buffers (``_u``, ``_v``) and everything else unchanged after calls and product
    evaluations; results equal the oracle from one ``model(X)`` of the current state,
    the same on every call. With the layer trainable, the extensions that run it under
    forward mode / vmap over its weight are refused (torch.func cannot run the in-place
    power iteration); frozen, they run."""
    model = _spectral(which, frozen)
    X, y = _data()
    before = state_snapshot(model)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    assert any(k.endswith(("_u", "weight_u")) for k in buffers)
    exts = exact_extensions(hessian=frozen)
    if not frozen:
        exts = [e for e in exts if e.name != "ggnmp"]
    f = curvature(model, nn.CrossEntropyLoss(), exts)
    attrs = {k: v for k, v in vars(model[0]).items() if isinstance(v, torch.Tensor)}  # (the hook's module.weight)
    first, second = f(X, y), f(X, y)
    assert all(vars(model[0])[k] is v for k, v in attrs.items()), "a tensor attribute was replaced"
    copy.deepcopy(model)  # (a torch.func wrapper left in module.weight could not be copied)
    assert_same(first, second, "two calls", _shapes(model))
    _assert_same_state(before, state_snapshot(model))
    assert all(torch.equal(buffers[k], v) for k, v in model.named_buffers())
    ref = reference(_spectral_oracle_model(model, X), nn.CrossEntropyLoss(), X, y, hessian=frozen, pchmp=False)
    assert_matches(first, ref, f"spectral norm ({which})")
    if not frozen:
        for ext in (GGNMP(), DiagHessian(), BatchDiagHessian(), PCHMP()):
            with pytest.raises(CurvatureError, match=rf"{type(ext).__name__} runs layer '0' .*training mode its forward "
                                                     r"updates buffers in place \(.*spectral.*\.eval\(\)"):
                curvature(model, nn.CrossEntropyLoss(), [ext])(X, y)
        assert all(torch.equal(buffers[k], v) for k, v in model.named_buffers())


# ----------------------------------------------------------------------------- KFRA, in-place


class FunctionalRelu(nn.Module):
    def forward(self, x):
        return F.relu(x, inplace=True)


class MethodElu(nn.Module):
    def forward(self, x):
        return F.elu_(x)


IN_PLACE = {
    "ReLU": (lambda: nn.ReLU(inplace=True), nn.ReLU),
    "ELU": (lambda: nn.ELU(inplace=True), nn.ELU),
    "SELU": (lambda: nn.SELU(inplace=True), nn.SELU),
    "LeakyReLU": (lambda: nn.LeakyReLU(0.1, inplace=True), lambda: nn.LeakyReLU(0.1)),
    "F.relu": (FunctionalRelu, nn.ReLU),
    "F.elu_": (MethodElu, nn.ELU),
}


@pytest.mark.parametrize("act", sorted(IN_PLACE))
@settings(max_examples=2)
@given(n=st.integers(1, 5), reduction=st.sampled_from(["mean", "sum"]), seed=st.integers(0, 2**16))
def test_kfra_with_in_place_activations(act, n, reduction, seed):
    """KFRA (and the Hessian diagonal) of the in-place chain equal the out-of-place chain's,
    and KFRA equals the oracle (ELU/SELU were wrong: the Jacobian was taken at φ(a))."""
    inplace, twin = IN_PLACE[act]
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), inplace(), nn.Linear(4, 4), inplace(), nn.Linear(4, 2)).to(DT)
    plain = nn.Sequential(nn.Linear(3, 4), twin(), nn.Linear(4, 4), twin(), nn.Linear(4, 2)).to(DT)
    plain.load_state_dict(model.state_dict())
    X, y = _data(n, seed=seed)
    lossfn = nn.CrossEntropyLoss(reduction=reduction)
    got = curvature(model, lossfn, [KFRA(), KFLR(), DiagHessian()])(X, y)
    want = curvature(plain, lossfn, [KFRA(), KFLR(), DiagHessian()])(X, y)
    assert_same(got, want, f"in-place {act}", rtol=1e-12)  # (ELU's in-place backward uses its output)
    ref = kfra_reference(plain, lossfn, X, y)
    for name, factors in ref.items():
        for i, (a, b) in enumerate(zip(got["kfra"][name], factors)):
            assert_close(a, b, f"kfra[{name}][{i}] ({act})")


# ----------------------------------------------------------------------------- custom autograd.Function


class RoundSTE(torch.autograd.Function):
    """Straight-through estimator: forward rounds, backward is the identity."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class OnceTanh(torch.autograd.Function):
    """Everything torch.func needs, but a backward that cannot be differentiated again."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return torch.tanh(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (1 - torch.tanh(x) ** 2)

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return t * (1 - torch.tanh(x) ** 2)


class Cube(torch.autograd.Function):
    """Fully functorch-capable: setup_context, a vmap rule, jvp, a differentiable backward."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x**3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * t


class WithFunction(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.a, self.b, self.fn = nn.Linear(3, 4), nn.Linear(4, 2), fn

    def forward(self, x):
        return self.b(torch.tanh(self.fn.apply(3 * self.a(x))))


def _ggn_by_autograd(model, lossfn, X, y, name):
    """``[N, P, P]`` per-sample GGN with the Jacobian from plain autograd (which runs the
    Function's own backward; torch.func cannot run an old-style Function)."""
    params = dict(model.named_parameters())
    out = model(X)
    rows = [torch.autograd.grad(o, params[name], retain_graph=True)[0].flatten() for o in out.flatten()]
    J = torch.stack(rows).reshape(X.shape[0], -1, params[name].numel())
    Hb = loss_hessian_blocks(lossfn, out.detach(), y)
    return torch.einsum("ncp,ncd,ndq->npq", J, Hb, J)


def test_straight_through_estimator_uses_the_custom_backward():
    torch.manual_seed(0)
    model, lossfn, (X, y) = WithFunction(RoundSTE).to(DT), nn.CrossEntropyLoss(), _data()
    exts = [BatchGrad(), Variance(), DiagGGNExact(), KFLR()] + exact_extensions()[5:7]  # + batch diag, sqrt
    qs = curvature(model, lossfn, exts)(X, y)
    ref = first_order_reference(model, lossfn, X, y)
    for key in ("grad", "grad_batch", "variance"):
        for name, want in ref[key].items():
            assert_close(qs[key][name], want, f"{key}[{name}]")
    assert qs["grad"]["a.weight"].abs().max() > 0  # round's own derivative would be zero
    for name, p in model.named_parameters():
        Gn = _ggn_by_autograd(model, lossfn, X, y, name)
        assert_close(qs["diag_ggn_exact"][name], Gn.sum(0).diagonal().reshape(p.shape), f"diag_ggn_exact[{name}]")
        assert_close(qs["diag_ggn_exact_batch"][name], Gn.diagonal(dim1=1, dim2=2).reshape((5,) + tuple(p.shape)),
                     f"diag_ggn_exact_batch[{name}]")
        S = qs["sqrt_ggn_exact"][name].flatten(2)
        assert_close(torch.einsum("vnp,vnq->npq", S, S), Gn, f"sqrt_ggn_exact[{name}]")
    for ext in (DiagHessian(), GGNMP(), HMP()):
        with pytest.raises(CurvatureError, match=rf"{type(ext).__name__} runs the custom autograd\.Function RoundSTE "
                                                 r"\(graph node '.*'\) under torch\.func transforms, which needs a "
                                                 r"setup_context staticmethod"):
            curvature(model, lossfn, [ext])
    params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    with pytest.raises(CurvatureError, match=r"graph node 'round_ste_apply' .*RoundSTE\.apply.*setup_context"):
        curvature(model, lossfn, [BatchGrad()])(X, y, params=params)  # differentiable results: torch.func


@pytest.mark.parametrize("ext", [DiagHessian, BatchDiagHessian, PCHMP, HMP])
def test_once_differentiable_backward_refuses_second_derivatives(ext):
    torch.manual_seed(0)
    model, (X, y) = WithFunction(OnceTanh).to(DT), _data()
    with pytest.raises(CurvatureError, match=rf"{ext.__name__} runs the custom autograd\.Function OnceTanh \(graph node "
                                             r"'.*'\) .*a backward that is not @once_differentiable"):
        curvature(model, nn.CrossEntropyLoss(), [ext()])
    qs = curvature(model, nn.CrossEntropyLoss(), [BatchGrad(), DiagGGNExact(), GGNMP()])(X, y)
    ref = reference(_TanhTwin(model), nn.CrossEntropyLoss(), X, y, hessian=False)
    assert_matches(qs, ref, "once_differentiable: first order and GGN")


class _TanhTwin(nn.Module):
    """``WithFunction(OnceTanh)`` with ``torch.tanh`` (same parameters)."""

    def __init__(self, model):
        super().__init__()
        self.a, self.b = copy.deepcopy(model.a), copy.deepcopy(model.b)

    def forward(self, x):
        return self.b(torch.tanh(torch.tanh(3 * self.a(x))))


def test_functorch_capable_function_gets_exact_second_order():
    """A Function with setup_context, a vmap rule, jvp and a differentiable backward:
    DiagHessian, BatchDiagHessian, GGNMP and HMP (and first order) equal the oracle."""
    torch.manual_seed(0)
    model, (X, _) = WithFunction(Cube).to(DT), _data()
    X, y = X / 2, torch.randn(5, 2, generator=torch.Generator().manual_seed(3), dtype=DT)
    exts = [e for e in exact_extensions() if e.name != "pchmp"]
    qs = curvature(model, nn.MSELoss(), exts)(X, y)
    assert_matches(qs, reference(model, nn.MSELoss(), X, y, pchmp=False), "Cube")
    assert qs["diag_h"]["a.weight"].abs().max() > 0


def test_weight_norm():
    """``weight_norm`` (parametrization or old-style hook): first order, the GGN family and
    HMP equal the oracle; torch has no forward-mode derivative for its kernel, so GGNMP,
    PCHMP and the Hessian diagonals are refused with a CurvatureError saying so; the hook's
    ``module.weight`` is left as it was (no torch.func wrapper behind)."""
    from torch.nn.utils import weight_norm as hooked_weight_norm
    from torch.nn.utils.parametrizations import weight_norm

    X, y = _data()
    for wn in (weight_norm, hooked_weight_norm):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
        wn(model[0])
        attrs = {k: v for k, v in vars(model[0]).items() if isinstance(v, torch.Tensor)}
        exts = [e for e in exact_extensions(hessian=False) if e.name != "ggnmp"]
        qs = curvature(model, nn.CrossEntropyLoss(), exts)(X, y)
        for ext in (GGNMP(), DiagHessian(), PCHMP()):
            with pytest.raises(CurvatureError, match=r"forward-mode derivatives \(torch\.func\.jvp\) .* are needed, but "
                                                     r"torch has none for one of them.*_weight_norm_interface.*HMP"):
                out = curvature(model, nn.CrossEntropyLoss(), [ext])(X, y)
                name, p = next((n, p) for n, p in model.named_parameters() if n != "0.bias")  # (g or v)
                out[ext.name][name](torch.ones((1,) + tuple(p.shape), dtype=DT))
        assert {k: v for k, v in vars(model[0]).items() if isinstance(v, torch.Tensor)}.keys() == attrs.keys()
        assert all(vars(model[0])[k] is v for k, v in attrs.items()), "a tensor attribute was replaced"
        assert_matches(qs, reference(model, nn.CrossEntropyLoss(), X, y, hessian=False), wn.__module__)


# ----------------------------------------------------------------------------- Variance, N = 1


@pytest.mark.parametrize("chunk", [None, 1, 2])
@pytest.mark.parametrize("n", [1, 4])
def test_variance_non_negative_and_exact(n, chunk):
    """``N = 1``: ``g² − g²`` is zero, not slightly negative (square roots stay real); otherwise
    the oracle. Also with ``batch_chunk_size``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).to(DT)
    for scale in (1.0, 1e3):
        X, y = _data(n)
        X = X * scale
        qs = curvature(model, nn.CrossEntropyLoss(), [Variance(), SumGradSquared()], batch_chunk_size=chunk)(X, y)
        ref = first_order_reference(model, nn.CrossEntropyLoss(), X, y)
        for name, v in qs["variance"].items():
            assert (v >= 0).all(), f"variance[{name}] has negative entries (N={n})"
            assert not v.sqrt().isnan().any()
            assert_close(v, ref["variance"][name].clamp(min=0), f"variance[{name}]", atol=1e-12)


# ----------------------------------------------------------------------------- hooks, BackPACK


def test_hooked_activation_modules_are_run_without_their_hooks():
    """Forward and full backward hooks on the activations: the Hessian family (which takes
    their second derivative), KFRA and the products equal the un-hooked model's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Sigmoid(), nn.Linear(4, 2)).to(DT)
    plain = copy.deepcopy(model)
    calls = []
    model[1].register_forward_hook(lambda m, i, o: o * 2)
    model[3].register_full_backward_hook(lambda m, gi, go: calls.append(1))
    X, y = _data()
    with pytest.warns(UserWarning, match=r"does not run the forward hooks of '1' \(Tanh\)"):
        f = curvature(model, nn.CrossEntropyLoss(), exact_extensions(kfra=True))
    assert_same(f(X, y), curvature(plain, nn.CrossEntropyLoss(), exact_extensions(kfra=True))(X, y), "hooks",
                _shapes(model))
    assert calls == []


def test_backpack_extended_model():
    """After ``backpack.extend`` and a BackPACK backward (its hooks and stored inputs on
    every module), curvlib gives the un-extended model's results, Linear keeps its rule
    (KFLR, KFRA), and no hook warning is raised."""
    backpack = pytest.importorskip("backpack")
    from backpack.extensions import KFLR as BackpackKFLR, BatchGrad as BackpackBatchGrad

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    model, lossfn = backpack.extend(copy.deepcopy(plain)), backpack.extend(nn.CrossEntropyLoss())
    X, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with backpack.backpack(BackpackKFLR(), BackpackBatchGrad()):
            lossfn(model(X), y).backward()
    exts = exact_extensions(kflr=True, kfra=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        qs = curvature(model, lossfn, exts)(X, y)
    assert_same(qs, curvature(plain, nn.CrossEntropyLoss(), exts)(X, y), "extended", _shapes(plain))
    for name in ("0.weight", "2.bias"):
        for a, b in zip(qs["kflr"][name], getattr(dict(model.named_parameters())[name], "kflr")):
            assert_close(a, b, f"kflr[{name}] vs BackPACK's")
    assert_matches(qs, reference(plain, nn.CrossEntropyLoss(), X, y, kflr=kflr_map(plain), kfra=True), "extended")


# ----------------------------------------------------------------------------- dict / tuple inputs


class DictNet(nn.Module):
    """A Hugging Face-style model: one mapping argument (features and token ids)."""

    def __init__(self):
        super().__init__()
        self.a, self.emb, self.b = nn.Linear(3, 4), nn.Embedding(6, 2), nn.Linear(6, 2)

    def core(self, x, ids):
        return self.b(torch.cat([torch.tanh(self.a(x)), self.emb(ids)], 1))

    def forward(self, batch):
        return self.core(batch["x"], batch["ids"])


class TupleNet(DictNet):
    def forward(self, batch):
        x, ids = batch
        return self.core(x, ids)


class TensorNet(DictNet):
    """The same model on one tensor ``[x, ids]`` (ids as floats, turned into indices)."""

    def forward(self, z):
        return self.core(z[:, :3], z[:, 3].long())


@pytest.mark.parametrize("container", ["dict", "UserDict", "tuple", "list"])
def test_mapping_and_tuple_inputs(container):
    """Every extension equals the tensor-input model's (and the oracle); batch chunks
    work; tensors with different batch sizes are refused."""
    torch.manual_seed(0)
    dict_model = (TupleNet if container in ("tuple", "list") else DictNet)().to(DT)
    tensor_model = TensorNet().to(DT)
    tensor_model.load_state_dict(dict_model.state_dict())
    X, y = _data(5)
    ids = torch.randint(0, 6, (5,), generator=torch.Generator().manual_seed(2))
    inp = {"dict": lambda: {"x": X, "ids": ids}, "UserDict": lambda: UserDict(x=X, ids=ids),
           "tuple": lambda: (X, ids), "list": lambda: [X, ids]}[container]()
    Z = torch.cat([X, ids[:, None].to(DT)], 1)
    exts = exact_extensions()
    got = curvature(dict_model, nn.CrossEntropyLoss(), exts)(inp, y)
    assert_same(got, curvature(tensor_model, nn.CrossEntropyLoss(), exts)(Z, y), container, _shapes(dict_model))
    assert_matches(got, reference(tensor_model, nn.CrossEntropyLoss(), Z, y, pchmp=False), container)
    chunked = curvature(dict_model, nn.CrossEntropyLoss(), [BatchGrad(), DiagGGNExact(), Variance()], batch_chunk_size=2)
    c = chunked(inp, y)
    for key in ("grad_batch", "diag_ggn_exact", "variance", "grad"):
        for name, v in c[key].items():
            assert_close(v, got[key][name], f"chunked {key}[{name}]")
    short = {"dict": lambda: {"x": X, "ids": ids[:4]}, "UserDict": lambda: UserDict(x=X, ids=ids[:4]),
             "tuple": lambda: (X, ids[:4]), "list": lambda: [X, ids[:4]]}[container]()
    with pytest.raises(CurvatureError, match=r"The tensors of X have different sizes in dim 0 .*\[5, 3\].*\[4\]"):
        curvature(dict_model, nn.CrossEntropyLoss(), [BatchGrad()])(short, y)
