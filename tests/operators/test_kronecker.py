"""``curvlib.operators.KFAC`` / ``EKFAC`` against oracles built independently of their code.

* the dense operator against ``block_diag(kron(factors))`` written out here from ``curvature``'s
  factors per batch, combined over batches by the documented convention (input factors: the
  sample-weighted mean; root factor: ``Σ_b w_b R_b``, ``w_b²`` for the empirical Fisher);
* KFLR of one Linear layer with MSE (a constant loss Hessian) against the exact GGN blocks of
  :class:`curvlib.operators.GGN`, on one batch and on a loader;
* the inverses against dense solves and ``inverse(λ) @ ((K + λI) v) == v``;
* EKFAC's eigenvalues against ``diag(Qᵀ G Q)`` of the dense GGN / empirical Fisher blocks;
* curvlinops 3.0.1's ``KFACLinearOperator`` / ``EKFACLinearOperator`` side by side.
"""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib import extensions as ext
from curvlib.operators import EKFAC, GGN, KFAC, EmpiricalFisher
from curvlib.operators.base import CurvatureOperator
from curvlib.precondition import ekfac_preconditioner, kron_preconditioner
from oracles.models import tiny_gpt2
from oracles.on_device import seeded

DT = torch.float64
KEYS = {"exact": "kflr", "mc": "kfac", "empirical": "kfac_empirical"}


def _mlp(sizes, seed):
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers += [nn.Linear(a, b)] + ([nn.Tanh()] if i < len(sizes) - 2 else [])
    return nn.Sequential(*layers).to(DT)


def _batches(loss, sizes, n_in, n_out, gen):
    out = []
    for n in sizes:
        X = torch.randn(n, n_in, dtype=DT, generator=gen)
        y = torch.randint(0, n_out, (n,), generator=gen) if loss == "ce" else torch.randn(n, n_out, dtype=DT, generator=gen)
        out.append((X, y))
    return out


def _lossfn(loss, reduction):
    return (nn.CrossEntropyLoss if loss == "ce" else nn.MSELoss)(reduction=reduction)


def _normaliser(loss, reduction, y):
    return 1.0 if reduction == "sum" else float(y.shape[0] if loss == "ce" else y.numel())


def _extension(fisher_type, gen):
    return {"exact": ext.KFLR(), "mc": ext.KFAC(generator=gen), "empirical": ext.KFACEmpirical()}[fisher_type]


def _oracle_factors(model, loss, reduction, data, fisher_type, gen=None):
    """The data's factors per parameter (Linear layouts ``[B, A]``/``[B]``), combined here."""
    f = curvature(model, _lossfn(loss, reduction), [_extension(fisher_type, gen)])
    parts = [(f(X, y)[KEYS[fisher_type]], X.shape[0], _normaliser(loss, reduction, y)) for X, y in data]
    N, M = sum(p[1] for p in parts), sum(p[2] for p in parts)
    power = 2 if fisher_type == "empirical" else 1
    out = {}
    for name in parts[0][0]:
        B = sum((m / M if reduction == "mean" else 1.0) ** power * q[name][0] for q, _, m in parts)
        A = [sum(n / N * q[name][1] for q, n, _ in parts)] if len(parts[0][0][name]) == 2 else []
        out[name] = [B] + A
    return out


def _kron_dense(factors):
    return torch.block_diag(*[torch.kron(*f) if len(f) == 2 else f[0] for f in factors.values()])


def _data_arg(data):
    return data[0] if len(data) == 1 else data


@settings(max_examples=8)
@given(hidden=st.integers(1, 4), n_in=st.integers(1, 3), n_out=st.integers(2, 3),
       sizes=st.lists(st.integers(1, 4), min_size=1, max_size=3), loss=st.sampled_from(["ce", "mse"]),
       reduction=st.sampled_from(["mean", "sum"]), fisher_type=st.sampled_from(["exact", "mc", "empirical"]),
       seed=st.integers(0, 99))
