"""``curvlib.precondition`` against dense float64 inverses built independently of its code.

The dense approximation of each layout is written out here (``torch.kron``, a permutation
for ConvTranspose, ``torch.block_diag`` for groups) and inverted with ``torch.linalg.solve``;
EKFAC's eigenvalues come from ``torch.func`` per-sample gradients (``vmap(grad)``).
"""

import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib.extensions import KFAC, KFLR, BatchGrad, DiagHessian, SqrtGGNExact
from curvlib.precondition import (
    diag_inverse_vp, ekfac_eigenvalues, ekfac_inverse_vp, kron_inverse_vp, kron_preconditioner,
    reduction_scale,
)
from oracles.on_device import seeded
from oracles.first_order import individual_gradients

DT = torch.float64


def _spd(n, gen, rank=None):
    m = torch.randn(n, rank or n + 1, dtype=DT, generator=gen)
    return m @ m.T / m.shape[1]


def _damped(B, A, lam, method):
    """The dense damped matrix of one ``[B, A]`` pair, per ``method`` (formulas of the paper)."""
    I_B, I_A = torch.eye(B.shape[0], dtype=DT), torch.eye(A.shape[0], dtype=DT)
    if method == "exact":
        return torch.kron(B, A) + lam * torch.eye(B.shape[0] * A.shape[0], dtype=DT)
    pi = 1.0
    if method == "pi":
        pi = math.sqrt((A.trace() / A.shape[0]) / (B.trace() / B.shape[0]))
    return torch.kron(B + math.sqrt(lam) / pi * I_B, A + pi * math.sqrt(lam) * I_A)


def _close(a, b, what, rtol=1e-9):
    scale = b.abs().max().clamp_min(1e-30)
    assert ((a - b).abs().max() / scale) < rtol, f"{what}: {(a - b).abs().max() / scale:.3g}"


@settings(max_examples=25)
@given(o=st.integers(1, 5), a=st.integers(1, 5), lam=st.floats(1e-4, 10.0), seed=st.integers(0, 999),
       method=st.sampled_from(["pi", "plain", "exact"]), rank=st.sampled_from([None, 1]))
def test_linear_pair_matches_dense_solve(o, a, lam, seed, method, rank):
    """``[B, A]`` of a weight ``[o, a]``: the three damping methods against the dense solve."""
    gen = seeded(seed)
    B, A = _spd(o, gen, rank), _spd(a, gen)
    v = torch.randn(o, a, dtype=DT, generator=gen)
    got = kron_inverse_vp({"w": [B, A]}, {"w": v}, lam, method=method)["w"]
    want = torch.linalg.solve(_damped(B, A, lam, method), v.reshape(-1)).reshape(o, a)
    _close(got, want, method)


class Mixed(nn.Module):
    """Linear, grouped Conv1d, Embedding, LayerNorm and a bias-like position parameter."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.pos = nn.Parameter(torch.randn(3, 4))
        self.ln = nn.LayerNorm(4)
        self.conv = nn.Conv1d(4, 4, 2, groups=2)
        self.out = nn.Linear(8, 3)

    def forward(self, idx):
        h = self.ln(self.emb(idx) + self.pos).transpose(1, 2)  # [N, 4, 3]
        return self.out(torch.tanh(self.conv(h)).flatten(1))


def _dense(name, factors, shape):
    """The dense approximation in ``p``'s row-major flattening, by hand per layout."""
    f = factors
    if len(f) == 1:
        return torch.diag(f[0]) if f[0].dim() == 1 else f[0]
    if f[0].dim() == 1:  # [A [R], B [D, D]]: diag(A) ⊗ B
        return torch.kron(torch.diag(f[0]), f[1])
    if f[0].dim() == 3:  # grouped: block-diagonal over the groups' rows
        return torch.block_diag(*[torch.kron(b, a) for b, a in zip(f[0], f[1])])
    return torch.kron(f[0], f[1])


