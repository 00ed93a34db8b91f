"""Kronecker factors of generic parameters with ``≥ 2`` dims (``curvlib.rules.fixed_rows``).

Oracles, float64, from the definitions. A bias-like parameter ``p [R, D]`` added as
``z = h ± sel(p)`` is an embedding read at fixed rows ``r(s)``: with ``J_n [C, S, D]`` the
Jacobian of sample ``n``'s output w.r.t. an offset ``δ`` added to ``z`` (brute force,
``jacrev``) and ``H_n`` the loss Hessian,

* ``A``: ``#{s: r(s) = r}`` counted by hand (the same in every sample; ``"expand"``: ``/ S``);
* ``B``: ``Σ_n (Σ_s J_{n,s})ᵀ H_n (Σ_s J_{n,s})`` (``"expand"``: ``Σ_{n,s} J_{n,s}ᵀ H_n J_{n,s}``);
  ``KFACEmpirical``: the same with ``∂L/∂δ[n, s]`` in place of the GGN roots.

Any other ``≥ 2``-dim generic parameter: ``[F [P]]``, the diagonal of the exact GGN block
(full Jacobians) / of ``Σ_n g_n g_nᵀ`` (per-sample gradients).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import jacrev

from curvlib import CurvatureError, curvature
from curvlib.extensions import KFAC, KFACEmpirical, KFLR, SqrtGGNMC

from oracles.first_order import individual_gradients
from oracles.second_order import ggn_block, loss_hessian_blocks
from oracles.on_device import seeded

DT = torch.float64
LOSSES = {"ce": nn.CrossEntropyLoss, "mse": nn.MSELoss}


class Positions(nn.Module):
    """Token embedding plus a learned position term, written the ways people write it."""

    def __init__(self, kind: str, v: int, d: int, t: int, heads: int):
        super().__init__()
        self.kind, self.t, self.heads = kind, t, heads
        self.tok = nn.Embedding(v, d)
        rows = {"param": (t, d), "slice": (t + 2, d), "sub": (t, d), "heads": (t, d), "rows3d": (heads, t, d)}
        if kind in ("weight", "call"):
            self.pos = nn.Embedding(t + 1, d)
        else:
            self.pos = nn.Parameter(torch.randn(rows[kind]))
        self.register_buffer("spread", torch.linspace(0.5, 1.5, heads).reshape(heads, 1, 1))
        self.out = nn.Linear(d, 3)

    def pre(self, x):
        h = self.tok(x)
        return h[:, None] * self.spread if self.kind in ("heads", "rows3d") else h

    def select(self):
        if self.kind == "slice":
            return self.pos[: self.t]
        if self.kind == "weight":
            return self.pos.weight[: self.t]
        if self.kind == "call":
            return self.pos(torch.arange(self.t))
        return self.pos

    def body(self, z):
        z = torch.tanh(z)
        return self.out(z.flatten(1, -2).mean(1))

    def forward(self, x):
        h = self.pre(x)
        return self.body(h - self.select() if self.kind == "sub" else h + self.select())

    def param_name(self):
        return "pos.weight" if self.kind in ("weight", "call") else "pos"

    def rows(self):
        """``(r(s) [S], R)``: the row every position reads, by construction."""
        t, heads = self.t, self.heads
        r = {"rows3d": torch.arange(heads * t), "heads": torch.arange(t).repeat(heads)}.get(self.kind, torch.arange(t))
        return r, self.pos.weight.shape[0] if self.kind in ("weight", "call") else self.pos.shape[:-1].numel()


def fixed_rows_reference(model, lossfn, X, y, empirical=False):
    """``(A_none, A_expand, B_none, B_expand)`` from the definitions (module doc)."""
    rows, R = model.rows()
    n, S = X.shape[0], rows.numel()
    counts = torch.zeros(R, dtype=DT).index_add(0, rows, torch.ones(S, dtype=DT))  # per sample = mean over N
    z0 = (model.pre(X) - model.select() if model.kind == "sub" else model.pre(X) + model.select()).detach()
    d = z0.shape[-1]

    def f(delta):
        return model.body(z0 + delta.reshape(z0.shape))

    delta = torch.zeros(n, S, d, dtype=DT)
    if empirical:
        g = torch.func.grad(lambda dl: lossfn(f(dl), y))(delta)  # [N, S, D]: ∂L/∂δ
        s = g.sum(1)
        return counts, counts / S, s.T @ s, torch.einsum("nsd,nse->de", g, g)
    J = jacrev(f)(delta).reshape(n, -1, n, S, d)
    Jn = torch.stack([J[i, :, i] for i in range(n)])  # [N, C, S, D]
    H = loss_hessian_blocks(lossfn, f(delta).detach(), y)
    s = Jn.sum(2)
    B_none = torch.einsum("ncd,nce,neq->dq", s, H, s)
    B_expand = torch.einsum("ncsd,nce,nesq->dq", Jn, H, Jn)
    return counts, counts / S, B_none, B_expand


def _close(a, b, what=""):
    scale = max(float(b.abs().max()), 1e-12)
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10 * scale, msg=lambda m: f"{what}: {m}")


def _targets(loss, n, seed):
    g = seeded(seed)
    return torch.randint(0, 3, (n,), generator=g) if loss == "ce" else torch.randn(n, 3, generator=g, dtype=DT)


@pytest.mark.parametrize("kind", ["param", "slice", "weight", "sub", "heads", "rows3d", "call"])
@settings(max_examples=4, deadline=None)
@given(
    v=st.integers(2, 5), d=st.integers(1, 3), t=st.integers(1, 3), heads=st.integers(1, 2), n=st.integers(1, 3),
    loss=st.sampled_from(sorted(LOSSES)), reduction=st.sampled_from(["mean", "sum"]),
    approx=st.sampled_from([None, "expand"]), seed=st.integers(0, 2**16),
)
def test_position_embedding_factors(kind, v, d, t, heads, n, loss, reduction, approx, seed):
    """``[A [R], B [D, D]]`` of a learned position term: KFLR and KFACEmpirical vs the definitions."""
    torch.manual_seed(seed)
    model = Positions(kind, v, d, t, heads).to(DT)
    X = torch.randint(0, v, (n, t), generator=seeded(seed))
    y = _targets(loss, n, seed)
    lossfn = LOSSES[loss](reduction=reduction)
    name = model.param_name()
    got = curvature(model, lossfn, [KFLR(kfac_approx=approx), KFACEmpirical(kfac_approx=approx)])(X, y)
    for ext, empirical in (("kflr", False), ("kfac_empirical", True)):
        A, B = got[ext][name]
        A_none, A_expand, B_none, B_expand = fixed_rows_reference(model, lossfn, X, y, empirical)
        _close(A, A_expand if approx == "expand" else A_none, f"{ext} A")
        _close(B, B_expand if approx == "expand" else B_none, f"{ext} B")


def test_position_embedding_kfac_and_reduce():
    """KFAC: ``A`` exact, ``B`` converges to KFLR's; ``"reduce"`` refused (dense ``R x R``)."""
    torch.manual_seed(0)
    model = Positions("param", 5, 2, 3, 1).to(DT)
    X, y = torch.randint(0, 5, (4, 3)), torch.randint(0, 3, (4,))
    lossfn = nn.CrossEntropyLoss()
    exact = curvature(model, lossfn, [KFLR()])(X, y)["kflr"]["pos"]
    mc = curvature(model, lossfn, [KFAC(mc_samples=4000, generator=seeded(0))])(X, y)
    _close(mc["kfac"]["pos"][0], exact[0])
    assert (mc["kfac"]["pos"][1] - exact[1]).norm() < 0.08 * exact[1].norm()
    with pytest.raises(CurvatureError, match=r"kfac_approx='reduce'.*'pos'.*dense R x R"):
        curvature(model, lossfn, [KFLR(kfac_approx="reduce")])(X, y)


