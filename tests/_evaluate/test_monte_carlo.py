"""Monte-Carlo quantities (``DiagGGNMC``, ``BatchDiagGGNMC``, ``SqrtGGNMC``, ``KFAC``) converge to
the exact ones as ``mc_samples`` grows (seeded generators, error ~ 1/√M), are reproducible with
a generator, and refuse bad ``mc_samples`` / ``generator`` arguments.
"""

from __future__ import annotations

from typing import Dict

import pytest
import torch
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib.extensions import (
    KFAC, BatchDiagGGNMC, DiagGGNExact, DiagGGNMC, SqrtGGNMC,
)

from oracles.cases import LOSSES, target_for
from oracles.checks import check_close
from oracles.on_device import seeded
from oracles.second_order import detached_params, ggn_per_sample, kron_input_factor, kron_output_factor, trainable_names



MC_SIZES = (1, 100, 10000)


def _tiny(loss):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    X = torch.randn(4, 3, generator=seeded(1), dtype=torch.float64)
    y = target_for(model, X, loss, 1)
    return model, LOSSES[loss](), X, y


def _rel(est: Dict[str, torch.Tensor], exact: Dict[str, torch.Tensor]) -> float:
    num = sum(((est[k] - exact[k]) ** 2).sum() for k in exact)
    den = sum((exact[k] ** 2).sum() for k in exact)
    return float((num / den) ** 0.5)


def _errors(ext_cls, loss, read, exact, seed=0):
    model, lossfn, X, y = _tiny(loss)
    errs = {}
    for m in MC_SIZES:
        ext = ext_cls(mc_samples=m, generator=seeded(seed))
        qs = curvature(model, lossfn, [ext])(X, y)
        errs[m] = _rel(read(qs[ext.name]), exact)
    return errs


def _assert_converges(errs):
    assert errs[10000] < 0.1, errs
    assert errs[10000] < errs[100] / 3, errs
    assert errs[100] < errs[1], errs


def _exact_ggn(loss):
    model, lossfn, X, y = _tiny(loss)
    return {name: ggn_per_sample(model, lossfn, X, y, name) for name in trainable_names(model)}


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_diag_ggn_mc_converges(loss):
    Gn = _exact_ggn(loss)
    params = detached_params(_tiny(loss)[0])
    exact = {k: v.sum(0).diagonal().reshape(params[k].shape) for k, v in Gn.items()}
    _assert_converges(_errors(DiagGGNMC, loss, lambda r: r, exact))


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_batch_diag_ggn_mc_converges(loss):
    Gn = _exact_ggn(loss)
    params = detached_params(_tiny(loss)[0])
    exact = {k: v.diagonal(dim1=1, dim2=2).reshape((4,) + tuple(params[k].shape)) for k, v in Gn.items()}
    _assert_converges(_errors(BatchDiagGGNMC, loss, lambda r: r, exact))


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_sqrt_ggn_mc_outer_products_converge(loss):
    """``Σ_m s_{m,n} s_{m,n}ᵀ`` -> the per-sample GGN block ``G_n``; shape ``[M, N, *p]``."""
    Gn = _exact_ggn(loss)
    params = detached_params(_tiny(loss)[0])

    def read(r):
        out = {}
        for k, s in r.items():
            assert s.shape[1:] == (4,) + tuple(params[k].shape)
            sf = s.reshape(s.shape[0], 4, -1)
            out[k] = torch.einsum("mnp,mnq->npq", sf, sf)
        return out

    _assert_converges(_errors(SqrtGGNMC, loss, read, Gn))


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_kfac_converges_to_kflr(loss):
    """KFAC's output factor ``B`` -> KFLR's; the input factor ``A`` is exact for any M."""
    model, lossfn, X, y = _tiny(loss)
    exact = {}
    A = {}
    for name in trainable_names(model):
        mname, role = name.split(".")
        exact[name] = kron_output_factor(model, lossfn, X, y, mname)
        if role == "weight":
            A[name] = kron_input_factor(model, X, mname)

    def read(r):
        for k, a in A.items():
            assert len(r[k]) == 2
            check_close(r[k][1], a, f"kfac[{k}][1]")
        return {k: f[0] for k, f in r.items()}

    _assert_converges(_errors(KFAC, loss, read, exact))


@pytest.mark.parametrize("ext_cls", [DiagGGNMC, BatchDiagGGNMC, SqrtGGNMC, KFAC])
def test_mc_reproducible_with_generator(ext_cls):
    model, lossfn, X, y = _tiny("ce")

    def run(seed):
        ext = ext_cls(mc_samples=3, generator=seeded(seed))
        return curvature(model, lossfn, [ext])(X, y)[ext.name]

    a, b, c = run(5), run(5), run(6)
    flat = lambda r: torch.cat([torch.cat([f.flatten() for f in v]) if isinstance(v, list) else v.flatten() for v in r.values()])  # noqa: E731
    assert torch.equal(flat(a), flat(b))
    assert not torch.equal(flat(a), flat(c))
    if ext_cls is SqrtGGNMC:
        assert all(v.shape[0] == 3 for v in a.values())


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_mc_sample_mean_matches_exact_diag(loss):
    """Averaging many independent 1-sample DiagGGNMC estimates (fresh seeds) gives ``diag G``."""
    model, lossfn, X, y = _tiny(loss)
    exact = curvature(model, lossfn, [DiagGGNExact()])(X, y)["diag_ggn_exact"]
    k = 300
    acc = {n: 0 for n in exact}
    for seed in range(k):
        r = curvature(model, lossfn, [DiagGGNMC(mc_samples=10, generator=seeded(seed))])(X, y)
        for n_ in exact:
            acc[n_] = acc[n_] + r["diag_ggn_mc"][n_] / k
    assert _rel(acc, exact) < 0.1


@pytest.mark.parametrize("ext_cls", [DiagGGNMC, BatchDiagGGNMC, SqrtGGNMC, KFAC])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3", None])
def test_bad_mc_samples(ext_cls, bad):
    with pytest.raises(CurvatureError, match="mc_samples"):
        ext_cls(mc_samples=bad)


@pytest.mark.parametrize("ext_cls", [DiagGGNMC, BatchDiagGGNMC, SqrtGGNMC, KFAC])
def test_bad_generator(ext_cls):
    with pytest.raises(TypeError, match="generator"):
        ext_cls(generator=0)
