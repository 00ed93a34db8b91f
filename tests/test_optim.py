"""``curvlib.optim.KFACOptimizer``: one step against a dense natural-gradient step built from
brute-force factors (``jacrev``), running averages and intervals, state dicts, training."""

import copy
import math

import pytest
import torch
from torch import nn

from curvlib import CurvatureError, CurvatureTypeError, curvature
from curvlib.extensions import KFLR
from curvlib.optim import KFACOptimizer
from oracles.on_device import seeded
from oracles.second_order import kron_reference

DT = torch.float64


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)


def _data(n=16, seed=1):
    g = seeded(seed)
    return torch.randn(n, 3, dtype=DT, generator=g), torch.randint(0, 2, (n,), generator=g)


@pytest.mark.parametrize("method", ["exact", "plain"])
def test_one_step_is_the_dense_damped_natural_gradient_step(method):
    """``θ − lr (F + λ)⁻¹ ∇L`` with ``F = B ⊗ A`` from ``oracles.second_order.kron_reference``
    (Jacobians by ``jacrev``) and ``∇L`` by autograd, inverted with ``torch.linalg.solve``."""
    model, (X, y) = _model(), _data()
    lossfn = nn.CrossEntropyLoss()
    lr, lam = 0.7, 0.05
    before = copy.deepcopy(model)
    grads = dict(zip([n for n, _ in before.named_parameters()],
                     torch.autograd.grad(lossfn(before(X), y), list(before.parameters()))))
    opt = KFACOptimizer(model, lossfn, lr=lr, damping=lam, curvature="kflr", method=method, kl_clip=None)
    loss = opt.step(X, y)
    assert torch.allclose(loss, lossfn(before(X), y))
    for name, p in model.named_parameters():
        module, role = name.split(".")
        f = kron_reference(before, lossfn, X, y, module, role)
        if len(f) == 1:
            M = f[0] + lam * torch.eye(f[0].shape[0], dtype=DT)
        elif method == "exact":
            M = torch.kron(*[t.contiguous() for t in f]) + lam * torch.eye(p.numel(), dtype=DT)
        else:
            r = math.sqrt(lam)
            M = torch.kron(f[0].contiguous() + r * torch.eye(f[0].shape[0], dtype=DT), f[1] + r * torch.eye(f[1].shape[0], dtype=DT))
        step = torch.linalg.solve(M, grads[name].reshape(-1)).reshape(p.shape)
        want = before.get_parameter(name) - lr * step
        assert torch.allclose(p, want, rtol=1e-9, atol=1e-12), name


def test_running_averages_and_intervals():
    """factor_interval=2, ema_decay=0.5: the factors are ``0.5 F(θ_0) + 0.5 F(θ_2)`` after
    three steps; inverse_interval=2: step 1 uses the inverse of step 0."""
    model, (X, y) = _model(), _data()
    lossfn = nn.CrossEntropyLoss()
    f = curvature(model, lossfn, [KFLR()])
    opt = KFACOptimizer(model, lossfn, lr=0.3, damping=0.1, curvature="kflr", factor_interval=2,
                        inverse_interval=2, ema_decay=0.5, method="exact")
    seen = []
    for _ in range(3):
        seen.append(f(X, y)["kflr"])
        opt.step(X, y)
    for name, p in model.named_parameters():
        got = opt.state[p]["factors"]
        want = [0.5 * a + 0.5 * b for a, b in zip(seen[0][name], seen[2][name])]
        assert all(torch.allclose(g, w, rtol=1e-10) for g, w in zip(got, want)), name


def test_step_1_reuses_step_0_inverse():
    model, (X, y) = _model(), _data()
    lossfn = nn.CrossEntropyLoss()
    opt = KFACOptimizer(model, lossfn, lr=0.3, damping=0.1, curvature="kflr", inverse_interval=2, method="exact")
    opt.step(X, y)
    frozen = opt._precondition
    opt.step(X, y)
    assert opt._precondition is frozen
    opt.step(X, y)
    assert opt._precondition is not frozen


@pytest.mark.parametrize("kind", ["kfac", "kflr", "ekfac"])
def test_reduces_the_loss_of_a_regression_problem(kind):
    torch.manual_seed(3)
    X = torch.randn(64, 4, dtype=DT)
    y = torch.sin(X @ torch.randn(4, 2, dtype=DT))
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 2)).to(DT)
    opt = KFACOptimizer(model, nn.MSELoss(), lr=0.5, damping=1e-2, curvature=kind, kl_clip=1e-2,
                        generator=seeded(0))
    first = opt.step(X, y)
    for _ in range(30):
        last = opt.step(X, y)
    assert torch.isfinite(last) and last < 0.5 * first, (first, last)


