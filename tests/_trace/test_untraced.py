"""Models torch.fx cannot trace: the ATen front end, and, without it, first order
through the eager runner with second order refused.

The eager runner (:func:`curvlib._trace.untraced.run_eager`) is tested through the
engine functions directly (``_first_order`` below replays what
``curvature(...)(X, y)`` does for first order), and end to end through
``curvature`` once the transform uses it for ``program.graph is None``.
"""

from __future__ import annotations

import importlib.util
import inspect
import warnings

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from torch import nn
from torch.nn.utils import parametrize

from curvlib import CurvatureError, curvature, losses
from curvlib._core.settings import override
from curvlib._evaluate.linearise import Forward, forward_with_probes
from curvlib._evaluate.first_order import first_order
from curvlib._plan.plan import make_plan
from curvlib._trace.program import trace_program
from curvlib._trace.untraced import run_eager
from curvlib.extensions import BatchGrad, BatchL2Grad, DiagGGNExact, KFAC, SumGradSquared, Variance
from oracles.reference import assert_matches, exact_extensions, reference

from oracles.checks import _assert_same_state, check_first_order, state_snapshot
from oracles.first_order import assert_close_dicts, first_order_reference
from oracles.reference import assert_matches, exact_extensions, reference
from oracles.on_device import seeded

WANTED = ("grad_batch", "batch_l2", "sum_grad_squared", "variance")
LOSSES = [
    lambda: nn.MSELoss(),
    lambda: nn.MSELoss(reduction="sum"),
    lambda: nn.CrossEntropyLoss(),
    lambda: nn.CrossEntropyLoss(reduction="sum"),
]


def _first_order(model, lossfn, X, y, params=None, program=None):
    """What ``curvature(model, lossfn, first-order extensions)(X, y, params)`` computes,
    with the eager runner (independent of how the transform is wired)."""
    program = trace_program(model) if program is None else program
    assert program.graph is None, "test model is traceable; it should not be"
    spec = losses.loss_spec(lossfn)
    all_params = dict(model.named_parameters())
    if params is None:
        trainable = [n for n, p in all_params.items() if p.requires_grad]
        values = {n: p.detach() for n, p in all_params.items()}
    else:
        trainable = [n for n in all_params if n in params]
        values = {n: params.get(n, p.detach()) for n, p in all_params.items()}
    plan = make_plan(program, X, values, frozenset(trainable), runner=run_eager)
    lin = forward_with_probes(Forward(program, plan, X, values, frozenset(trainable), runner=run_eager))
    loss, pullback = torch.func.vjp(lambda o: losses.loss_value(spec, o, y), lin.out)
    (g_out,) = pullback(torch.ones_like(loss))
    gs, _ = lin.pull(g_out)
    result = first_order(lin.sites, gs, trainable, values, [BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()],
                         X.shape[0])
    result["loss"] = loss
    return result


def _check(model, lossfn, X, y):
    """Eager first order equals the per-sample-copies oracle; the model is untouched."""
    before = state_snapshot(model)
    qs = _first_order(model, lossfn, X, y)
    _assert_same_state(before, state_snapshot(model))
    ref = first_order_reference(model, lossfn, X, y)
    torch.testing.assert_close(qs["loss"], lossfn(model(X), y))
    assert_close_dicts(qs["grad"], ref["grad"], "grad")
    for q in WANTED:
        assert_close_dicts(qs[q], ref[q], q)
    return qs


def _targets(lossfn, out_features, n, gen):
    if isinstance(lossfn, nn.CrossEntropyLoss):
        return torch.randint(0, out_features, (n,), generator=gen)
    return torch.randn(n, out_features, generator=gen, dtype=torch.float64)


# --------------------------------------------------------------------------- models


class BranchOnValue(nn.Module):
    """``if`` on a tensor value: all samples agree (all inputs positive, or all negative)."""

    def __init__(self, d=3, h=4, c=3):
        super().__init__()
        self.inp = nn.Linear(d, h)
        self.pos = nn.Sequential(nn.Tanh(), nn.Linear(h, c))
        self.neg = nn.Linear(h, c)

    def forward(self, x):
        h = self.inp(x)
        if bool((x > 0).all()):  # BRANCH-LINE
            return self.pos(h)
        return self.neg(torch.sigmoid(h)) * 2.0


