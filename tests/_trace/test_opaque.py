"""Submodules torch.fx cannot trace stay opaque graph nodes, not a refusal of the model.

Such models are traced at the ATen level instead (``curvlib._trace.aten``,
``tests/_trace/test_aten.py``); the opaque leaves remain the fallback where that front end cannot
run (a model whose forward fails under ``make_fx``). This file tests the fallback: the
ATen front end is switched off for every test here (``_opaque_fallback``).

A model whose submodule's ``forward`` fails under fx (assertions or ``isinstance``
checks on proxies, branches on tensor values, BackPACK's ``SumModule``) is traced
with that submodule as one leaf: a layer run by the generic rule when it owns
parameters, a parameter-free node otherwise. Every extension curvlib computes on a
generic layer is checked against the float64 brute-force oracles (per-sample copies,
full Jacobians and Hessians by autograd, the PCHMP decomposition with the opaque
modules as single nodes); KFAC/KFLR are exact for the traced layers, refused, naming the
module, for Linear/Conv parameters inside an opaque one, and the exact GGN block's diagonal
for an opaque module's own parameters (stacked expert weights), as for any generic layer.
"""

from __future__ import annotations

import warnings

import hypothesis.strategies as st
import pytest
import torch
from backpack.custom_module.branching import Parallel, SumModule
from backpack.custom_module.graph_utils import convert_module_to_backpack
from hypothesis import given
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib._core.settings import override
from curvlib._trace.program import trace_program
from curvlib.extensions import KFAC, KFLR, KFRA, BatchGrad, DiagGGNExact, DiagGGNMC, DiagHessian, SqrtGGNMC

from oracles.checks import _assert_same_state, state_snapshot
from oracles.loss_checks import assert_converges, mc_read, rel
from oracles.reference import assert_matches, exact_extensions, kflr_map, product_matrix, reference
from oracles.pchmp import pchmp_blocks
from oracles.kron import shared_factors
from oracles.second_order import ggn_block, ggn_per_sample, kron_input_factor
from oracles.on_device import seeded

@pytest.fixture(autouse=True, scope="module")
def _opaque_fallback():
    """The ATen front end off: torch.fx's trace with opaque leaves is used (the fallback)."""
    with override(aten_front_end=False):
        yield


# --------------------------------------------------------------------------- models


class Checked(nn.Module):
    """(a) Type and shape assertions on its input: fx's proxies fail both."""

    def __init__(self, d=4):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        assert isinstance(x, torch.Tensor), "expects a tensor"
        assert x.shape[-1] == 4
        return torch.tanh(self.lin(x))


class Branchy(nn.Module):
    """(b) A branch on the values of its input (the whole batch's sum), parameters in both branches."""

    def __init__(self, d=3, h=4):
        super().__init__()
        self.a, self.b = nn.Linear(d, h), nn.Linear(d, h)

    def forward(self, x):
        if x.sum() > 0:
            return torch.tanh(self.a(x))
        return torch.sigmoid(self.b(x)) * 2.0


class SafeSwish(nn.Module):
    """(c) A parameter-free activation that type-checks and clamps on values (both untraceable)."""

    def forward(self, x):
        if not isinstance(x, torch.Tensor):
            raise TypeError("SafeSwish expects a tensor")
        if x.abs().max() > 1e6:
            x = x.clamp(-1e6, 1e6)
        return x * torch.sigmoid(x)


class Experts(nn.Module):
    """Stacked expert weights ``[E, h, h]`` (parameters of its own), each row sent to the expert
    its values pick, a LayerNorm inside, and a branch on values that fx's proxies fail: a
    mixture of experts' grouped kernel as an opaque module. ``linear``: a Linear inside too."""

    def __init__(self, h=4, experts=3, linear=False):
        super().__init__()
        self.w = nn.Parameter(torch.randn(experts, h, h) / h ** 0.5)
        self.norm = nn.LayerNorm(h)
        self.gate = nn.Linear(h, h) if linear else None

    def forward(self, x):
        if x.abs().max() > 1e6:
            x = x.clamp(-1e6, 1e6)
        pick = x.detach().abs().argmax(-1) % self.w.shape[0]
        out = torch.tanh(torch.einsum("nij,nj->ni", self.w[pick], self.norm(x)))
        return out if self.gate is None else out * torch.sigmoid(self.gate(x))