@pytest.mark.parametrize("method", ["exact", "plain"])
def test_every_layout_of_a_mixed_model(method):
    """Embedding, fixed rows, LayerNorm blocks, grouped conv, Linear: exact against the dense
    ``(F + λ)⁻¹``; plain against ``(B + √λ) ⊗ (A + √λ)`` (single factors: ``F + λ``)."""
    torch.manual_seed(0)
    model = Mixed().to(DT)
    X, y = torch.randint(0, 5, (6, 3)), torch.randint(0, 3, (6,))
    qs = curvature(model, nn.CrossEntropyLoss(), [KFLR()])(X, y)
    lam = 0.3
    got = kron_inverse_vp(qs["kflr"], qs["grad"], lam, method=method, model=model)
    for name, g in qs["grad"].items():
        f = qs["kflr"][name]
        if method == "plain" and len(f) == 2:
            r = math.sqrt(lam)
            damped = [t + r if t.dim() == 1 else t + r * torch.eye(t.shape[-1], dtype=DT) for t in f]
            M = _dense(name, damped, g.shape)
        else:
            M = _dense(name, f, g.shape) + lam * torch.eye(g.numel(), dtype=DT)
        want = torch.linalg.solve(M, g.reshape(-1)).reshape(g.shape)
        _close(got[name], want, f"{name} {method}")


