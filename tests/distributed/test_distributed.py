"""Data-parallel aggregation (curvlib.distributed) on 2 and 3 gloo processes.

Every rank computes the aggregated quantities on its slice of one global
batch (uneven local batch sizes) and compares them, inside the worker, with
the single-process result on the full batch; a mismatch raises in the worker
and fails the test. Processes run on 127.0.0.1 with a free port, with a time
limit, and are always torn down. The ranks run on CPU whatever
``CURVLIB_TEST_DEVICE`` says (fresh processes without conftest; gloo).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

import curvlib.distributed._allreduce as cdist
from curvlib import CurvatureError, CurvatureTypeError, curvature
from curvlib.extensions import (
    GGNMP,
    HMP,
    KFAC,
    KFACEmpirical,
    KFLR,
    KFRA,
    PCHMP,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    BatchDiagHessian,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SqrtGGNExact,
    SqrtGGNMC,
    SumGradSquared,
    Variance,
)
from oracles.on_device import CPU_ONLY, ON_CPU
from oracles.processes import spawn

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this torch build",
)

TIMEOUT_S = 90


def _cases(rank: int, world: int, case: str, sizes: tuple) -> None:
    for name in case.split("+"):
        CASES[name](rank, world, sizes)


def _spawn(case: str, sizes: tuple) -> None:
    """Run ``CASES[case]`` on ``len(sizes)`` gloo processes (``oracles.processes.spawn``)."""
    spawn(_cases, (case, sizes), world=len(sizes), timeout_s=TIMEOUT_S)


# ----------------------------------------------------------------------------- problems


def _problem(arch: str, loss: str, reduction: str, n: int):
    """Same model and global batch on every rank (fixed seed), float64."""
    torch.manual_seed(1234)
    if arch == "mlp":
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
        X = torch.randn(n, 4)
    else:
        model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Sigmoid(), nn.Flatten(), nn.Linear(12, 3))
        X = torch.randn(n, 2, 6)
    model = model.double()
    X = X.double()
    if loss == "ce":
        lossfn, y = nn.CrossEntropyLoss(reduction=reduction), torch.randint(0, 3, (n,))
    else:
        lossfn, y = nn.MSELoss(reduction=reduction), torch.randn(n, 3, dtype=torch.float64)
    return model, lossfn, X, y


def _slice(rank: int, sizes: tuple) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


EXACT = [
    BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance(),
    DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact(),
    DiagHessian(), BatchDiagHessian(), KFLR(),
]
# Per-sample along dim 0, except the square roots ([C or M, N, *p]).
PER_SAMPLE = {"grad_batch": 0, "batch_l2": 0, "diag_ggn_exact_batch": 0, "diag_h_batch": 0,
              "sqrt_ggn_exact": 1}


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=lambda m: f"{what}: {m}")


def _compare(got, ref, sl, where):
    assert set(got) == set(ref), (where, set(got), set(ref))
    _close(got["loss"], ref["loss"], f"{where} loss")
    for key, per_param in ref.items():
        if key == "loss":
            continue
        assert set(got[key]) == set(per_param), (where, key)
        for name, r in per_param.items():
            g = got[key][name]
            what = f"{where} {key}[{name}]"
            if key in PER_SAMPLE:
                r = r[sl] if PER_SAMPLE[key] == 0 else r[:, sl]
                _close(g, r, what)
            elif isinstance(r, list):
                assert len(g) == len(r), what
                for i, (gi, ri) in enumerate(zip(g, r)):
                    _close(gi, ri, f"{what}[{i}]")
            else:
                _close(g, r, what)


# ----------------------------------------------------------------------------- cases


def _case_exact(rank, world, sizes):
    """Every exact extension, both reductions, CE and MSE, Linear and Conv, vs the full batch."""
    n, sl = sum(sizes), _slice(rank, sizes)
    calls = []
    original = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = counting
    fused = cdist._FUSED_DTYPES
    try:
        for arch in ("mlp", "conv"):
            for loss in ("ce", "mse"):
                for reduction in ("mean", "sum"):
                    model, lossfn, X, y = _problem(arch, loss, reduction, n)
                    where = f"rank {rank}/{world} {arch} {loss} {reduction}"
                    ref = curvature(model, lossfn, EXACT)(X, y)
                    g = curvature(model, lossfn, EXACT, process_group=dist.group.WORLD)
                    del calls[:]
                    got = g(X[sl], y[sl])
                    assert len(calls) == 1, f"{where}: {len(calls)} all_reduce calls, expected 1"
                    _compare(got, ref, sl, where)
                    # The loss reduction semantics: the global mean (or sum).
                    _close(got["loss"], lossfn(model(X), y).detach(), f"{where} loss vs lossfn")
                    # KFRA: its matrices are made global layer by layer inside the recursion.
                    kfra = [KFRA()]
                    got_kfra = curvature(model, lossfn, kfra, process_group=dist.group.WORLD)(X[sl], y[sl])
                    ref_kfra = curvature(model, lossfn, kfra)(X, y)
                    for name, factors in ref_kfra["kfra"].items():
                        assert len(got_kfra["kfra"][name]) == len(factors), f"{where} kfra[{name}]"
                        for i, (a, b) in enumerate(zip(got_kfra["kfra"][name], factors)):
                            _close(a, b, f"{where} kfra[{name}][{i}]")
                    if arch == "mlp" and reduction == "mean":
                        # Variance alone (no SumGradSquared to reuse) is recomputed as well.
                        v = [Variance()]
                        only = curvature(model, lossfn, v, process_group=dist.group.WORLD)
                        _compare(only(X[sl], y[sl]), curvature(model, lossfn, v)(X, y), sl, where)
                        # params= passes through.
                        params = {k: v.detach() * 1.1 for k, v in model.named_parameters()}
                        _compare(
                            g(X[sl], y[sl], params=params),
                            curvature(model, lossfn, EXACT)(X, y, params=params), sl,
                            where + " params",
                        )
        # Without the fused buffer (16-bit results take that path): sizes first, 2 calls.
        cdist._FUSED_DTYPES = ()
        model, lossfn, X, y = _problem("mlp", "ce", "mean", n)
        del calls[:]
        got = curvature(model, lossfn, EXACT, process_group=dist.group.WORLD)(X[sl], y[sl])
        assert len(calls) == 2, f"unfused path: {len(calls)} all_reduce calls, expected 2"
        _compare(got, curvature(model, lossfn, EXACT)(X, y), sl, f"rank {rank} unfused")
    finally:
        dist.all_reduce = original
        cdist._FUSED_DTYPES = fused


def _gather(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _case_mc(rank, world, sizes):
    """Monte-Carlo extensions: KFAC's A exactly, the rest statistically; per-rank streams."""
    n, sl = sum(sizes), _slice(rank, sizes)
    mc = 2000
    for loss in ("ce", "mse"):
        model, lossfn, X, y = _problem("mlp", loss, "mean", n)
        where = f"rank {rank}/{world} {loss}"
        ref = curvature(model, lossfn, [DiagGGNExact(), KFLR()])(X, y)
        gen = torch.Generator(device="cpu").manual_seed(7)  # the same on every rank; ranks run on CPU (gloo)
        exts = [DiagGGNMC(mc_samples=mc, generator=gen), BatchDiagGGNMC(mc_samples=mc),
                SqrtGGNMC(mc_samples=mc), KFAC(mc_samples=mc, generator=gen)]
        got = curvature(model, lossfn, exts, process_group=dist.group.WORLD)(X[sl], y[sl])
        for name, exact in ref["diag_ggn_exact"].items():
            assert _rel(got["diag_ggn_mc"][name], exact) < 0.15, (where, name)
            batch = got["diag_ggn_mc_batch"][name]
            assert batch.shape == (sizes[rank],) + exact.shape, (where, name)
            summed = batch.sum(0)
            dist.all_reduce(summed)
            assert _rel(summed, exact) < 0.15, (where, name)
            sq = got["sqrt_ggn_mc"][name]
            assert sq.shape == (mc, sizes[rank]) + exact.shape, (where, name)
            sq = (sq**2).sum((0, 1))
            dist.all_reduce(sq)
            assert _rel(sq, exact) < 0.15, (where, name)
            kfac, kflr = got["kfac"][name], ref["kflr"][name]
            assert len(kfac) == len(kflr), (where, name)
            assert _rel(kfac[0], kflr[0]) < 0.15, (where, name)
            if len(kflr) == 2:
                _close(kfac[1], kflr[1], f"{where} kfac[{name}] A")

    # Identical data and identically seeded generators on every rank: the draws
    # still differ between ranks, are reproducible, and the generators stay in step.
    model, lossfn, X, y = _problem("mlp", "ce", "mean", 4)
    for gen in (torch.Generator(device="cpu").manual_seed(3), None):  # ranks run on CPU (gloo)
        ext = SqrtGGNMC(mc_samples=2, generator=gen)
        f = curvature(model, lossfn, [ext], process_group=dist.group.WORLD)
        torch.manual_seed(11)
        state = (gen.get_state() if gen is not None else torch.get_rng_state()).clone()
        first = f(X, y)["sqrt_ggn_mc"]["2.weight"]
        after = torch.rand(1, generator=gen)  # the stream after one call, same on every rank
        draws = _gather(first)
        for other in range(world):
            if other != rank:
                assert not torch.allclose(draws[other], first), f"rank {rank} and {other} drew alike"
        assert all(torch.equal(a, after) for a in _gather(after)), "streams out of step across ranks"
        (gen.set_state(state) if gen is not None else torch.set_rng_state(state))
        again = f(X, y)["sqrt_ggn_mc"]["2.weight"]
        _close(again, first, f"rank {rank}: MC results are not reproducible")