class Sandwich(nn.Module):
    """Traced Linear layers around one opaque submodule."""

    def __init__(self, middle: nn.Module, d=3, h=4, c=3, first=True):
        super().__init__()
        self.first = first
        self.inp = nn.Linear(d, h) if first else nn.Identity()
        self.mid = middle
        self.out = nn.Linear(h, c)

    def forward(self, x):
        return self.out(self.mid(self.inp(x)))


class Res(nn.Module):
    """A small ResNet block for BackPACK's converter (its ``+`` becomes a ``SumModule``)."""

    def __init__(self, c=3):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.act = nn.Tanh()
        self.c2 = nn.Conv2d(2, 2, 3, padding=1)
        self.act2 = nn.Sigmoid()
        self.head = nn.Linear(2 * 3 * 3, c)

    def forward(self, x):
        h = self.act(self.conv(x))
        h = h + self.c2(h)
        return self.head(torch.flatten(self.act2(h), 1))


def _backpack_resnet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BackPACK's converter talks about its own extensions
        return convert_module_to_backpack(Res(), False)


# name -> (model factory, input shape per sample, opaque leaf types, opaque paths, parameters inside)
CASES = {
    "assert_isinstance": (lambda: Sandwich(Checked()), (3,), (Checked,), ["mid"], True),
    "value_branch": (lambda: Sandwich(Branchy(), first=False), (3,), (Branchy,), ["mid"], True),
    "free_activation": (lambda: Sandwich(SafeSwish()), (3,), (SafeSwish,), ["mid"], False),
    "backpack_parallel": (
        lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(),
                              Parallel(nn.Identity(), nn.Sequential(nn.Linear(4, 4), nn.Sigmoid())), nn.Linear(4, 3)),
        (3,), (SumModule,), ["2.merge"], False,
    ),
    "backpack_resnet": (_backpack_resnet, (1, 3, 3), (SumModule,), ["sum_module0"], False),
    "own_parameters": (lambda: Sandwich(Experts()), (3,), (Experts,), ["mid"], True),
}


def _problem(case: str, n: int, seed: int, ce: bool, sign: float = 1.0):
    torch.manual_seed(seed)
    factory, shape, _, _, _ = CASES[case]
    model = factory().double()
    X = torch.rand((n,) + shape, dtype=torch.float64) + 0.1
    if case == "value_branch":
        X = sign * X  # every sample on the batch's side of the branch (samples independent)
    else:
        X = X - 0.6
    lossfn = nn.CrossEntropyLoss() if ce else nn.MSELoss()
    y = torch.randint(0, 3, (n,)) if ce else torch.randn(n, 3, dtype=torch.float64)
    return model, lossfn, X, y


def _quiet_curvature(model, lossfn, exts):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return curvature(model, lossfn, exts)


def _freeze_inside(model, case):
    for path in CASES[case][3]:
        model.get_submodule(path).requires_grad_(False)


# --------------------------------------------------------------------------- tracing


@pytest.mark.parametrize("case", list(CASES))
def test_opaque_leaves_found_and_warned(case):
    """The offending submodules (and only they) become leaves; the user is told which, and why."""
    model, lossfn, X, y = _problem(case, 3, 0, False)
    program = trace_program(model)
    assert program.graph is not None
    assert sorted(program.opaque) == sorted(CASES[case][3])
    with pytest.warns(UserWarning, match="torch.fx could not trace") as record:
        f = curvature(model, lossfn, exact_extensions())
    f(X, y)
    text = "\n".join(str(w.message) for w in record if "torch.fx could not trace" in str(w.message))
    assert text.count("torch.fx could not trace") == 1, "warned once per curvature"
    for path in CASES[case][3]:
        module = model.get_submodule(path)
        assert f"'{path}' ({type(module).__name__})" in text
    role = "one layer (generic rule)" if CASES[case][4] else "a parameter-free operation"
    assert role in text
    where = "branching.py:" if case.startswith("backpack") else "test_opaque.py:"
    assert where in text, text  # the line that failed


