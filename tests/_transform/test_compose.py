"""Composes exactly: every extension x every model x every torch.func transform.

Each cell (:mod:`compose_cells`) transforms curvlib's ``f(X, y, params=p)`` and the
oracle in the same way and compares them in float64, the tolerance scaled by the
largest entry of the expected result: the pure brute force of
:mod:`oracles.compose` where one exists, else curvlib's own plain values
(per-member calls for ``vmap``, central differences for derivatives).

The extension list is read from ``curvlib.extensions`` itself: a new extension
is a new row of every test, and fails :func:`test_every_extension_is_classified`
until :data:`KIND` says how it composes. :data:`~oracles.compose_cells.REFUSED` lists the cells that
must raise a ``CurvatureError`` (under every transform); :data:`XFAIL` the cells
that fail today (strict: a fix makes them XPASS, which fails; delete the entry).
``PYTHONPATH=src:tests python -m oracles.compose_table`` prints the failing cells as a table.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, example, given, settings, strategies as st
from torch.func import vmap

from curvlib import CurvatureError

from oracles.compose_cells import (
    HESSIAN_PARAM, MC, NO_EXTENSION, REFUSED, TRANSFORMS, Cell, _members, _stack, assert_close, expected_refusal,
    rows, run_cell,
)
from oracles.compose import brute, canonical
from oracles.compose_models import INTEGER_INPUT, MODELS, build
from oracles.on_device import seeded

# How each exported extension composes: "exact" (every transform, against the brute
# force where :mod:`oracles.compose` has one) or "mc" (Monte-Carlo: vmap equal to
# per-member calls with the same generator; derivatives with the draws held fixed).
KIND = {
    "BatchGrad": "exact", "BatchL2Grad": "exact", "SumGradSquared": "exact", "Variance": "exact",
    "DiagGGNExact": "exact", "BatchDiagGGNExact": "exact", "SqrtGGNExact": "exact", "GGNMP": "exact",
    "DiagHessian": "exact", "BatchDiagHessian": "exact", "HMP": "exact", "PCHMP": "exact",
    "KFLR": "exact", "KFACEmpirical": "exact", "KFRA": "exact",
    "DiagGGNMC": "mc", "BatchDiagGGNMC": "mc", "KFAC": "mc", "SqrtGGNMC": "mc",
    NO_EXTENSION: "exact",  # the gradient every call returns
}

# (model, extension, transform) -> what is wrong today (compose_table.py, seed 0, N = 2).
# Empty: every cell is exact or refused.
XFAIL: dict = {}

# The default run: every transform on these models; the others are marked slow.
FAST_MODELS = ("mlp", "mlp_ln")
SETTINGS = settings(max_examples=1, derandomize=True, phases=(Phase.explicit, Phase.generate), deadline=None)


def _cells(transform: str):
    for model in MODELS:
        for cls_name in rows():
            if transform == "grad_X" and model in INTEGER_INPUT:
                continue
            marks = [] if model in FAST_MODELS else [pytest.mark.slow]
            reason = XFAIL.get((model, cls_name, transform))
            if reason:
                marks.append(pytest.mark.xfail(strict=True, reason=reason))
            yield pytest.param(model, cls_name, marks=marks, id=f"{model}-{cls_name}")


def test_every_extension_is_classified():
    """Every extension ``curvlib.extensions`` exports is in :data:`KIND` (so in the matrix)."""
    unknown = sorted(set(rows()) - set(KIND))
    assert not unknown, f"extensions without a composition entry in test_compose.KIND: {unknown}"
    assert sorted(c for c in KIND if KIND[c] == "mc") == sorted(MC)


def test_tables_name_real_cells():
    for model, cls_name in REFUSED:
        assert model in MODELS and cls_name in KIND
    for model, cls_name, transform in XFAIL:
        assert model in MODELS and cls_name in KIND and transform in TRANSFORMS


def check_cell(model: str, cls_name: str, transform: str, seed: int, n: int) -> None:
    """The transform of curvlib's result equals the same transform of the oracle, or the
    cell is refused as :func:`expected_refusal` says."""
    KIND[cls_name]  # an unknown extension fails here too
    refused = expected_refusal(model, cls_name, transform)
    if refused:
        with pytest.raises(refused[0], match=refused[1]):
            run_cell(model, cls_name, transform, seed, n)
        return
    run_cell(model, cls_name, transform, seed, n)


def _transform_test(transform: str):
    """One test per transform over every (model, extension) cell. (One test per transform also
    keeps hypothesis below ~900 parametrized items per function: more overflow its settings
    chain with derandomize=True, hypothesis 6.155.)"""

    @pytest.mark.parametrize("model,cls_name", list(_cells(transform)))
    @SETTINGS
    @given(seed=st.integers(0, 2**16), n=st.integers(2, 3))
    @example(seed=0, n=2)  # the configuration of compose_table.py (and of XFAIL's entries)
    def test(model, cls_name, seed, n):
        check_cell(model, cls_name, transform, seed, n)

    test.__name__ = test.__qualname__ = f"test_{transform}"
    test.__doc__ = f"``{transform}``: " + check_cell.__doc__
    return test


test_vmap_params = _transform_test("vmap_params")
test_vmap_task = _transform_test("vmap_task")
test_vmap_both = _transform_test("vmap_both")
test_grad = _transform_test("grad")
test_jvp = _transform_test("jvp")
test_jacrev = _transform_test("jacrev")
test_hessian = _transform_test("hessian")
test_autograd = _transform_test("autograd")
test_grad_X = _transform_test("grad_X")


def test_every_transform_has_a_test():
    assert all(f"test_{t}" in globals() for t in TRANSFORMS)


@pytest.mark.parametrize("model", ["mlp", pytest.param("mlp_ln", marks=pytest.mark.slow)])
@pytest.mark.parametrize("cls_name", MC)
def test_mc_vmap_randomness(model, cls_name):
    """``randomness="error"`` refuses with torch's message; ``"different"`` gives members with
    the same parameters different draws, reproducibly from the same generator seed."""
    c = Cell(model, cls_name, 0, 2)
    stacked = _stack([c.params] * 8)  # 8 identical members: all draws equal by chance ~never

    def members(randomness):
        return vmap(lambda p: c.curv(p, c.X, c.y), randomness=randomness)(stacked)

    with pytest.raises(RuntimeError, match="randomness"):
        members("error")
    a, b = members("different"), members("different")
    for k in a:
        assert torch.equal(a[k], b[k]), f"{cls_name}[{k}]: not reproducible from the same generator"
    assert any(not torch.equal(v[0], v[i]) for v in a.values() for i in range(1, 8)), \
        f"{cls_name}: every member drew the same under randomness='different'"


def test_vmap_over_members_without_their_buffers_is_refused():
    """BatchNorm (eval) ensemble: vmapped parameters without the members' buffers must not
    silently use the base model's running statistics."""
    c = Cell("bn_cnn", "BatchGrad", 0, 2)
    ps, _ = _members(c, 3)
    with pytest.raises(CurvatureError, match="buffer"):
        vmap(lambda p: c.curv(p, c.X, c.y))(_stack(ps))