def test_kl_clip_scales_the_step():
    """``ν = min(1, sqrt(κ / (lr² Δᵀ∇L)))``: the clipped step is ν times the unclipped one."""
    (X, y) = _data()
    steps = {}
    for kl in (None, 1e-6):
        model = _model()
        KFACOptimizer(model, nn.CrossEntropyLoss(), lr=0.5, damping=0.1, curvature="kflr", kl_clip=kl).step(X, y)
        steps[kl] = torch.cat([(p - q).reshape(-1) for p, q in zip(model.parameters(), _model().parameters())])
    ratio = steps[1e-6] / steps[None]
    assert torch.allclose(ratio, ratio[0].expand_as(ratio)) and 0 < ratio[0] < 1
    ref = _model()
    grad = torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        nn.CrossEntropyLoss()(ref(X), y), list(ref.parameters()))])
    quad = (-steps[None] / 0.5 * grad).sum() * 0.5**2  # lr² Δᵀ g with Δ = -step / lr
    assert torch.allclose(ratio[0], (1e-6 / quad).sqrt())


@pytest.mark.parametrize("kind", ["kflr", "ekfac"])
def test_state_dict_round_trip(kind):
    """A fresh optimizer loaded from another's state continues exactly as the original."""
    model, (X, y) = _model(), _data()
    lossfn = nn.CrossEntropyLoss()
    opts = dict(lr=0.3, damping=0.1, curvature=kind, momentum=0.9, factor_interval=2, inverse_interval=3)
    opt = KFACOptimizer(model, lossfn, **opts)
    for _ in range(4):
        opt.step(X, y)
    clone = copy.deepcopy(model)
    opt2 = KFACOptimizer(clone, lossfn, **opts)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    for i in range(3):  # the same MC labels for both (global stream)
        torch.manual_seed(i)
        opt.step(X, y)
        torch.manual_seed(i)
        opt2.step(X, y)
    for (n, a), b in zip(model.named_parameters(), clone.parameters()):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14), n


def test_only_parameters_change():
    model, (X, y) = _model(), _data()
    opt = KFACOptimizer(model, nn.CrossEntropyLoss(), curvature="kfac")
    before = copy.deepcopy(model.state_dict())
    opt.step(X, y)
    assert all(p.grad is None for p in model.parameters())
    assert not any(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_refusals():
    model = _model()
    with pytest.raises(CurvatureError, match="curvature='shampoo'"):
        KFACOptimizer(model, nn.MSELoss(), curvature="shampoo")
    with pytest.raises(CurvatureError, match="damping"):
        KFACOptimizer(model, nn.MSELoss(), damping=-1.0)
    with pytest.raises(CurvatureError, match="factor_interval=0"):
        KFACOptimizer(model, nn.MSELoss(), factor_interval=0)
    with pytest.raises(CurvatureTypeError, match=r"step\(X, y\)"):
        KFACOptimizer(model, nn.MSELoss()).step(closure=lambda: 0.0)


def test_ekfac_keeps_its_basis_and_reads_refitted_eigenvalues():
    """Between refreshes (inverse_interval=3) EKFAC's eigenvalues are re-fitted every
    factor step while the basis is kept: the direction is the EKFAC solve with the
    current eigenvalues, and the preconditioner eigendecomposes the basis once per refresh
    (not per step; each re-fit, ``ekfac_eigenvalues``, decomposes it once more)."""
    import curvlib.precondition._kronbasis as kronbasis
    from curvlib import precondition as pre

    model, (X, y) = _model(), _data()
    lossfn = nn.CrossEntropyLoss()
    opt = KFACOptimizer(model, lossfn, lr=0.1, damping=0.1, curvature="ekfac", factor_interval=1,
                        inverse_interval=3, ema_decay=0.5, generator=seeded(2))
    calls = []
    original = kronbasis.eigen_of
    pre.eigen_of = lambda *a: calls.append(1) or original(*a)
    try:
        for _ in range(3):
            opt.step(X, y)
    finally:
        pre.eigen_of = original
    n_params = len(list(model.parameters()))
    # per parameter: the preconditioner's once (step 0's refresh) + one per re-fit (3 factor steps);
    # before, every step's solve decomposed the basis again (n_params * 6)
    assert len(calls) == n_params * (1 + 3)
    names = [n for n, _ in model.named_parameters()]
    basis = {n: opt.state[p]["basis"] for n, p in model.named_parameters()}
    s = {n: opt.state[p]["ekfac"] for n, p in model.named_parameters()}
    grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    got = opt._directions(grads)
    want = pre.ekfac_inverse_vp(basis, s, grads, 0.1)
    for n in names:
        torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-12)