def test_model_level_failure_still_untraced():
    """A branch in the model's own forward leaves nothing to make opaque: no graph (first order only)."""

    class Top(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)

        def forward(self, x):
            return self.a(x) if x.sum() > 0 else -self.a(x)

    program = trace_program(Top())
    assert program.graph is None and not program.opaque
    assert "cannot be used as inputs to control flow" in program.trace_error


def test_nested_failure_makes_deepest_module_opaque():
    """An untraceable module inside a traceable container: only the inner one is opaque, the
    container's Linear layers stay traced (their own rules)."""
    inner = Sandwich(Checked())
    model = nn.Sequential(nn.Linear(3, 3), inner, nn.Tanh()).double()
    program = trace_program(model)
    assert list(program.opaque) == ["1.mid"]
    kinds = {layer.path: layer.kind for layer in program.layers.values()}
    assert kinds == {"0": "linear", "1.inp": "linear", "1.mid": "generic", "1.out": "linear"}


# --------------------------------------------------------------------------- values


@given(case=st.sampled_from(list(CASES)), n=st.integers(2, 3), seed=st.integers(0, 2**16),
       ce=st.booleans(), sign=st.sampled_from([1.0, -1.0]))
def test_every_exact_extension_matches_brute_force(case, n, seed, ce, sign):
    """First order, GGN and Hessian diagonals (batch and per sample), square root, GGNMP, HMP,
    PCHMP against float64 brute force, with the opaque modules as they are."""
    model, lossfn, X, y = _problem(case, n, seed, ce, sign)
    before = state_snapshot(model)
    qs = _quiet_curvature(model, lossfn, exact_extensions())(X, y)
    _assert_same_state(before, state_snapshot(model))
    ref = reference(model, lossfn, X, y, hessian=True, pchmp=False)
    assert_matches(qs, ref, case)
    pch = pchmp_blocks(model, lossfn, X, y, "clip", leaves=CASES[case][2])
    for name, block in pch.items():
        got = product_matrix(qs["pchmp"][name], ref["grad"][name].shape)
        scale = block.abs().max().item()
        assert (got - block).abs().max().item() <= 1e-10 + 1e-7 * scale, f"{case} pchmp[{name}]"


@given(case=st.sampled_from(list(CASES)), n=st.integers(2, 3), seed=st.integers(0, 2**16), ce=st.booleans())
def test_kflr_exact_for_every_linear_layer(case, n, seed, ce):
    """KFLR's factors of every Linear/Conv, inside the opaque modules too, equal the oracle's,
    next to the other exact extensions (the stacked expert weights of ``own_parameters``, which
    have no Linear factors, frozen: tested below)."""
    model, lossfn, X, y = _problem(case, n, seed, ce)
    if case == "own_parameters":
        _freeze_inside(model, case)
    if case == "value_branch":  # the branch the batch does not take: zero factors (tested below)
        model.mid.b.requires_grad_(False)
    qs = _quiet_curvature(model, lossfn, exact_extensions(kflr=True))(X, y)
    ref = reference(model, lossfn, X, y, hessian=False, kflr=kflr_map(model))
    assert_matches(qs, ref, case)


@pytest.mark.parametrize("case", list(CASES))
def test_kfac_input_factor_exact_for_every_linear_layer(case):
    """KFAC (MC): the input factors of every Linear/Conv, inside the opaque modules too, are
    exact, the output factors symmetric."""
    model, lossfn, X, y = _problem(case, 3, 1, True)
    if case == "own_parameters":
        _freeze_inside(model, case)
    qs = _quiet_curvature(model, lossfn, [KFAC()])(X, y)
    for name, factors in qs["kfac"].items():
        assert torch.allclose(factors[0], factors[0].T)
        if len(factors) == 2:
            module = name.rsplit(".", 1)[0]
            torch.testing.assert_close(factors[1], kron_input_factor(model, X, module))