class LoopFromItem(nn.Module):
    """A shared module applied a number of times read with ``.item()`` from the input
    (every sample carries the same count in its last feature)."""

    def __init__(self, d=3, h=4, c=3):
        super().__init__()
        self.inp = nn.Linear(d, h)
        self.mid = nn.Linear(h, h)
        self.alias = self.mid  # the same module under a second name
        self.out = nn.Linear(h, c)

    def forward(self, x):
        steps = int(x[:, -1].max().item())
        h = torch.tanh(self.inp(x))
        for i in range(steps):
            h = torch.tanh((self.mid if i % 2 == 0 else self.alias)(h))
        return self.out(h)


class Scale(nn.Module):
    """A user module owning a parameter and a child layer (one generic layer)."""

    def __init__(self, h):
        super().__init__()
        self.gain = nn.Parameter(torch.rand(h) + 0.5)
        self.lin = nn.Linear(h, h)

    def forward(self, x):
        if x.shape[-1] > 100:  # shape-dependent: untraceable, fine under vmap
            x = x[..., :100]
        return self.lin(x) * self.gain


class ShapeBranchConvNet(nn.Module):
    """Branches on the input's rank; Conv2d, BatchNorm2d (eval), a nested owner, tied weights."""

    def __init__(self, c=3):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.bn = nn.BatchNorm2d(2)
        self.emb = nn.Linear(8, 4)
        self.scale = Scale(4)
        self.head = nn.Linear(4, c)
        self.head2 = nn.Linear(4, c, bias=False)
        self.head2.weight = self.head.weight  # tied

    def forward(self, x):
        if x.dim() == 3:
            x = x.unsqueeze(1)
        h = F.relu(self.bn(self.conv(x)))
        h = F.adaptive_avg_pool2d(h, (2, 2)).flatten(1)
        h = self.scale(torch.tanh(self.emb(h)))
        return self.head(h) - 0.5 * self.head2(h)


class OwnsParameter(nn.Module):
    """The model itself owns a parameter (it is one generic layer); shape-dependent branch."""

    def __init__(self, d=3, c=3):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, c))
        self.fc = nn.Linear(c, c)

    def forward(self, x):
        if x.shape[1] == 3:
            x = x @ self.w
        return self.fc(torch.tanh(x))


class WeightNormed(nn.Module):
    """A parametrized Linear without bias (its parameters live in its parametrization)."""

    def __init__(self, d=3, c=3):
        super().__init__()
        self.fc = nn.Linear(d, 4, bias=False)
        parametrize.register_parametrization(self.fc, "weight", _Double())
        self.out = nn.Linear(4, c)

    def forward(self, x):
        if x.sum() > 0:
            x = x * 1.5
        return self.out(torch.tanh(self.fc(x)))


class _Double(nn.Module):
    def forward(self, w):
        return 2.0 * w


# --------------------------------------------------------------------------- first order


@given(
    sign=st.sampled_from([1.0, -1.0]),
    n=st.integers(1, 4),
    loss=st.sampled_from(range(len(LOSSES))),
    seed=st.integers(0, 2**16),
)
def test_branch_on_value(sign, n, loss, seed):
    torch.manual_seed(seed)
    gen = seeded(seed)
    model = BranchOnValue().double()
    X = sign * (torch.rand(n, 3, generator=gen, dtype=torch.float64) + 0.1)
    lossfn = LOSSES[loss]()
    qs = _check(model, lossfn, X, _targets(lossfn, 3, n, gen))
    unused = ["neg.weight", "neg.bias"] if sign > 0 else ["pos.1.weight", "pos.1.bias"]
    for name in unused:
        assert not qs["grad_batch"][name].any()