ORACLE_NAMES = ("grad_batch", "diag_ggn_exact", "sqrt_ggn_exact", "ggnmp", "diag_h", "hmp", "pchmp", "kflr",
                "kfac_empirical")


def _slow_unless(fast):
    return [m if m in fast else pytest.param(m, marks=pytest.mark.slow) for m in MODELS]


@pytest.mark.parametrize("model", _slow_unless(("mlp", "mlp_ln", "cnn", "embedding", "resnet", "bn_cnn")))
def test_oracle_derivatives_match_finite_differences(model):
    """The brute force itself: its ``torch.func.grad`` agrees with central differences of its
    values (it must not inherit torch's higher-order derivative bugs, e.g. ``F.layer_norm``'s)."""
    problem = build(model, 0)
    gen = seeded(5)
    X, y = problem.data(gen, 2)
    params = {k: v.detach() for k, v in problem.model.named_parameters()}
    vec = {k: torch.randn((1,) + v.shape, generator=gen, dtype=v.dtype) for k, v in params.items()}
    names = [n for n in ORACLE_NAMES if n != "pchmp" or problem.tanh_only]
    for name in names:
        def s(p, name=name):
            out = canonical(name, brute(name, problem.model, problem.lossfn, p, X, y), vec, True)
            return sum((torch.cos(torch.arange(t.numel(), dtype=t.dtype)) * t.flatten()).sum() for t in out.values())

        g = torch.func.grad(s)(params)
        d = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in params.items()}
        got = sum((g[k] * d[k]).sum() for k in g)
        eps = 1e-5
        want = (s({k: v + eps * d[k] for k, v in params.items()}) - s({k: v - eps * d[k] for k, v in params.items()})) / (2 * eps)
        assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), f"{model} {name}: grad·d {got:.8g} vs FD {want:.8g}"


def test_a_wrong_transform_fails():
    """The comparison can fail: a result scaled by 1 + 1e-6 under vmap is caught."""
    c = Cell("mlp", "DiagGGNExact", 0, 2)
    got = vmap(lambda p: c.curv(p, c.X, c.y))(_stack([c.params, c.params]))
    want = _stack([c.oracle(c.params, c.X, c.y)] * 2)
    with pytest.raises(AssertionError, match="max error"):
        assert_close({k: v * (1 + 1e-6) for k, v in got.items()}, want, "scaled", 1e-7)


@pytest.mark.parametrize("model", _slow_unless(("mlp_ln",)))
def test_oracle_hessians_match_finite_differences(model):
    """The brute force under ``torch.func.hessian`` (w.r.t. :data:`HESSIAN_PARAM`): ``uᵀHu``
    agrees with Richardson-extrapolated second differences of its values."""
    problem = build(model, 0)
    gen = seeded(6)
    X, y = problem.data(gen, 2)
    params = {k: v.detach() for k, v in problem.model.named_parameters()}
    k = HESSIAN_PARAM[model]
    u = torch.randn(params[k].shape, generator=gen, dtype=params[k].dtype)
    for name in ("grad_batch", "batch_l2", "diag_ggn_exact", "diag_h"):
        def s(t, name=name):
            out = brute(name, problem.model, problem.lossfn, {**params, k: t}, X, y)
            return sum((torch.cos(torch.arange(v.numel(), dtype=v.dtype)) * v.flatten()).sum() for v in out.values())

        p = params[k]
        H = torch.func.hessian(s)(p).reshape(p.numel(), p.numel())
        got = (u.flatten() @ H @ u.flatten()).item()
        second = [(s(p + h * u) - 2 * s(p) + s(p - h * u)) / h**2 for h in (1e-3, 5e-4)]
        want = ((4 * second[1] - second[0]) / 3).item()
        assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), f"{model} {name}: uᵀHu {got:.8g} vs FD {want:.8g}"