@pytest.mark.parametrize("case", ["assert_isinstance", "value_branch"])
def test_kfra_refused_inside_opaque_module(case):
    """KFRA pulls a matrix back layer by layer, which it cannot do through an opaque module:
    refused (before, off a chain, or here naming the module, its Linear's parameters and fx's
    reason)."""
    model, lossfn, X, y = _problem(case, 3, 0, False)
    with pytest.raises(CurvatureError) as info:
        _quiet_curvature(model, lossfn, [KFRA()])(X, y)
    msg = str(info.value)
    if "of module 'mid'" in msg:
        assert "torch.fx could not trace" in msg and "mid." in msg and "requires_grad=False" in msg


@given(n=st.integers(1, 3), seed=st.integers(0, 2**16), ce=st.booleans(),
       ext=st.sampled_from([KFLR(), KFAC(mc_samples=2, generator=seeded(0))]))
def test_kron_of_an_opaque_modules_own_parameters_is_its_ggn_diagonal(n, seed, ce, ext):
    """Parameters inside an opaque module that no Linear/Conv/Embedding/RNN owns (its own stacked
    expert weights, a LayerNorm's) get the generic layer's Kronecker form, one factor: the exact
    GGN block of a 1-D parameter, the block's diagonal of any other; the Linear layers around
    it get their two factors. (KFAC: blocks of the Monte-Carlo GGN; values checked for KFLR.)"""
    model, lossfn, X, y = _problem("own_parameters", n, seed, ce)
    qs = _quiet_curvature(model, lossfn, [ext])(X, y)
    assert all(len(qs[ext.name][k]) == 2 for k in ("inp.weight", "out.weight"))
    for name, p in model.mid.named_parameters(prefix="mid"):
        factors = qs[ext.name][name]
        block = p.dim() == 1
        assert len(factors) == 1 and factors[0].shape == ((p.numel(),) * (2 if block else 1)), name
        if isinstance(ext, KFLR):
            exact = ggn_block(model, lossfn, X, y, name)
            torch.testing.assert_close(factors[0], exact if block else exact.diagonal(), rtol=1e-9, atol=1e-12)


class Projections(nn.Module):
    """An opaque module (a clamp on the whole batch's values) holding Linear layers: ``q`` applied
    twice (the positions of both calls share its weight), ``merged`` on rows that merge the batch
    with the positions (``[N·T, H]``), ``spare`` never called, and a parameter of its own."""

    def __init__(self, d=3, h=4):
        super().__init__()
        self.q, self.merged, self.spare = nn.Linear(d, h), nn.Linear(h, d), nn.Linear(d, d)
        self.scale = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        if x.abs().max() > 1e6:
            x = x.clamp(-1e6, 1e6)
        h = torch.tanh(self.q(x)) + torch.sigmoid(self.q(x.flip(1)))
        n, t, _ = h.shape
        return self.merged(h.reshape(n * t, -1)).reshape(n, t, -1) * self.scale


class Sequences(nn.Module):
    """Traced Linear layers around an opaque module on ``[N, T, D]`` sequences."""

    def __init__(self, middle: nn.Module, d=3, t=2, c=3):
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(d, d), middle, nn.Linear(t * d, c)

    def forward(self, x):
        return self.out(self.mid(self.inp(x)).flatten(1))