def _case_options(rank, world, sizes):
    """Loss options (CE weight/ignore_index/label_smoothing, class probabilities, BCE weight and
    pos_weight) with every exact extension, KFACEmpirical and KFRA; rank 0's targets are all
    ignored: it contributes nothing (not NaN) to the global "mean"."""
    n, sl = sum(sizes), _slice(rank, sizes)
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    X = torch.randn(n, 4, dtype=torch.float64)
    w = torch.tensor([1.5, 0.4, 0.9], dtype=torch.float64)
    y = torch.randint(0, 3, (n,))
    y[y == 1] = 2
    y[: sizes[0]] = 1
    probs = torch.softmax(torch.randn(n, 3, dtype=torch.float64), 1)
    problems = {"ce index": (nn.CrossEntropyLoss(weight=w, ignore_index=1, label_smoothing=0.2), y),
                "ce prob": (nn.CrossEntropyLoss(weight=w, label_smoothing=0.2), probs),
                "bce": (nn.BCEWithLogitsLoss(weight=w, pos_weight=w.flip(0)), probs)}
    exts = EXACT + [KFACEmpirical(), KFRA()]
    for reduction in ("mean", "sum"):
        for label, (lossfn, target) in problems.items():
            lossfn.reduction = reduction
            where = f"rank {rank}/{world} {label} {reduction}"
            ref = curvature(model, lossfn, exts)(X, target)
            got = curvature(model, lossfn, exts, process_group=dist.group.WORLD)(X[sl], target[sl])
            _compare(got, ref, sl, where)
            _close(got["loss"], lossfn(model(X), target).detach(), f"{where} loss vs lossfn")
    # nothing counted on any rank: NaN loss (as PyTorch's), zero gradient and curvature
    lossfn = nn.CrossEntropyLoss(ignore_index=1)
    y_none = torch.ones(n, dtype=torch.long)
    got = curvature(model, lossfn, [DiagGGNExact(), KFLR()], process_group=dist.group.WORLD)(X[sl], y_none[sl])
    assert got["loss"].isnan(), f"rank {rank}: loss {got['loss']}"
    for key in ("grad", "diag_ggn_exact"):
        for name, t in got[key].items():
            assert (t == 0).all(), f"rank {rank}: {key}[{name}] not zero"