class NotBiasLike(nn.Module):
    """``≥ 2``-dim parameters that are not a plain row selection added to the activations."""

    def __init__(self, kind: str, d: int):
        super().__init__()
        self.kind = kind
        self.w = nn.Parameter(torch.randn(d, d))
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        if self.kind == "matmul":
            h = x @ self.w
        elif self.kind == "transposed":
            h = x + self.w.t()
        elif self.kind == "alpha":
            h = torch.add(x, self.w, alpha=2.0)
        else:  # "twice": used by two ops
            h = (x + self.w) * torch.tanh(x + self.w)
        return self.out(torch.tanh(h).mean(1))


@settings(max_examples=10, deadline=None)
@given(kind=st.sampled_from(["matmul", "transposed", "alpha", "twice"]), d=st.integers(1, 3), n=st.integers(1, 3),
       loss=st.sampled_from(sorted(LOSSES)), approx=st.sampled_from([None, "expand", "reduce"]),
       seed=st.integers(0, 2**16))
def test_other_parameters_get_the_diagonal_block(kind, d, n, loss, approx, seed):
    """``[F [P]]``: the exact GGN block's diagonal (KFLR), the squared gradients summed (KFACEmpirical),
    ``Σ S²`` of ``SqrtGGNMC`` drawn with the same generator (KFAC)."""
    torch.manual_seed(seed)
    d = max(d, 2) if kind == "transposed" else d  # (a 1 x 1 parameter transposed is bias-like)
    model = NotBiasLike(kind, d).to(DT)
    X, y = torch.randn(n, d, d, dtype=DT), _targets(loss, n, seed)
    lossfn = LOSSES[loss]()
    exts = [KFLR(kfac_approx=approx), KFACEmpirical(kfac_approx=approx),
            KFAC(kfac_approx=approx, mc_samples=2, generator=seeded(3))]
    got = curvature(model, lossfn, exts)(X, y)
    sqrt = curvature(model, lossfn, [SqrtGGNMC(mc_samples=2, generator=seeded(3))])(X, y)
    (F,) = got["kflr"]["w"]
    _close(F, ggn_block(model, lossfn, X, y, "w").diagonal(), "kflr")
    g = individual_gradients(model, lossfn, X, y, ["w"])["w"]
    _close(got["kfac_empirical"]["w"][0], (g**2).sum(0).reshape(-1), "empirical")
    _close(got["kfac"]["w"][0], (sqrt["sqrt_ggn_mc"]["w"] ** 2).sum((0, 1)).reshape(-1), "kfac")