class ConvInside(nn.Module):
    """An opaque module holding a convolution (its factors need the unfolded patches)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(3, 3, 2)

    def forward(self, x):
        if x.abs().max() > 1e6:
            x = x.clamp(-1e6, 1e6)
        return self.conv(x.transpose(1, 2)).flatten(1)


def _sequences(n, seed, ce):
    torch.manual_seed(seed)
    model = Sequences(Projections()).double()
    X = torch.randn(n, 2, 3, dtype=torch.float64)
    lossfn = nn.CrossEntropyLoss() if ce else nn.MSELoss()
    y = torch.randint(0, 3, (n,)) if ce else torch.randn(n, 3, dtype=torch.float64)
    return model, lossfn, X, y


@given(n=st.integers(1, 3), seed=st.integers(0, 2**16), ce=st.booleans(),
       approx=st.sampled_from([None, "expand", "reduce"]))
def test_kflr_of_linear_layers_inside_an_opaque_module_matches_brute_force(n, seed, ce, approx):
    """A Linear inside a module curvlib runs whole gets its two factors, formed sample by sample
    from the rows it sees: every call and position of one sample, merged rows included, as
    positions sharing the weight; each ``kfac_approx`` against the explicit oracle (Jacobians of
    per-position output offsets). The module's own parameter gets its exact GGN block."""
    model, lossfn, X, y = _sequences(n, seed, ce)
    qs = _quiet_curvature(model, lossfn, [KFLR(kfac_approx=approx)])(X, y)["kflr"]
    for path in ("mid.q", "mid.merged", "inp", "out"):
        B, A = shared_factors(model, lossfn, X, y, model.get_submodule(path), approx)
        for got, want, what in ((qs[f"{path}.weight"], [B, A], "weight"), (qs[f"{path}.bias"], [B], "bias")):
            assert len(got) == len(want), f"{path}.{what}"
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12, msg=f"{path}.{what} ({approx})")
    torch.testing.assert_close(qs["mid.scale"][0], ggn_block(model, lossfn, X, y, "mid.scale"), rtol=1e-9, atol=1e-12)
    for name, p in model.mid.spare.named_parameters(prefix="mid.spare"):  # an unused parameter's zero block
        assert len(qs[name]) == 1 and qs[name][0].numel() == p.numel() ** (2 if p.dim() == 1 else 1)
        assert not qs[name][0].any()


def test_kfac_of_linear_layers_inside_an_opaque_module():
    """KFAC (Monte-Carlo roots): the inner Linear layers' input factors are exact, their output
    factors symmetric and positive semi-definite, converging to KFLR's."""
    model, lossfn, X, y = _sequences(3, 0, True)
    exact = _quiet_curvature(model, lossfn, [KFLR()])(X, y)["kflr"]
    errors = []
    for m in (1, 1000):
        qs = _quiet_curvature(model, lossfn, [KFAC(mc_samples=m, generator=seeded(m))])(X, y)["kfac"]
        B, A = qs["mid.merged.weight"]
        torch.testing.assert_close(A, exact["mid.merged.weight"][1])
        assert torch.allclose(B, B.T) and torch.linalg.eigvalsh(B).min() > -1e-10
        errors.append(rel({"B": B}, {"B": exact["mid.merged.weight"][0]}))
    assert errors[1] < 0.2 * errors[0], errors


@pytest.mark.parametrize("make, refused", [
    (lambda: Sequences(Projections()), "['mid.merged.bias', 'mid.merged.weight', 'mid.q.bias', 'mid.q.weight', 'mid.spare.bias', 'mid.spare.weight']"),
    (lambda: Sequences(ConvInside(), t=1, c=3), "['mid.conv.bias', 'mid.conv.weight']"),
])
def test_kron_refusals_inside_an_opaque_module(make, refused):
    """KFRA (a GGN pulled back as a matrix, layer by layer) is refused for every Linear inside an
    opaque module; KFAC/KFLR for a convolution inside one (its factors need the unfolded patches),
    naming the parameters."""
    torch.manual_seed(0)
    model = make().double()
    X, y = torch.randn(3, 2, 3, dtype=torch.float64), torch.randint(0, 3, (3,))
    ext = KFRA() if isinstance(model.mid, Projections) else KFLR()
    with pytest.raises(CurvatureError) as info:
        _quiet_curvature(model, nn.CrossEntropyLoss(), [ext])(X, y)
    assert refused in str(info.value) and "of module 'mid'" in str(info.value), str(info.value)