@given(steps=st.integers(0, 3), n=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_loop_count_from_item_shared_module(steps, n, seed):
    torch.manual_seed(seed)
    gen = seeded(seed)
    model = LoopFromItem().double()
    X = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    X[:, -1] = float(steps)
    lossfn = nn.MSELoss()
    _check(model, lossfn, X, _targets(lossfn, 3, n, gen))


@given(n=st.integers(1, 3), seed=st.integers(0, 2**16), rank3=st.booleans())
def test_shape_branch_conv_bn_nested_tied(n, seed, rank3):
    torch.manual_seed(seed)
    gen = seeded(seed)
    model = ShapeBranchConvNet().double()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    model.eval()
    X = torch.randn(n, 4, 4, generator=gen, dtype=torch.float64)
    if not rank3:
        X = X.unsqueeze(1)
    lossfn = nn.CrossEntropyLoss()
    _check(model, lossfn, X, _targets(lossfn, 3, n, gen))


@pytest.mark.parametrize("Model", [OwnsParameter, WeightNormed])
def test_generic_layers(Model):
    torch.manual_seed(0)
    model = Model().double()
    # positive rows: each sample alone takes the batch's branch (``x.sum() > 0``), so per-sample
    # quantities are defined (the oracle runs each sample alone; the public call checks this)
    X = torch.randn(4, 3, dtype=torch.float64).abs() + 0.1
    _check(model, nn.MSELoss(), X, torch.randn(4, 3, dtype=torch.float64))


def test_params_argument_and_frozen_parameters():
    torch.manual_seed(1)
    model = BranchOnValue().double()
    model.inp.bias.requires_grad_(False)
    X = torch.rand(3, 3, dtype=torch.float64) + 0.1
    y = torch.randn(3, 3, dtype=torch.float64)
    qs = _first_order(model, nn.MSELoss(), X, y)
    assert "inp.bias" not in qs["grad"]
    ref = first_order_reference(model, nn.MSELoss(), X, y)
    assert_close_dicts(qs["grad_batch"], ref["grad_batch"], "grad_batch")
    # params= replaces the model's tensors; quantities for exactly its entries.
    new = {"pos.1.weight": torch.randn(3, 4, dtype=torch.float64)}
    qs = _first_order(model, nn.MSELoss(), X, y, params=new)
    assert list(qs["grad_batch"]) == ["pos.1.weight"]

    def loss_of(w):
        p = {n: q.detach() for n, q in model.named_parameters()}
        p["pos.1.weight"] = w
        return nn.MSELoss()(torch.func.functional_call(model, p, (X,)), y)

    torch.testing.assert_close(qs["grad"]["pos.1.weight"], torch.func.grad(loss_of)(new["pos.1.weight"]))


def test_composes_with_vmap_over_params():
    torch.manual_seed(2)
    model = BranchOnValue().double()
    X = -(torch.rand(3, 3, dtype=torch.float64) + 0.1)
    y = torch.randn(3, 3, dtype=torch.float64)
    ws = torch.randn(2, 3, 4, dtype=torch.float64)
    batched = torch.func.vmap(
        lambda w: _first_order(model, nn.MSELoss(), X, y, params={"neg.weight": w})["batch_l2"]["neg.weight"]
    )(ws)
    for i in range(2):
        single = _first_order(model, nn.MSELoss(), X, y, params={"neg.weight": ws[i]})
        torch.testing.assert_close(batched[i], single["batch_l2"]["neg.weight"])


class RandomDepth(nn.Module):
    """A random branch (stochastic depth) that depends on the input, then dropout."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if torch.rand(()) + 0 * x.sum() < 0.5:
            h = self.b(h)
        return self.drop(h)


class DropoutThenRandomBranch(RandomDepth):
    """The branch's random number comes after a batch-sized draw: for N and N + 1
    samples it differs, so the planning passes may take different paths."""

    def forward(self, x):
        h = self.drop(torch.tanh(self.a(x)))
        if torch.rand(()) + 0 * x.sum() < 0.5:
            h = self.b(h)
        return h


@pytest.mark.parametrize("seed", range(4))
def test_random_branches_follow_the_seed(seed):
    """Planning passes leave the random state alone: the run takes model(X)'s random path."""
    _check_random(RandomDepth().double(), seed)


@pytest.mark.parametrize("seed", range(8))
def test_random_branch_after_dropout_right_or_refused(seed):
    try:
        _check_random(DropoutThenRandomBranch().double(), seed)
    except CurvatureError as err:
        assert "differently for a batch of N=4" in str(err)


def _check_random(model, seed):
    X, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    program = trace_program(model)  # tracing runs torch.rand: before seeding, as in curvature()
    torch.manual_seed(seed)
    qs = _first_order(model, nn.MSELoss(), X, y, program=program)
    torch.manual_seed(seed)
    loss = nn.MSELoss()(model(X), y)
    torch.testing.assert_close(qs["loss"], loss)
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    for (name, p), g in zip(model.named_parameters(), grads):
        torch.testing.assert_close(qs["grad"][name], torch.zeros_like(p) if g is None else g)
        torch.testing.assert_close(qs["grad_batch"][name].sum(0), qs["grad"][name])


# --------------------------------------------------------------------------- layers table


def test_layers_are_outermost_parameter_owners():
    assert list(trace_program(BranchOnValue()).layers) == ["inp", "pos.1", "neg"]
    assert list(trace_program(LoopFromItem()).layers) == ["inp", "mid", "out"]  # alias: once
    layers = trace_program(ShapeBranchConvNet()).layers
    assert list(layers) == ["conv", "bn", "emb", "scale", "head", "head2"]
    assert layers["scale"].kind == "generic"
    assert set(layers["scale"].names.values()) == {"scale.gain", "scale.lin.weight", "scale.lin.bias"}
    assert layers["head2"].names == {"weight": "head.weight"}  # tied: canonical name
    assert list(trace_program(OwnsParameter()).layers) == [""]
    wn = trace_program(WeightNormed()).layers
    assert list(wn) == ["fc", "out"] and wn["fc"].kind == "generic"


# --------------------------------------------------------------------------- statelessness


class RaisesMidway(BranchOnValue):
    def forward(self, x):
        self.inp(x)
        raise ValueError("user error in forward")


def test_model_untouched_when_forward_raises():
    model = RaisesMidway().double()
    before = state_snapshot(model)
    with pytest.raises(ValueError, match="user error"):
        _first_order(model, nn.MSELoss(), torch.ones(2, 3, dtype=torch.float64), torch.ones(2, 3, dtype=torch.float64))
    _assert_same_state(before, state_snapshot(model))
    assert all("forward" not in vars(m) for m in model.modules())
    assert not nn.modules.module._global_forward_pre_hooks


# --------------------------------------------------------------------------- refusals


class DirectUse(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(3, 4)

    def forward(self, x):
        h = torch.tanh(self.enc(x))
        if x.sum() > 0:
            h = h * 2
        return F.linear(h, self.enc.weight.t())  # DIRECT-USE


class TrainModeBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.bn = nn.BatchNorm1d(3, affine=False)

    def forward(self, x):
        if x.sum() > 0:
            x = x * 2
        return self.bn(self.fc(x))


def _line_of(cls, marker):
    src, start = inspect.getsourcelines(cls)
    return start + next(i for i, line in enumerate(src) if marker in line)


def test_direct_parameter_use_refused_with_line():
    model = DirectUse().double()
    with pytest.raises(CurvatureError, match=r"parameter 'enc.weight' outside its module") as info:
        _first_order(model, nn.MSELoss(), torch.rand(2, 3, dtype=torch.float64), torch.ones(2, 3, dtype=torch.float64))
    assert f"test_untraced.py:{_line_of(DirectUse, 'DIRECT-USE')}" in str(info.value)
    # Metadata and detached reads are fine.
    assert all("forward" not in vars(m) for m in model.modules())


def test_direct_parameter_line_found_in_a_folder_named_curvlib(tmp_path):
    """User code under a clone named ``curvlib/`` keeps its pointer:
    "inside the library" is the package's own folder, not a name in the path."""
    user_dir = tmp_path / "curvlib" / "tests"
    user_dir.mkdir(parents=True)
    source = inspect.getsource(DirectUse)
    (user_dir / "user_model.py").write_text("import torch\nimport torch.nn.functional as F\nfrom torch import nn\n\n\n" + source)
    spec = importlib.util.spec_from_file_location("user_model_in_curvlib_folder", user_dir / "user_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(CurvatureError, match=r"parameter 'enc.weight' outside its module") as info:
        _first_order(module.DirectUse().double(), nn.MSELoss(), torch.rand(2, 3, dtype=torch.float64),
                     torch.ones(2, 3, dtype=torch.float64))
    line = 5 + next(i for i, text in enumerate(source.splitlines()) if "DIRECT-USE" in text) + 1
    assert f"{user_dir / 'user_model.py'}:{line}" in str(info.value)


def test_training_mode_batchnorm_refused():
    with pytest.raises(CurvatureError, match="BatchNorm layer 'bn'.*training mode"):
        _first_order(TrainModeBatchNorm().double(), nn.MSELoss(), torch.rand(3, 3, dtype=torch.float64), torch.ones(3, 3, dtype=torch.float64))


def test_hooked_layer_refused():
    model = BranchOnValue().double()
    handle = model.neg.register_forward_hook(lambda m, a, o: o * 2)
    try:
        with pytest.raises(CurvatureError, match="'neg' \\(Linear\\) has forward hooks"):
            _first_order(model, nn.MSELoss(), torch.rand(2, 3, dtype=torch.float64), torch.ones(2, 3, dtype=torch.float64))
    finally:
        handle.remove()


def test_stale_plan_with_other_shapes_refused():
    """A plan made on another path: refused, never mixed up."""

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 2), nn.Linear(3, 5)

        def forward(self, x):
            return self.a(x) if x.sum() > 0 else self.b(x)[:, :2]

    model = Two().double()
    program = trace_program(model)
    values = {n: p.detach() for n, p in model.named_parameters()}
    Xp = torch.rand(2, 3, dtype=torch.float64)
    plan = make_plan(program, Xp, values, frozenset(values), runner=run_eager)
    with pytest.raises(CurvatureError, match="differently than in curvlib's planning pass"):
        forward_with_probes(Forward(program, plan, -Xp, values, frozenset(values), runner=run_eager))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_second_order_through_the_aten_front_end(sign):
    """torch.fx cannot trace the model's own forward; the ATen front end takes the
    branch the input takes: every exact extension matches brute force on either side."""
    torch.manual_seed(3)
    model = BranchOnValue().double()
    X = sign * (torch.rand(3, 3, dtype=torch.float64) + 0.1)
    y = torch.randint(0, 3, (3,))
    qs = curvature(model, nn.CrossEntropyLoss(), exact_extensions(hessian=True))(X, y)
    assert_matches(qs, reference(model, nn.CrossEntropyLoss(), X, y, hessian=True, pchmp=False), f"sign {sign}")


@pytest.mark.parametrize("ext", [DiagGGNExact(), KFAC()])
def test_second_order_refused_with_model_line_when_no_front_end_can_trace(ext):
    """Without the ATen front end (here switched off, as when make_fx cannot run the model),
    second order is refused, naming the model line torch.fx failed at."""
    model = BranchOnValue()
    with override(aten_front_end=False), pytest.raises(CurvatureError) as info:
        curvature(model, nn.MSELoss(), [BatchGrad(), ext])(torch.rand(2, 3), torch.rand(2, 3))
    msg = str(info.value)
    assert type(ext).__name__ in msg and "could not be traced with torch.fx" in msg
    assert "cannot be used as inputs to control flow" in msg  # why
    assert f"test_untraced.py:{_line_of(BranchOnValue, 'BRANCH-LINE')}" in msg  # where
    assert "First-order extensions do not need the graph" in msg


# --------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_curvature_end_to_end(sign):
    torch.manual_seed(3)
    model = BranchOnValue().double()
    X = sign * (torch.rand(4, 3, dtype=torch.float64) + 0.1)
    check_first_order(model, nn.MSELoss(), X, torch.randn(4, 3, dtype=torch.float64))


def test_curvature_end_to_end_loop_and_item():
    model = LoopFromItem().double()
    X = torch.randn(3, 3, dtype=torch.float64)
    X[:, -1] = 2.0
    qs = check_first_order(model, nn.MSELoss(), X, torch.randn(3, 3, dtype=torch.float64))
    assert set(qs) == {"loss", "grad", "grad_batch", "batch_l2", "sum_grad_squared", "variance"}
    assert isinstance(BatchL2Grad(), BatchL2Grad) and SumGradSquared and Variance


class _BilinearNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.bil = nn.Bilinear(3, 4, 5)
        self.out = nn.Linear(5, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.bil(x[:, :3], x[:, 3:])))


@settings(max_examples=4)
@given(seed=st.integers(0, 2**16), n=st.integers(2, 4))
def test_bilinear_exact_without_torch_warnings(seed, n):
    """``nn.Bilinear`` (generic rule) as an einsum: every exact extension matches the brute
    force and torch's "performance drop" warning (``_trilinear`` has no vmap rule) is not
    raised."""
    gen = seeded(seed)
    torch.manual_seed(seed)
    model = _BilinearNet().double()
    X, y = torch.randn(n, 7, dtype=torch.float64, generator=gen), torch.randint(0, 2, (n,), generator=gen)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qs = curvature(model, nn.CrossEntropyLoss(), exact_extensions())(X, y)
    assert not [w for w in caught if "performance drop" in str(w.message)]
    assert_matches(qs, reference(model, nn.CrossEntropyLoss(), X, y, hessian=True, pchmp=False), "bilinear")


class _NoMakeFx(nn.Module):
    """Keyword inputs and a forward that refuses to run under ``make_fx`` (neither front end
    traces it): run eagerly, called with ``X`` as keywords."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)
        self.branch = True

    def forward(self, input_ids, mask):
        from torch.fx.experimental.proxy_tensor import get_proxy_mode  # (what the test needs of torch, once)

        if get_proxy_mode() is not None:
            raise RuntimeError("this forward does not run under make_fx")
        if self.branch and bool(mask.sum() > -1):  # (a value the Python reads: no torch.fx graph either)
            return self.b(torch.tanh(self.a(input_ids)) * mask)
        return self.b(torch.tanh(self.a(input_ids)) * mask)


@pytest.mark.parametrize("branch", [True, False])
def test_keyword_inputs_reach_an_eager_model_as_keywords(branch):
    """First order of a model the ATen front end cannot trace, with dict ``X``: ``model(**X)``,
    exact; second order refused, saying why the ATen trace failed, where torch.fx cannot trace
    it either (``branch``), else exact on torch.fx's graph."""
    from oracles import zoo_reference as oz
    from oracles.zoo import Problem

    g = seeded(3)
    model = _NoMakeFx().to(torch.float64)
    model.branch = branch  # False: torch.fx traces it (with the dict's tensors as keyword placeholders)
    X = {"input_ids": torch.randn(5, 4, generator=g, dtype=torch.float64),
         "mask": torch.rand(5, 5, generator=g, dtype=torch.float64)}
    y = torch.randint(0, 3, (5,), generator=g)
    qs = curvature(model, nn.CrossEntropyLoss(), [BatchGrad()])(X, y)
    expected = oz.individual_gradients(Problem(model, X, y, nn.CrossEntropyLoss(), None, ""))
    for k, v in expected.items():
        assert torch.allclose(qs["grad_batch"][k], v, rtol=1e-10, atol=1e-12), k
    if branch:
        with pytest.raises(CurvatureError, match="does not run under make_fx"):
            curvature(model, nn.CrossEntropyLoss(), [DiagGGNExact()])(X, y)
        return
    # torch.fx traces ``model(**X)``: the graph's DiagGGNExact is exact
    prob = Problem(model, X, y, nn.CrossEntropyLoss(), None, "")
    diag = curvature(model, nn.CrossEntropyLoss(), [DiagGGNExact()])(X, y)["diag_ggn_exact"]
    for k, v in oz.ggn_diagonals(oz.ggn_parts(prob)).items():
        assert torch.allclose(diag[k], v.sum(0), rtol=1e-10, atol=1e-12), k