class NanoPositions(nn.Module):
    """nanoGPT's and others' forms with ``T`` read off the input's shape."""

    def __init__(self, kind: str, v: int, d: int, t_max: int):
        super().__init__()
        self.kind = kind
        self.tok = nn.Embedding(v, d)
        self.wpe = nn.Embedding(t_max, d)
        self.pos = nn.Parameter(torch.randn(t_max, d))
        self.act = nn.Tanh()  # (a module: the positive-curvature oracle needs it)
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        t = x.size(1) if self.kind != "shape" else x.shape[1]
        if self.kind == "nanogpt":
            p = self.wpe(torch.arange(0, t, dtype=torch.long, device=x.device))
        elif self.kind == "weight":
            p = self.wpe.weight[:t]
        else:
            p = self.pos[:t]
        h = self.act(self.tok(x) + p)
        return self.out(h.mean(1))


@settings(max_examples=4, deadline=None)
@given(kind=st.sampled_from(["nanogpt", "weight", "shape"]), t=st.integers(1, 3), n=st.integers(1, 2),
       seed=st.integers(0, 2**16))
def test_every_extension_on_position_forms(kind, t, n, seed):
    """First order, GGN and Hessian families and products vs brute force (the position term's
    index depends on the input's shape only, or on nothing); KFLR of ``pos``/``wpe.weight`` too."""
    from oracles.reference import assert_matches, exact_extensions, reference

    torch.manual_seed(seed)
    model = NanoPositions(kind, 4, 2, 4).to(DT)
    used = {"nanogpt": "wpe.weight", "weight": "wpe.weight", "shape": "pos"}[kind]
    for name, p in model.named_parameters():  # (a parameter the forward does not use is refused)
        p.requires_grad_(name in ("tok.weight", "out.weight", used))
    X = torch.randint(0, 4, (n, t), generator=seeded(seed))
    y = torch.randint(0, 3, (n,), generator=seeded(seed + 1))
    lossfn = nn.CrossEntropyLoss()
    got = curvature(model, lossfn, exact_extensions(kflr=True))(X, y)
    assert_matches(got, reference(model, lossfn, X, y), kind)
    A, B = got["kflr"][used]
    assert A.shape == (4,) and B.shape == (2, 2)
    _close(A, (torch.arange(4) < t).to(DT))  # every row read once per sample, up to T