def _case_kron_layouts(rank, world, sizes):
    """The Kronecker layouts beyond [B, A] (curvlib._core.kronlayout): Embedding's [A (1-D), B],
    a grouped convolution's per-group [B, A], the normalisations' exact blocks [F], and with
    max_factor_dim diagonal sides; the root factor summed with r (r² for KFACEmpirical), the
    input factors averaged."""
    n, sl = sum(sizes), _slice(rank, sizes)
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Embedding(6, 4, padding_idx=0), nn.LayerNorm(4), nn.Flatten(),
                          nn.Unflatten(1, (4, 3)), nn.Conv1d(4, 4, 2, groups=2), nn.GroupNorm(2, 4),
                          nn.Flatten(), nn.Linear(8, 3)).double()
    X = torch.randint(0, 6, (n, 3))
    y = torch.randint(0, 3, (n,))
    for exts in ([KFLR(), KFACEmpirical(kfac_approx="expand")],
                 # diagonal sides (the Linear's B [3] looks like Embedding's A by its shape)
                 [KFLR(max_factor_dim=2), KFACEmpirical(max_factor_dim=2)]):
        for reduction in ("mean", "sum"):
            lossfn = nn.CrossEntropyLoss(reduction=reduction)
            ref = curvature(model, lossfn, exts)(X, y)
            got = curvature(model, lossfn, exts, process_group=dist.group.WORLD)(X[sl], y[sl])
            _compare(got, ref, sl, f"rank {rank}/{world} kron layouts {reduction} {exts[0]}")