@pytest.mark.parametrize("case", [
    "free_activation", "backpack_parallel",
    # generic layers take the MC root column by column (and the branching one sample by sample)
    pytest.param("assert_isinstance", marks=pytest.mark.slow),
    pytest.param("value_branch", marks=pytest.mark.slow),
])
def test_monte_carlo_extensions_converge(case):
    """DiagGGNMC and SqrtGGNMC through opaque modules converge to the exact GGN (error ~ 1/√M)."""
    model, lossfn, X, y = _problem(case, 2, 3, True)
    Gn = {name: ggn_per_sample(model, lossfn, X, y, name) for name, _ in model.named_parameters()}
    exact = {"diag_ggn_mc": {k: G.sum(0).diagonal() for k, G in Gn.items()}, "sqrt_ggn_mc": Gn}
    errs = {key: {} for key in exact}
    for m in (1, 100, 10000):
        exts = [DiagGGNMC(mc_samples=m, generator=seeded(m)),
                SqrtGGNMC(mc_samples=m, generator=seeded(m + 1))]
        qs = _quiet_curvature(model, lossfn, exts)(X, y)
        qs["diag_ggn_mc"] = {k: v.flatten() for k, v in qs["diag_ggn_mc"].items()}
        for key in exact:
            errs[key][m] = rel(mc_read(key, qs[key], model, X), exact[key])
    assert_converges(errs)


def test_value_branch_takes_each_branch():
    """Both branches of the opaque module are exercised (results differ between them), so the
    value tests above cover the piecewise function on either side."""
    model, lossfn, X, y = _problem("value_branch", 3, 5, False)
    qs_pos = _quiet_curvature(model, lossfn, exact_extensions(hessian=False))(X, y)
    qs_neg = _quiet_curvature(model, lossfn, exact_extensions(hessian=False))(-X, y)
    assert qs_pos["grad"]["mid.a.weight"].abs().sum() > 0 and qs_pos["grad"]["mid.b.weight"].abs().sum() == 0
    assert qs_neg["grad"]["mid.b.weight"].abs().sum() > 0 and qs_neg["grad"]["mid.a.weight"].abs().sum() == 0


@pytest.mark.parametrize("ext", [BatchGrad(), DiagGGNExact(), DiagHessian()])
def test_branch_chosen_by_the_whole_batch_refused(ext):
    """Samples on both sides of a batch-level branch: a sample alone takes another branch than
    in the batch, so per-sample quantities are not defined: refused, naming the module (sample 0
    agrees with the batch, so only the per-sample runs can see it)."""
    model, lossfn, X, y = _problem("value_branch", 3, 0, False)
    X = X.clone()
    X[2] = -X[2] * 0.1  # the batch's sum stays positive; sample 2's is negative
    assert X.sum() > 0 and X[0].sum() > 0 and X[2].sum() < 0
    with pytest.raises(CurvatureError, match="'mid' \\(Branchy.*branches on tensor values"):
        _quiet_curvature(model, lossfn, [ext])(X, y)


class SpareOnly(nn.Module):
    """An opaque module whose only Linear is never called."""

    def __init__(self, d=3):
        super().__init__()
        self.spare = nn.Linear(d, d)
        self.scale = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        if x.abs().max() > 1e6:
            x = x.clamp(-1e6, 1e6)
        return torch.tanh(x * self.scale)


def test_kflr_of_a_linear_an_opaque_module_never_calls():
    """No call of any inner Linear in any sample: its parameters get the zero block of an unused
    parameter, the rest their factors."""
    torch.manual_seed(0)
    model = Sequences(SpareOnly()).double()
    X, y = torch.randn(3, 2, 3, dtype=torch.float64), torch.randint(0, 3, (3,))
    qs = _quiet_curvature(model, nn.CrossEntropyLoss(), [KFLR()])(X, y)["kflr"]
    for name, p in model.mid.spare.named_parameters(prefix="mid.spare"):
        assert len(qs[name]) == 1 and not qs[name][0].any()
    assert len(qs["inp.weight"]) == 2 and qs["inp.weight"][0].abs().sum() > 0