@pytest.mark.parametrize("groups", [1, 2])
def test_conv_transpose_weight_layout(groups):
    """ConvTranspose weight ``[C_in, C_out/G, k]``: ``B`` acts on dim 1, ``A`` on ``(c, k)``;
    a square one is refused without ``model=``."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.ConvTranspose1d(2 * groups, 2 * groups, 2, groups=groups), nn.Flatten(),
                          nn.Linear(6 * groups, 2)).to(DT)
    X, y = torch.randn(7, 2 * groups, 2, dtype=DT), torch.randint(0, 2, (7,))
    qs = curvature(model, nn.CrossEntropyLoss(), [KFLR()])(X, y)
    g = qs["grad"]["0.weight"]  # [C_in, o, k]
    got = kron_inverse_vp(qs["kflr"], {"0.weight": g}, 0.1, method="exact", model=model)["0.weight"]
    B, A = qs["kflr"]["0.weight"]
    c_in, o, k = g.shape
    per = c_in // groups
    blocks = B.reshape(groups, o, o), A.reshape(groups, per * k, per * k)
    for j in range(groups):  # group j: rows of W, as [o, (c, k)]
        gj = g[j * per:(j + 1) * per].permute(1, 0, 2).reshape(-1)
        M = torch.kron(blocks[0][j], blocks[1][j]) + 0.1 * torch.eye(gj.numel(), dtype=DT)
        want = torch.linalg.solve(M, gj).reshape(o, per, k).permute(1, 0, 2)
        _close(got[j * per:(j + 1) * per], want, f"group {j}")
    with pytest.raises(CurvatureError, match=r"'0.weight'.*pass model="):
        kron_inverse_vp(qs["kflr"], {"0.weight": g}, 0.1)


def _mlp():
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_ekfac_against_brute_force_per_sample_gradients(reduction):
    """``s = (1/c) Σ_n (Q_Bᵀ G_n Q_A)²`` with ``G_n`` from ``vmap(grad)`` (``c`` the reduction
    factor, so ``diag(s)`` is the empirical Fisher ``c Σ ∇ℓ_n ∇ℓ_nᵀ`` in the eigenbasis); the
    preconditioned gradient against the dense ``(Q diag(s) Qᵀ + λ)⁻¹``."""
    model = _mlp()
    X, y = torch.randn(20, 3, dtype=DT), torch.randint(0, 3, (20,))
    lossfn = nn.CrossEntropyLoss(reduction=reduction)
    qs = curvature(model, lossfn, [KFLR(), BatchGrad()])(X, y)
    scale = reduction_scale(lossfn, y)
    assert scale == (20.0 if reduction == "mean" else 1.0)
    s = ekfac_eigenvalues(qs["kflr"], qs["grad_batch"], scale=scale)
    got = ekfac_inverse_vp(qs["kflr"], s, qs["grad"], 0.05)
    per_sample = individual_gradients(model, lossfn, X, y)
    for name, g in qs["grad"].items():
        f = qs["kflr"][name]
        Q = torch.linalg.eigh(f[0])[1]
        if len(f) == 2:
            Q = torch.kron(Q, torch.linalg.eigh(f[1])[1])
        G = per_sample[name].reshape(20, -1)
        s_dense = scale * ((G @ Q) ** 2).sum(0)
        _close(s[name].reshape(-1), s_dense, f"s {name}")
        # the empirical Fisher, scaled as c Σ ∇ℓ ∇ℓᵀ, has the same diagonal in the eigenbasis
        ef = (G.T @ G) * scale
        _close(s_dense, torch.diagonal(Q.T @ ef @ Q), f"EF {name}")
        M = Q @ torch.diag(s_dense) @ Q.T + 0.05 * torch.eye(g.numel(), dtype=DT)
        _close(got[name], torch.linalg.solve(M, g.reshape(-1)).reshape(g.shape), f"ekfac {name}")


def test_ekfac_with_sqrt_ggn_rows_gives_the_ggn_diagonal_in_the_eigenbasis():
    model = _mlp()
    X, y = torch.randn(10, 3, dtype=DT), torch.randint(0, 3, (10,))
    qs = curvature(model, nn.CrossEntropyLoss(), [KFLR(), SqrtGGNExact()])(X, y)
    s = ekfac_eigenvalues(qs["kflr"], qs["sqrt_ggn_exact"], scale=1.0)
    for name, rows in qs["sqrt_ggn_exact"].items():
        ggn = torch.einsum("cni,cnj->ij", rows.flatten(2), rows.flatten(2))
        f = qs["kflr"][name]
        Q = torch.linalg.eigh(f[0])[1]
        if len(f) == 2:
            Q = torch.kron(Q, torch.linalg.eigh(f[1])[1])
        _close(s[name].reshape(-1), torch.diagonal(Q.T @ ggn @ Q), name)


@pytest.mark.parametrize("option", ["pi", "exact", "plain"])
def test_matches_curvlinops_kfac_inverse(option):
    """curvlinops' ``KFACInverseLinearOperator`` on the same GGN factors (type-2 = KFLR):
    heuristic damping = ``"pi"``, exact damping = ``"exact"``, damping ``δ`` on both = ``"plain"``
    with ``λ = δ²``."""
    curvlinops = pytest.importorskip("curvlinops")
    model = _mlp()
    X, y = torch.randn(12, 3, dtype=DT), torch.randint(0, 3, (12,))
    lossfn = nn.CrossEntropyLoss()
    params = [p for p in model.parameters()]
    kfac = curvlinops.KFACLinearOperator(model, lossfn, params, [(X, y)], fisher_type="type-2",
                                         check_deterministic=False)
    lam = 0.04
    kwargs = {"pi": dict(damping=lam, use_heuristic_damping=True, min_damping=0.0),
              "exact": dict(damping=lam, use_exact_damping=True),
              "plain": dict(damping=math.sqrt(lam))}[option]
    inv = curvlinops.KFACInverseLinearOperator(kfac, **kwargs)
    qs = curvature(model, lossfn, [KFLR()])(X, y)
    names = [n for n, _ in model.named_parameters()]
    want = inv @ [qs["grad"][n] for n in names]
    got = kron_inverse_vp(qs["kflr"], qs["grad"], lam, method=option)
    for n, w in zip(names, want):
        if n.endswith("bias") and option == "plain":
            # curvlinops damps a bias with its layer's B damping (here √λ); curvlib's single
            # factor is the whole block, inverted as (B + λ')⁻¹: equal for λ' = √λ
            got[n] = kron_inverse_vp(qs["kflr"], {n: qs["grad"][n]}, math.sqrt(lam))[n]
        elif n.endswith("bias") and option == "pi":
            continue  # curvlinops: the weight's √λ/π on B; curvlib: (B + λ)⁻¹ (module doc)
        _close(got[n], w, f"{option} {n}", rtol=1e-7)


def test_composes_with_vmap_and_is_pure():
    model = _mlp()
    X, y = torch.randn(8, 3, dtype=DT), torch.randint(0, 3, (8,))
    qs = curvature(model, nn.CrossEntropyLoss(), [KFAC()])(X, y)
    before = {n: [t.clone() for t in f] for n, f in qs["kfac"].items()}
    P = kron_preconditioner(qs["kfac"], 1e-2)
    V = {n: torch.randn(5, *g.shape, dtype=DT) for n, g in qs["grad"].items()}
    batched = torch.func.vmap(P)(V)
    for i in range(5):
        one = P({n: v[i] for n, v in V.items()})
        for n in V:
            _close(batched[n][i], one[n], n, rtol=1e-12)
    for n, f in qs["kfac"].items():
        assert all(torch.equal(a, b) for a, b in zip(f, before[n]))


@settings(max_examples=15)
@given(lam=st.floats(1e-3, 1.0), exponent=st.sampled_from([-1.0, -0.5]),
       negative=st.sampled_from(["clip", "abs"]), seed=st.integers(0, 99))
def test_diagonal_against_dense(lam, exponent, negative, seed):
    """``(diag(d') + λ)^e v`` with ``d'`` the clipped or absolute Hessian diagonal."""
    torch.manual_seed(seed)
    model = _mlp()
    X, y = torch.randn(6, 3, dtype=DT), torch.randint(0, 3, (6,))
    qs = curvature(model, nn.CrossEntropyLoss(), [DiagHessian()])(X, y)
    got = diag_inverse_vp(qs["diag_h"], qs["grad"], lam, exponent=exponent, negative=negative)
    for n, g in qs["grad"].items():
        d = qs["diag_h"][n].reshape(-1)
        d = d.abs() if negative == "abs" else torch.where(d > 0, d, torch.zeros_like(d))
        M = torch.diag((d + lam) ** (-exponent))
        _close(got[n], torch.linalg.solve(M, g.reshape(-1)).reshape(g.shape), n)


def test_refusals_name_the_argument():
    B, A = torch.eye(2, dtype=DT), torch.eye(3, dtype=DT)
    with pytest.raises(CurvatureError, match="damping"):
        kron_inverse_vp({"w": [B, A]}, {"w": torch.ones(2, 3, dtype=DT)}, 0.0)
    with pytest.raises(CurvatureError, match="method='newton'"):
        kron_inverse_vp({"w": [B, A]}, {"w": torch.ones(2, 3, dtype=DT)}, 1.0, method="newton")
    with pytest.raises(CurvatureError, match="'w' of shape \\[3, 2\\]"):
        kron_inverse_vp({"w": [B, A]}, {"w": torch.ones(3, 2, dtype=DT)}, 1.0)
    with pytest.raises(CurvatureError, match="no Kronecker factors for parameter 'v'"):
        kron_inverse_vp({"w": [B, A]}, {"v": torch.ones(2, 3, dtype=DT)}, 1.0)
    d = {"w": torch.tensor([1.0, -1.0], dtype=DT)}
    with pytest.raises(CurvatureError, match="'w' has negative entries"):
        diag_inverse_vp(d, {"w": torch.ones(2, dtype=DT)}, 1.0, negative="error")


@settings(max_examples=10)
@given(o=st.integers(2, 6), a=st.integers(2, 6), seed=st.integers(0, 999), tiny=st.sampled_from([1e-30, 1e-20, 1e-16]))
def test_float32_factors_of_tiny_entries_and_failed_eigh(o, a, seed, tiny):
    """A diverged float32 loop's factors (entries 1e-30..1e-16): the same
    solve as the float64 dense one, also when float32 eigh fails (then float64 is used)."""
    gen = seeded(seed)
    B, A = _spd(o, gen) * tiny, _spd(a, gen) * tiny
    v, lam = torch.randn(o, a, dtype=DT, generator=gen), 1e-3
    want = torch.linalg.solve(_damped(B, A, lam, "exact"), v.reshape(-1)).reshape(o, a)
    got = kron_inverse_vp({"w": [B.float(), A.float()]}, {"w": v.float()}, lam, method="exact")["w"]
    _close(got.double(), want, "tiny float32 factors", rtol=1e-5)
    eigh = torch.linalg.eigh

    def fails_in_float32(m):
        if m.dtype == torch.float32:
            raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")
        return eigh(m)

    with mock.patch.object(torch.linalg, "eigh", fails_in_float32):
        got = kron_inverse_vp({"w": [B.float(), A.float()]}, {"w": v.float()}, lam, method="exact")["w"]
    assert got.dtype == torch.float32
    _close(got.double(), want, "float64 fallback", rtol=1e-5)


def test_non_finite_factor_refused_naming_the_parameter():
    B = torch.eye(3, dtype=DT)
    with pytest.raises(CurvatureError, match=r"parameter 'fc.weight' has non-finite entries.*Damp more"):
        kron_inverse_vp({"fc.weight": [B * float("nan"), B]}, {"fc.weight": torch.ones(3, 3, dtype=DT)}, 1e-3)