class Tied(nn.Module):
    """Tied input/output embeddings (GPT's ``head.weight = tok.weight``)."""

    def __init__(self, v: int, d: int):
        super().__init__()
        self.tok = nn.Embedding(v, d)
        self.pos = nn.Parameter(torch.randn(2, d))
        self.head = nn.Linear(d, v)
        self.head.weight = self.tok.weight

    def forward(self, x):
        return self.head(torch.tanh(self.tok(x) + self.pos)).transpose(1, 2)


@settings(max_examples=6, deadline=None)
@given(v=st.integers(2, 4), d=st.integers(1, 3), n=st.integers(1, 3), approx=st.sampled_from([None, "expand"]),
       seed=st.integers(0, 2**16))
def test_tied_embedding_gets_the_diagonal_block(v, d, n, approx, seed):
    """``[F [V·D]]``: the diagonal of the exact block with both uses summed (GGN: full Jacobians;
    empirical: per-sample gradients), for every ``kfac_approx``; the other parameters keep theirs."""
    torch.manual_seed(seed)
    model = Tied(v, d).to(DT)
    X = torch.randint(0, v, (n, 2), generator=seeded(seed))
    y = torch.randint(0, v, (n, 2), generator=seeded(seed + 1))
    lossfn = nn.CrossEntropyLoss()
    got = curvature(model, lossfn, [KFLR(kfac_approx=approx), KFACEmpirical(kfac_approx=approx)])(X, y)
    (F,) = got["kflr"]["tok.weight"]
    _close(F, ggn_block(model, lossfn, X, y, "tok.weight").diagonal(), "kflr")
    g = individual_gradients(model, lossfn, X, y, ["tok.weight"])["tok.weight"]
    _close(got["kfac_empirical"]["tok.weight"][0], (g**2).sum(0).reshape(-1), "empirical")
    assert [f.shape for f in got["kflr"]["pos"]] == [(2,), (d, d)]


@settings(max_examples=8, deadline=None)
@given(kind=st.sampled_from(["param", "slice", "sub", "heads", "rows3d", "call"]), t=st.integers(1, 3),
       n=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_diagonals_at_fixed_rows(kind, t, n, seed):
    """GGN and Hessian diagonals, summed and per sample, of a position table read at fixed rows,
    including rows read by several positions (``"heads"``: each row once per head), vs brute force."""
    from curvlib.extensions import BatchDiagGGNExact, BatchDiagHessian, DiagGGNExact, DiagHessian
    from oracles.reference import assert_matches, reference

    torch.manual_seed(seed)
    model = Positions(kind, 4, 2, t, 2).to(DT)
    X = torch.randint(0, 4, (n, t), generator=seeded(seed))
    y = torch.randint(0, 3, (n,), generator=seeded(seed + 1))
    lossfn = nn.CrossEntropyLoss()
    got = curvature(model, lossfn, [DiagGGNExact(), BatchDiagGGNExact(), DiagHessian(), BatchDiagHessian()])(X, y)
    assert_matches(got, reference(model, lossfn, X, y, pchmp=False), kind)