CASES = {"exact": _case_exact, "mc": _case_mc, "options": _case_options, "kron_layouts": _case_kron_layouts}


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("sizes", [(3, 5), (2, 3, 4)], ids=["2procs", "3procs"])
def test_every_extension_equals_single_process_on_full_batch(sizes):
    """Exact extensions to float64 precision (one all_reduce per call), Monte-Carlo
    ones statistically and with independent, reproducible per-rank streams.
    One spawn per world size runs both cases (process start-up dominates)."""
    _spawn("exact+mc+options+kron_layouts", sizes)


@pytest.mark.parametrize("ext", [GGNMP(), HMP(), PCHMP()], ids=lambda e: type(e).__name__)
def test_refused_at_construction(ext):
    model, lossfn, _, _ = _problem("mlp", "ce", "mean", 2)
    with pytest.raises(CurvatureError, match=f"{type(ext).__name__} cannot be aggregated"):
        curvature(model, lossfn, [DiagGGNExact(), ext], process_group=object())


def test_needs_initialised_group():
    if dist.is_initialized():  # pragma: no cover
        pytest.skip("a process group is already initialised in this process")
    model, lossfn, _, _ = _problem("mlp", "ce", "mean", 2)
    with pytest.raises(CurvatureError, match="init_process_group"):
        curvature(model, lossfn, [BatchGrad()], process_group=object())


@pytest.mark.skipif(not ON_CPU, reason=CPU_ONLY + " (gloo in this process)")
def test_single_process_group_and_bad_group_type(tmp_path):
    """World size 1 in this process: the identity; a non-group is refused."""
    if dist.is_initialized():  # pragma: no cover
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
        timeout=timedelta(seconds=30),
    )
    try:
        model, lossfn, X, y = _problem("conv", "mse", "mean", 5)
        with pytest.raises(CurvatureTypeError, match="process_group must be"):
            curvature(model, lossfn, EXACT, process_group="WORLD")
        got = curvature(model, lossfn, EXACT, process_group=dist.group.WORLD)(X, y)
        _compare(got, curvature(model, lossfn, EXACT)(X, y), slice(None), "world 1")
    finally:
        dist.destroy_process_group()