def test_dense_is_block_diag_of_combined_factors(hidden, n_in, n_out, sizes, loss, reduction, fisher_type, seed):
    """``to_dense`` (and the base class's column-by-column form) = ``block_diag(kron(B, A), B, ...)``."""
    model, gen = _mlp([n_in, hidden, n_out], seed), seeded(seed)
    data = _batches(loss, sizes, n_in, n_out, gen)
    K = KFAC(model, _lossfn(loss, reduction), _data_arg(data), fisher_type=fisher_type, generator=seeded(seed + 1))
    want = _kron_dense(_oracle_factors(model, loss, reduction, data, fisher_type, seeded(seed + 1)))
    torch.testing.assert_close(K.to_dense(), want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(CurvatureOperator.to_dense(K), want, rtol=1e-10, atol=1e-12)


def _targets(loss, n, n_out, gen):
    if loss == "bce":
        return torch.rand(n, n_out, dtype=DT, generator=gen).round()
    if loss == "mse":
        return torch.randn(n, n_out, dtype=DT, generator=gen)
    return torch.randint(0, n_out, (n,), generator=gen)


@settings(max_examples=10)
@given(sizes=st.lists(st.integers(1, 4), min_size=2, max_size=3), loss=st.sampled_from(["ce", "ce_options", "mse", "bce"]),
       reduction=st.sampled_from(["mean", "sum"]), fisher_type=st.sampled_from(["exact", "empirical"]),
       ekfac=st.booleans(), seed=st.integers(0, 99))
def test_a_loader_is_its_batches_concatenated(sizes, loss, reduction, fisher_type, ekfac, seed):
    """Over a loader the operator is that of all its samples as one batch (``c = 1/Σ_b M_b``),
    also with ``ignore_index`` and class ``weight`` (the batches' normalisers are weighted masses)."""
    model, gen = _mlp([3, 3, 3], seed), seeded(seed)
    lossfn = {"ce": nn.CrossEntropyLoss(reduction=reduction), "mse": nn.MSELoss(reduction=reduction),
              "bce": nn.BCEWithLogitsLoss(reduction=reduction),
              "ce_options": nn.CrossEntropyLoss(weight=torch.rand(3, dtype=DT, generator=gen) + 0.1, ignore_index=2,
                                                reduction=reduction)}[loss]
    data = [(torch.randn(n, 3, dtype=DT, generator=gen), _targets(loss, n, 3, gen)) for n in sizes]
    if loss == "ce_options":
        data[0][1][0] = 0  # one counted target at least
    whole = (torch.cat([X for X, _ in data]), torch.cat([y for _, y in data]))
    Op = EKFAC if ekfac else KFAC
    got, want = Op(model, lossfn, data, fisher_type=fisher_type), Op(model, lossfn, whole, fisher_type=fisher_type)
    torch.testing.assert_close(got.to_dense(), want.to_dense(), rtol=1e-9, atol=1e-12)


def test_max_factor_dim_over_a_loader():
    """``max_factor_dim``: a side above it is the diagonal of the dense one, combined over batches
    like it (a Linear's ``B [O]`` is its root factor although it comes first and is 1-D)."""
    model, gen = _mlp([2, 5, 3], 6), seeded(6)
    data = _batches("ce", [3, 4], 2, 3, gen)
    small = KFAC(model, nn.CrossEntropyLoss(), data, fisher_type="exact", max_factor_dim=3)
    dense = KFAC(model, nn.CrossEntropyLoss(), data, fisher_type="exact")
    want = {}
    for name, f in dense.factors.items():
        want[name] = [t.diagonal() if t.dim() == 2 and t.shape[0] > 3 else t for t in f]
        for a, b in zip(small.factors[name], want[name]):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    blocks = [torch.kron(*[t if t.dim() == 2 else torch.diag(t) for t in f]) if len(f) == 2 else
              (f[0] if f[0].dim() == 2 else torch.diag(f[0])) for f in want.values()]
    torch.testing.assert_close(small.to_dense(), torch.block_diag(*blocks), rtol=1e-10, atol=1e-12)
    v = torch.randn(small.shape[0], dtype=DT, generator=gen)
    torch.testing.assert_close(small.inverse(0.1) @ (small @ v + 0.1 * v), v, rtol=0, atol=1e-10)


@settings(max_examples=10)
@given(n_in=st.integers(1, 4), n_out=st.integers(1, 3), sizes=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       reduction=st.sampled_from(["mean", "sum"]), seed=st.integers(0, 99))
def test_kflr_of_a_linear_layer_with_mse_is_the_ggn(n_in, n_out, sizes, reduction, seed):
    """MSE's loss Hessian is constant, so KFLR of one Linear layer is its exact GGN block, also
    over a loader (this fixes the convention of combining batches)."""
    model, gen = _mlp([n_in, n_out], seed), seeded(seed)
    data = _data_arg(_batches("mse", sizes, n_in, n_out, gen))
    lossfn = nn.MSELoss(reduction=reduction)
    K, G = KFAC(model, lossfn, data, fisher_type="exact").to_dense(), GGN(model, lossfn, data).to_dense()
    w = n_in * n_out
    torch.testing.assert_close(K[:w, :w], G[:w, :w], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(K[w:, w:], G[w:, w:], rtol=1e-10, atol=1e-12)


@settings(max_examples=10)
@given(hidden=st.integers(1, 4), sizes=st.lists(st.integers(1, 4), min_size=1, max_size=2),
       fisher_type=st.sampled_from(["exact", "mc", "empirical"]), lam=st.floats(1e-3, 10.0),
       seed=st.integers(0, 99), ekfac=st.booleans())
def test_inverse_is_the_damped_inverse(hidden, sizes, fisher_type, lam, seed, ekfac):
    """``inverse(λ) @ ((K + λI) v) == v`` and ``inverse(λ).to_dense() == (K + λI)⁻¹``."""
    model, gen = _mlp([3, hidden, 2], seed), seeded(seed)
    data = _data_arg(_batches("ce", sizes, 3, 2, gen))
    K = (EKFAC if ekfac else KFAC)(model, nn.CrossEntropyLoss(), data, fisher_type=fisher_type, generator=seeded(seed))
    v = torch.randn(K.shape[0], 3, dtype=DT, generator=gen)
    inv = K.inverse(lam)
    torch.testing.assert_close(inv @ (K @ v + lam * v), v, rtol=0, atol=1e-10)
    damped = K.to_dense() + lam * torch.eye(K.shape[0], dtype=DT)
    torch.testing.assert_close(inv.to_dense(), torch.linalg.inv(damped), rtol=1e-8, atol=1e-10)


def test_heuristic_damping_is_pi_damping():
    """``heuristic=True``: ``(B + √λ/π I)⁻¹ ⊗ (A + π√λ I)⁻¹``, π = √((tr A/dim A)/(tr B/dim B));
    a bias (one factor) ``(B + λ)⁻¹``."""
    model, gen = _mlp([3, 4, 2], 0), seeded(0)
    (X, y), = _batches("ce", [6], 3, 2, gen)
    K = KFAC(model, nn.CrossEntropyLoss(), (X, y), fisher_type="exact")
    lam, blocks = 0.3, []
    for f in K.factors.values():
        if len(f) == 1:
            blocks.append(torch.linalg.inv(f[0] + lam * torch.eye(f[0].shape[0], dtype=DT)))
            continue
        B, A = f
        pi = math.sqrt((A.trace() / A.shape[0]) / (B.trace() / B.shape[0]))
        damped = torch.kron(B + math.sqrt(lam) / pi * torch.eye(B.shape[0], dtype=DT),
                            A + pi * math.sqrt(lam) * torch.eye(A.shape[0], dtype=DT))
        blocks.append(torch.linalg.inv(damped))
    torch.testing.assert_close(K.inverse(lam, heuristic=True).to_dense(), torch.block_diag(*blocks), rtol=1e-9, atol=1e-12)


def _eigenbasis(E, name):
    """``Q [P, P]``: column ``i`` the eigenvector of ``E``'s block ``name`` at core entry ``i``."""
    layout, eigen = E.layouts[name], E.eigen[name]
    size = math.prod(layout.shape)
    core = torch.eye(size, dtype=DT).reshape(size, layout.groups, layout.out, layout.inp)
    return layout.from_core(eigen.unrotate(core)).reshape(size, size).T


@settings(max_examples=10)
@given(hidden=st.integers(1, 4), sizes=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       loss=st.sampled_from(["ce", "mse"]), reduction=st.sampled_from(["mean", "sum"]),
       fisher_type=st.sampled_from(["exact", "empirical"]), seed=st.integers(0, 99))
def test_ekfac_eigenvalues_are_the_projected_diagonal(hidden, sizes, loss, reduction, fisher_type, seed):
    """EKFAC's ``Λ*`` = ``diag(Qᵀ G_p Q)`` of the dense GGN (empirical Fisher) block; its
    eigenbasis is KFAC's (``Qᵀ (B ⊗ A) Q`` diagonal); ``to_dense`` = ``Q diag(Λ*) Qᵀ``."""
    model, gen = _mlp([3, hidden, 2], seed), seeded(seed)
    data = _data_arg(_batches(loss, sizes, 3, 2, gen))
    lossfn = _lossfn(loss, reduction)
    E = EKFAC(model, lossfn, data, fisher_type=fisher_type)
    G = (GGN if fisher_type == "exact" else EmpiricalFisher)(model, lossfn, data).to_dense()
    K, dense, offsets = KFAC(model, lossfn, data, fisher_type=fisher_type).to_dense(), E.to_dense(), E.domain.offsets()
    for name, sl in offsets.items():
        Q = _eigenbasis(E, name)
        torch.testing.assert_close(Q.T @ Q, torch.eye(Q.shape[0], dtype=DT), rtol=0, atol=1e-10)
        rotated_kfac = Q.T @ K[sl, sl] @ Q
        torch.testing.assert_close(rotated_kfac, torch.diag(rotated_kfac.diagonal()), rtol=0, atol=1e-10)
        want = (Q.T @ G[sl, sl] @ Q).diagonal()
        torch.testing.assert_close(E.eigenvalues[name].flatten(), want, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(dense[sl, sl], Q @ torch.diag(want) @ Q.T, rtol=1e-9, atol=1e-12)


def test_ekfac_mc_eigenvalues_are_the_sampled_columns_projected():
    """``"mc"``: ``Λ*`` from ``SqrtGGNMC`` columns with the same draws (the generator read by
    the factors, then by the columns, batch by batch), combined with the weights ``w_b``."""
    model, gen = _mlp([3, 4, 2], 1), seeded(1)
    data = _batches("ce", [3, 5], 3, 2, gen)
    E = EKFAC(model, nn.CrossEntropyLoss(), data, fisher_type="mc", mc_samples=3, generator=seeded(7))
    g = seeded(7)
    f = curvature(model, nn.CrossEntropyLoss(), [ext.KFAC(mc_samples=3, generator=g)])
    for X, y in data:
        f(X, y)  # the factors' draws
    roots = curvature(model, nn.CrossEntropyLoss(), [ext.SqrtGGNMC(mc_samples=3, generator=g)])
    cols = [roots(X, y)["sqrt_ggn_mc"] for X, y in data]
    for name, sl in E.domain.offsets().items():
        Q = _eigenbasis(E, name)
        want = sum(w * ((c[name].reshape(-1, Q.shape[0]) @ Q) ** 2).sum(0) for w, c in zip((3 / 8, 5 / 8), cols))
        torch.testing.assert_close(E.eigenvalues[name].flatten(), want, rtol=1e-9, atol=1e-12)


def test_mc_factors_estimate_the_exact_ones():
    """KFAC("mc") with many samples approaches KFLR (unbiased root factor), reproducibly per seed."""
    model, gen = _mlp([3, 4, 3], 2), seeded(2)
    data = _batches("ce", [4, 4], 3, 3, gen)
    exact = KFAC(model, nn.CrossEntropyLoss(), data, fisher_type="exact").to_dense()
    mc = KFAC(model, nn.CrossEntropyLoss(), data, mc_samples=4000, generator=seeded(3)).to_dense()
    assert (mc - exact).norm() / exact.norm() < 0.05
    again = KFAC(model, nn.CrossEntropyLoss(), data, mc_samples=4000, generator=seeded(3)).to_dense()
    assert torch.equal(mc, again)


def test_other_layouts_against_written_out_kron():
    """Embedding ``diag(A) ⊗ B``, grouped Conv ``blockdiag_g(B[g] ⊗ A[g])``, LayerNorm ``[F]``;
    a ConvTranspose (BackPACK's layout) through the inverse and the base class's dense form."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.norm = nn.Embedding(5, 4), nn.LayerNorm(4)
            self.conv = nn.Conv1d(4, 4, 2, groups=2)
            self.up = nn.ConvTranspose1d(4, 2, 2)
            self.head = nn.Linear(2 * 4, 3)

        def forward(self, tokens):
            h = self.norm(self.emb(tokens)).transpose(1, 2)  # [N, 4, T]
            return self.head(torch.tanh(self.up(torch.tanh(self.conv(h)))).flatten(1))

    torch.manual_seed(0)
    model, gen = Net().to(DT), seeded(0)
    data = [(torch.randint(0, 5, (n, 4), generator=gen), torch.randint(0, 3, (n,), generator=gen)) for n in (3, 2)]
    K = KFAC(model, nn.CrossEntropyLoss(), data, fisher_type="exact")
    offsets, dense = K.domain.offsets(), K.to_dense()
    A, B = K.factors["emb.weight"]
    torch.testing.assert_close(dense[offsets["emb.weight"]][:, offsets["emb.weight"]], torch.kron(torch.diag(A), B))
    Bc, Ac = K.factors["conv.weight"]
    sl = offsets["conv.weight"]
    torch.testing.assert_close(dense[sl, sl], torch.block_diag(*[torch.kron(Bc[g], Ac[g]) for g in range(2)]))
    torch.testing.assert_close(dense[offsets["norm.weight"], offsets["norm.weight"]], K.factors["norm.weight"][0])
    torch.testing.assert_close(dense, CurvatureOperator.to_dense(K), rtol=1e-10, atol=1e-12)
    v = torch.randn(K.shape[0], dtype=DT, generator=gen)
    torch.testing.assert_close(K.inverse(0.01) @ (K @ v + 0.01 * v), v, rtol=0, atol=1e-10)
    E = EKFAC(model, nn.CrossEntropyLoss(), data, fisher_type="exact")
    G = GGN(model, nn.CrossEntropyLoss(), data).to_dense()
    for name, sl in offsets.items():
        Q = _eigenbasis(E, name)
        torch.testing.assert_close(E.eigenvalues[name].flatten(), (Q.T @ G[sl, sl] @ Q).diagonal(), rtol=1e-9, atol=1e-12)


def test_factors_and_eigenvalues_feed_precondition():
    """``K.factors`` → ``kron_preconditioner(method="exact")`` is ``K.inverse``; ``E.eigenvalues``
    → ``ekfac_preconditioner`` is ``E.inverse``."""
    model, gen = _mlp([3, 4, 2], 3), seeded(3)
    X, y = _batches("ce", [5], 3, 2, gen)[0]
    K = KFAC(model, nn.CrossEntropyLoss(), (X, y), fisher_type="exact")
    E = EKFAC(model, nn.CrossEntropyLoss(), (X, y), fisher_type="empirical")
    v = {n: torch.randn(s, dtype=DT, generator=gen) for n, s in zip(K.domain.names, K.domain.shapes)}
    for got, want in [(kron_preconditioner(K.factors, 0.1, method="exact")(v), K.inverse(0.1) @ v),
                      (ekfac_preconditioner(E.factors, E.eigenvalues, 0.1)(v), E.inverse(0.1) @ v)]:
        for n in v:
            torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-12)


def test_params_and_purity():
    """``params=`` replaces the model's values; the model is not changed."""
    model, gen = _mlp([3, 4, 2], 4), seeded(4)
    X, y = _batches("ce", [5], 3, 2, gen)[0]
    params = {n: p.detach() + 0.5 for n, p in model.named_parameters()}
    before = {n: p.clone() for n, p in model.named_parameters()}
    K = KFAC(model, nn.CrossEntropyLoss(), (X, y), params=params, fisher_type="exact")
    shifted = _mlp([3, 4, 2], 4)
    with torch.no_grad():
        for n, p in shifted.named_parameters():
            p.add_(0.5)
    torch.testing.assert_close(K.to_dense(), KFAC(shifted, nn.CrossEntropyLoss(), (X, y), fisher_type="exact").to_dense())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("loss", ["ce", "mse"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("batches", [1, 2])
@pytest.mark.parametrize("fisher_type", ["exact", "empirical"])
def test_against_curvlinops(loss, reduction, batches, fisher_type):
    """curvlinops 3.0.1 on an MLP: equal for ``"exact"`` (its ``type-2``), and for ``"empirical"``
    up to the convention: its ``B`` carries ``c`` where curvlib's carries ``c²`` (``SumGradSquared``'s)."""
    curvlinops = pytest.importorskip("curvlinops")
    model, gen = _mlp([3, 4, 2], 5), seeded(5)
    data = _batches(loss, [5, 3][:batches], 3, 2, gen)
    lossfn = _lossfn(loss, reduction)
    params = list(model.parameters())
    scale = 1.0
    if fisher_type == "empirical" and reduction == "mean":
        scale = 1.0 / sum(_normaliser(loss, reduction, y) for _, y in data)
    for mine, theirs in [(KFAC, curvlinops.KFACLinearOperator), (EKFAC, curvlinops.EKFACLinearOperator)]:
        got = mine(model, lossfn, _data_arg(data), fisher_type=fisher_type).to_dense()
        op = theirs(model, lossfn, params, data, fisher_type="type-2" if fisher_type == "exact" else "empirical",
                    check_deterministic=False)
        want = (op @ torch.eye(got.shape[0], dtype=DT)) * scale
        assert ((got - want).norm() / want.norm()) < 1e-6, mine.__name__


@pytest.mark.parametrize("damping", [-1.0, 0.0, float("nan"), float("inf"), "0.1", True, None])
def test_bad_damping_is_refused(damping):
    model, gen = _mlp([3, 2], 0), seeded(0)
    X, y = _batches("ce", [4], 3, 2, gen)[0]
    for op in (KFAC(model, nn.CrossEntropyLoss(), (X, y)), EKFAC(model, nn.CrossEntropyLoss(), (X, y))):
        with pytest.raises(CurvatureError, match="damping"):
            op.inverse(damping)


@pytest.mark.parametrize("kwargs, word", [
    (dict(fisher_type="type-2"), "fisher_type"), (dict(fisher_type=None), "fisher_type"),
    (dict(mc_samples=0), "mc_samples"), (dict(fisher_type="exact", mc_samples=2), "mc_samples"),
    (dict(generator=3), "generator"), (dict(max_factor_dim=0), "max_factor_dim"),
    (dict(kfac_approx="both"), "kfac_approx"),
])
def test_bad_options_are_refused(kwargs, word):
    model, gen = _mlp([3, 2], 0), seeded(0)
    X, y = _batches("ce", [4], 3, 2, gen)[0]
    with pytest.raises((CurvatureError, TypeError), match=word):
        KFAC(model, nn.CrossEntropyLoss(), (X, y), **kwargs)


def test_bad_data_is_refused():
    model, gen = _mlp([3, 2], 0), seeded(0)
    data = _batches("ce", [4, 2], 3, 2, gen)
    with pytest.raises(CurvatureError, match="no batches"):
        KFAC(model, nn.CrossEntropyLoss(), [])
    with pytest.raises(CurvatureError, match="several batches"):
        KFAC(model, lambda out, y: nn.functional.cross_entropy(out, y), data, fisher_type="exact")
    with pytest.raises(TypeError, match="one-pass"):
        KFAC(model, nn.CrossEntropyLoss(), iter(data))
    with pytest.raises(CurvatureError, match="heuristic"):
        EKFAC(model, nn.CrossEntropyLoss(), data).inverse(0.1, heuristic=True)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("kfac_approx", ["expand", "reduce"])
def test_conv_against_curvlinops(reduction, kfac_approx):
    """A Conv2d network with Eschenhagen et al.'s ``kfac_approx``, one batch and a loader of two:
    KFAC and EKFAC (``"exact"``) equal curvlinops' (``type-2``). Enough samples that the conv's
    ``A [8, 8]`` is non-singular: in a degenerate eigenspace the eigenbasis is arbitrary, and
    EKFAC with it (for ``"reduce"``, whose individual gradients leave the span of ``A``)."""
    curvlinops = pytest.importorskip("curvlinops")
    torch.manual_seed(0)
    model, gen = nn.Sequential(nn.Conv2d(2, 3, 2), nn.Tanh(), nn.Flatten(), nn.Linear(27, 2)).to(DT), seeded(0)
    data = [(torch.randn(n, 2, 4, 4, dtype=DT, generator=gen), torch.randint(0, 2, (n,), generator=gen)) for n in (10, 9)]
    lossfn = nn.CrossEntropyLoss(reduction=reduction)
    for batches in (data[:1], data):
        for mine, theirs in [(KFAC, curvlinops.KFACLinearOperator), (EKFAC, curvlinops.EKFACLinearOperator)]:
            got = mine(model, lossfn, batches, fisher_type="exact", kfac_approx=kfac_approx).to_dense()
            op = theirs(model, lossfn, list(model.parameters()), batches, fisher_type="type-2",
                        kfac_approx=kfac_approx, check_deterministic=False)
            want = op @ torch.eye(got.shape[0], dtype=DT)
            assert ((got - want).norm() / want.norm()) < 1e-6, (mine.__name__, len(batches))


@pytest.mark.parametrize("fisher_type", ["exact", "empirical"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_ekfac_eigenvalues_do_not_depend_on_the_correction_slices(fisher_type, reduction):
    """``correction_batch_size``: the eigenvalue pass one slice of samples per call, every slice
    weighted by its normaliser: the same ``Λ*`` as on the loader's batches."""
    gen = seeded(31)
    model = _mlp([3, 4, 2], 31)
    data = _batches("ce", [5, 3], 3, 2, gen)
    lossfn = _lossfn("ce", reduction)
    whole = EKFAC(model, lossfn, data, fisher_type=fisher_type)
    for size in (1, 2):
        sliced = EKFAC(model, lossfn, data, fisher_type=fisher_type, correction_batch_size=size)
        for name, lam in whole.eigenvalues.items():
            torch.testing.assert_close(sliced.eigenvalues[name], lam, rtol=1e-10, atol=1e-14)
    with pytest.raises(CurvatureError, match="batch_size=0"):
        EKFAC(model, lossfn, data, correction_batch_size=0)


@pytest.mark.parametrize("max_factor_dim", [None, 16])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_a_loader_combines_transposed_weights_by_their_root_factor(max_factor_dim, reduction):
    """transformers' ``Conv1D`` stores its weight ``[in, out]``: factors ``[A, B]``, the root last,
    which only the model's sites tell (not the shapes; with ``max_factor_dim`` a diagonal side
    either way). Over a loader of unequal batches the factors are one batch's of all samples:
    ``"sum"`` adds the root factors and averages the input factors, so a side mistaken for the
    other is off by the batches' shares."""
    pytest.importorskip("transformers")
    model, lossfn = tiny_gpt2(20, seed=0), nn.CrossEntropyLoss(reduction=reduction)
    gen = seeded(37)
    X, y = torch.randint(0, 20, (6, 5), generator=gen), torch.randint(0, 20, (6, 5), generator=gen)
    y[4:, 3:] = -100  # ignored targets: the batches' normalisers are not their sizes' shares
    one = KFAC(model, lossfn, (X, y), fisher_type="exact", max_factor_dim=max_factor_dim)
    two = KFAC(model, lossfn, [(X[:2], y[:2]), (X[2:], y[2:])], fisher_type="exact", max_factor_dim=max_factor_dim)
    assert any(f[0].shape[0] == 8 and f[1].shape[0] == 32 for n, f in one.factors.items() if "c_fc" in n)
    for name, factors in one.factors.items():
        for a, b in zip(factors, two.factors[name]):
            torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("fisher_type", ["exact", "mc", "empirical"])
@pytest.mark.parametrize("ekfac", [False, True])
def test_factors_freed_once_decomposed_give_the_same_operator(fisher_type, ekfac):
    """``keep_factors=False`` (what ``influence.fit`` uses): the factors are freed once
    eigendecomposed, and the eigenbases, the eigenvalues and the operator are those of the
    default. A factor ``curvature`` returns for a weight and its bias (the output side) is one
    tensor summed over the batches and decomposed once: both blocks share it and its basis."""
    model = _mlp([3, 5, 4], 43)
    data = _batches("ce", [4, 3, 5], 3, 4, seeded(43))
    lossfn = nn.CrossEntropyLoss()
    kind = EKFAC if ekfac else KFAC
    kept = kind(model, lossfn, data, fisher_type=fisher_type, generator=seeded(44))
    freed = kind(model, lossfn, data, fisher_type=fisher_type, generator=seeded(44), keep_factors=False)
    assert freed.factors is None
    assert kept.factors["0.weight"][0] is kept.factors["0.bias"][0]
    for op in (kept, freed):
        assert op.eigen["0.weight"].q_out is op.eigen["0.bias"].q_out
    for name, eigen in kept.eigen.items():
        for field in ("q_out", "lam_out", "q_in", "lam_in"):
            torch.testing.assert_close(getattr(freed.eigen[name], field), getattr(eigen, field), rtol=0, atol=0)
        if ekfac:
            torch.testing.assert_close(freed.eigenvalues[name], kept.eigenvalues[name], rtol=0, atol=0)
    torch.testing.assert_close(freed.to_dense(), kept.to_dense(), rtol=1e-10, atol=1e-12)
    v = torch.randn(kept.shape[0], dtype=DT, generator=seeded(45))
    torch.testing.assert_close(freed.inverse(0.1) @ v, kept.inverse(0.1) @ v, rtol=1e-10, atol=1e-12)
