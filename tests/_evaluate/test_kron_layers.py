"""Kronecker factors of the layers beyond Linear/Conv (layouts: ``curvlib._core.kronlayout``).

Oracles, float64, from the definitions:

* normalisations' scale and shift (and 1-D parameters of generic modules): ``[F]`` with
  ``F`` the exact GGN block ``Σ_n J_nᵀ H_n J_n`` from full Jacobians (KFLR), the
  empirical-Fisher block ``Σ_n g_n g_nᵀ`` from per-sample gradients (KFACEmpirical), and
  KFAC's ``F`` equal to ``Σ S Sᵀ`` of ``SqrtGGNMC`` drawn from the same generator state;
* Embedding: ``A`` token counts (padding left out) counted by hand, ``B`` from output
  offsets ``δ`` at the non-padding positions (``Σ_n J_{n,Σδ}ᵀ H_n J_{n,Σδ}``;
  ``"expand"``: ``Σ_{n,p} J_{n,δ_p}ᵀ H_n J_{n,δ_p}``);
* grouped convolutions: the diagonal blocks per group of the offset-Jacobian ``B`` and of
  ``A`` from the unfolded input (``tests/oracles/kron.py``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import jacrev

from curvlib import CurvatureError, curvature
from curvlib.extensions import KFAC, KFACEmpirical, KFLR, KFRA, SqrtGGNMC

from oracles.first_order import individual_gradients
from oracles.second_order import ggn_block, loss_hessian_blocks
from oracles.kron import input_factors, output_factors
from oracles.on_device import seeded

DT = torch.float64
LOSSES = {"ce": nn.CrossEntropyLoss, "mse": nn.MSELoss}
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")


def _targets(loss: str, n: int, c: int, seed: int):
    g = seeded(seed)
    return torch.randint(0, c, (n,), generator=g) if loss == "ce" else torch.randn(n, c, generator=g, dtype=DT)


def _close(a, b, what=""):
    scale = max(float(b.abs().max()), 1e-12)
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10 * scale, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------- normalisations


def _norm_model(kind: str, c: int, spatial: int, groups: int):
    if kind == "layernorm":
        norm, shape = nn.LayerNorm((c, spatial)), (c, spatial)
    elif kind == "groupnorm":  # (at least 2 values per group: torch refuses 1)
        norm, shape = nn.GroupNorm(groups, c * groups), (c * groups, max(spatial, 2))
    else:
        norm, shape = nn.BatchNorm1d(c), (c, spatial)
        norm.running_mean.normal_()
        norm.running_var.uniform_(0.5, 2.0)
    features = shape[0] * shape[1]
    model = nn.Sequential(nn.Tanh(), norm, nn.Sigmoid(), nn.Flatten(), nn.Linear(features, 3))
    return model.to(DT).eval(), shape


@settings(max_examples=12)
@given(
    kind=st.sampled_from(["layernorm", "groupnorm", "batchnorm"]),
    c=st.integers(1, 3), spatial=st.integers(1, 3), groups=st.integers(1, 2), n=st.integers(1, 4),
    loss=st.sampled_from(sorted(LOSSES)), reduction=st.sampled_from(["mean", "sum"]),
    approx=st.sampled_from([None, "expand", "reduce"]), seed=st.integers(0, 2**16),
)
def test_normalisation_exact_blocks(kind, c, spatial, groups, n, loss, reduction, approx, seed):
    """KFLR: the exact GGN block; KFACEmpirical: the empirical Fisher block (any ``kfac_approx``)."""
    torch.manual_seed(seed)
    model, shape = _norm_model(kind, c, spatial, groups)
    X = torch.randn((n,) + shape, dtype=DT)
    y = _targets(loss, n, 3, seed)
    lossfn = LOSSES[loss](reduction=reduction)
    got = curvature(model, lossfn, [KFLR(kfac_approx=approx), KFACEmpirical(kfac_approx=approx)])(X, y)
    grads = individual_gradients(model, lossfn, X, y, ["1.weight", "1.bias"])
    for name in ("1.weight", "1.bias"):
        (F,) = got["kflr"][name]
        _close(F, ggn_block(model, lossfn, X, y, name), f"kflr {name}")
        g = grads[name].reshape(n, -1)
        (E,) = got["kfac_empirical"][name]
        _close(E, g.T @ g, f"kfac_empirical {name}")


def test_kfac_exact_block_is_the_sampled_square_root():
    """KFAC's block of a 1-D parameter is ``Σ S Sᵀ`` of the Monte-Carlo root (same draws),
    and converges to KFLR's."""
    torch.manual_seed(0)
    model, shape = _norm_model("layernorm", 2, 3, 1)
    X, y = torch.randn((4,) + shape, dtype=DT), _targets("ce", 4, 3, 0)
    lossfn = nn.CrossEntropyLoss()
    for m in (1, 3):
        kfac = curvature(model, lossfn, [KFAC(mc_samples=m, generator=seeded(5))])(X, y)
        sqrt = curvature(model, lossfn, [SqrtGGNMC(mc_samples=m, generator=seeded(5))])(X, y)
        for name in ("1.weight", "1.bias"):
            S = sqrt["sqrt_ggn_mc"][name].reshape(-1, 6)
            _close(kfac["kfac"][name][0], S.T @ S, name)
    exact = curvature(model, lossfn, [KFLR()])(X, y)["kflr"]["1.weight"][0]
    mc = curvature(model, lossfn, [KFAC(mc_samples=4000, generator=seeded(1))])(X, y)
    assert (mc["kfac"]["1.weight"][0] - exact).norm() < 0.08 * exact.norm()


class Scaled(nn.Module):
    """A module curvlib's generic rule handles, with a 1-D and a 2-D parameter."""

    def __init__(self, d: int):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(d))
        self.mix = nn.Parameter(torch.randn(d, d))

    def forward(self, x):
        return torch.tanh(x * self.scale) @ self.mix


def test_generic_one_dimensional_parameter_gets_exact_block():
    torch.manual_seed(0)
    model = nn.Sequential(Scaled(3), nn.Linear(3, 2)).to(DT)
    X, y = torch.randn(4, 3, dtype=DT), _targets("ce", 4, 2, 0)
    lossfn = nn.CrossEntropyLoss()
    got = curvature(model, lossfn, [KFLR()])(X, y)["kflr"]
    _close(got["0.scale"][0], ggn_block(model, lossfn, X, y, "0.scale"))
    # a 2-D one that is not bias-like: the diagonal of its exact block (tests/rules/test_kron_fixed_rows.py)
    _close(got["0.mix"][0], ggn_block(model, lossfn, X, y, "0.mix").diagonal())


# ------------------------------------------------------------------------ Embedding


class Tokens(nn.Module):
    def __init__(self, v: int, d: int, padding_idx, sequence: bool = True):
        super().__init__()
        self.emb = nn.Embedding(v, d, padding_idx=padding_idx)
        self.out = nn.Linear(d, 3)
        self.sequence = sequence

    def forward(self, idx):
        h = torch.tanh(self.emb(idx))
        return self.out(h.mean(1) if self.sequence else h)


def embedding_factors(model, lossfn, X, y):
    """``(A_none, A_expand, B_none, B_expand)`` of ``model.emb`` from the definitions."""
    emb = model.emb
    idx = X.reshape(X.shape[0], -1)
    n, positions = idx.shape
    keep = torch.ones_like(idx, dtype=DT) if emb.padding_idx is None else (idx != emb.padding_idx).to(DT)
    counts = torch.zeros(emb.num_embeddings, dtype=DT)
    for i in range(n):
        for p in range(positions):
            counts[idx[i, p]] += keep[i, p]
    state = {}

    def hook(module, args, out):  # an offset δ [N, P, D] at the non-padding positions
        return out if "delta" not in state else out + (state["delta"] * keep[..., None]).reshape(out.shape)

    handle = emb.register_forward_hook(hook)
    try:
        with torch.no_grad():
            out = model(X)

        def f(delta):
            state["delta"] = delta
            return model(X)

        J = jacrev(f)(torch.zeros(n, positions, emb.embedding_dim, dtype=DT))
    finally:
        handle.remove()
    J = J.reshape(n, -1, n, positions, emb.embedding_dim)
    Jn = torch.stack([J[i, :, i] for i in range(n)])  # [N, C, P, D]
    H = loss_hessian_blocks(lossfn, out, y)
    B_expand = torch.einsum("ncpd,nce,nepq->dq", Jn, H, Jn)
    s = Jn.sum(2)
    return counts / n, counts / (n * positions), torch.einsum("ncd,nce,neq->dq", s, H, s), B_expand


@settings(max_examples=15)
@given(
    v=st.integers(2, 7), d=st.integers(1, 3), n=st.integers(1, 4), positions=st.sampled_from([0, 1, 3]),
    pad=st.sampled_from([None, 0, 1]), loss=st.sampled_from(sorted(LOSSES)),
    reduction=st.sampled_from(["mean", "sum"]), approx=st.sampled_from([None, "expand", "reduce"]),
    seed=st.integers(0, 2**16),
)
def test_embedding_factors(v, d, n, positions, pad, loss, reduction, approx, seed):
    """``[A [V], B [D, D]]``: the 1-D input factor (token frequencies) first, as ``W [V, D]`` is row-major."""
    torch.manual_seed(seed)
    model = Tokens(v, d, pad, sequence=positions > 0).to(DT)
    shape = (n,) if positions == 0 else (n, positions)
    X = torch.randint(0, v, shape, generator=seeded(seed))
    y = _targets(loss, n, 3, seed)
    lossfn = LOSSES[loss](reduction=reduction)
    call = curvature(model, lossfn, [KFLR(kfac_approx=approx)])
    if approx == "reduce" and positions:
        with pytest.raises(CurvatureError, match=r"kfac_approx='reduce'.*'emb\.weight'.*dense V x V"):
            call(X, y)
        return
    A, B = call(X, y)["kflr"]["emb.weight"]
    A_none, A_expand, B_none, B_expand = embedding_factors(model, lossfn, X, y)
    assert A.shape == (v,) and B.shape == (d, d)
    _close(A, A_expand if approx == "expand" else A_none, "A")
    _close(B, B_expand if approx == "expand" else B_none, "B")
    if pad is not None:
        assert A[pad] == 0


def test_embedding_kfac_and_empirical():
    """KFAC converges to KFLR (A exactly); KFACEmpirical's ``B`` from the per-sample output gradients."""
    torch.manual_seed(0)
    model = Tokens(5, 2, 1).to(DT)
    X, y = torch.randint(0, 5, (4, 3)), _targets("ce", 4, 3, 0)
    lossfn = nn.CrossEntropyLoss()
    exact = curvature(model, lossfn, [KFLR()])(X, y)["kflr"]["emb.weight"]
    mc = curvature(model, lossfn, [KFAC(mc_samples=4000, generator=seeded(0))])(X, y)
    mc = mc["kfac"]["emb.weight"]
    _close(mc[0], exact[0])
    assert (mc[1] - exact[1]).norm() < 0.08 * exact[1].norm()
    # empirical: B = Σ_n s_n s_nᵀ with s_n = Σ_p ∂ℓ_n/∂y_{n,p} (non-padding positions) = the
    # per-sample gradient's rows summed over the tokens, as W's gradient is Σ_p e_idx s_pᵀ
    A, B = curvature(model, lossfn, [KFACEmpirical()])(X, y)["kfac_empirical"]["emb.weight"]
    g = individual_gradients(model, lossfn, X, y, ["emb.weight"])["emb.weight"]  # [N, V, D]
    s = g.sum(1)
    _close(B, s.T @ s)
    _close(A, exact[0])


# --------------------------------------------------------------- grouped convolutions


@settings(max_examples=15)
@given(
    d=st.sampled_from([1, 2]), groups=st.integers(2, 3), c_in=st.integers(1, 2), c_out=st.integers(1, 2),
    k=st.integers(1, 2), stride=st.integers(1, 2), padding=st.integers(0, 1), n=st.integers(1, 3),
    bias=st.booleans(), loss=st.sampled_from(sorted(LOSSES)),
    approx=st.sampled_from([None, "expand", "reduce"]), seed=st.integers(0, 2**16),
)
def test_grouped_conv_factors_per_group(d, groups, c_in, c_out, k, stride, padding, n, bias, loss, approx, seed):
    """Weight ``[B [G, o, o], A [G, a, a]]``: the diagonal blocks per group of the ungrouped
    definitions; bias ``[B]`` full."""
    torch.manual_seed(seed)
    conv = (nn.Conv1d if d == 1 else nn.Conv2d)(c_in * groups, c_out * groups, k, stride=stride,
                                                padding=padding, groups=groups, bias=bias)
    shape = (n, c_in * groups) + (3,) * d
    with torch.no_grad():
        flat = conv(torch.zeros(shape)).numel() // n
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(flat, 3)).to(DT)
    X, y = torch.randn(shape, dtype=DT), _targets(loss, n, 3, seed)
    lossfn = LOSSES[loss](reduction="sum")
    got = curvature(model, lossfn, [KFLR(kfac_approx=approx)])(X, y)["kflr"]
    B_expand, B_reduce = output_factors(model, lossfn, X, y, "0")
    A_none, A_expand, A_reduce = input_factors(model, X, "0")
    B = B_expand if approx == "expand" else B_reduce
    A = {None: A_none, "expand": A_expand, "reduce": A_reduce}[approx]
    Bw, Aw = got["0.weight"]
    o, a = c_out, c_in * k**d
    assert Bw.shape == (groups, o, o) and Aw.shape == (groups, a, a)
    for g in range(groups):
        _close(Bw[g], B[g * o:(g + 1) * o, g * o:(g + 1) * o], f"B[{g}]")
        _close(Aw[g], A[g * a:(g + 1) * a, g * a:(g + 1) * a], f"A[{g}]")
    if bias:
        _close(got["0.bias"][0], B, "bias")


@settings(max_examples=10, deadline=None)
@given(
    groups=st.integers(2, 3), c_in=st.integers(1, 2), c_out=st.integers(1, 2), k=st.integers(1, 2),
    stride=st.integers(1, 2), padding=st.integers(0, 1), n=st.integers(1, 3), bias=st.booleans(),
    loss=st.sampled_from(sorted(LOSSES)), approx=st.sampled_from([None, "expand", "reduce"]),
    seed=st.integers(0, 2**16),
)
def test_grouped_conv_transpose_factors_per_group(groups, c_in, c_out, k, stride, padding, n, bias, loss, approx,
                                                  seed):
    """As grouped convolutions: weight ``[C_in, C_out/G, *k]``, ``[B [G, o, o], A [G, a, a]]`` the
    diagonal blocks per group of the ungrouped definitions (``A``'s rows ``(g, c, k)``); bias ``[B]``."""
    torch.manual_seed(seed)
    conv = nn.ConvTranspose2d(c_in * groups, c_out * groups, k, stride=stride, padding=padding, groups=groups,
                              bias=bias)
    shape = (n, c_in * groups, 3, 3)
    with torch.no_grad():
        flat = conv(torch.zeros(shape)).numel() // n
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(flat, 3)).to(DT)
    X, y = torch.randn(shape, dtype=DT), _targets(loss, n, 3, seed)
    lossfn = LOSSES[loss](reduction="sum")
    got = curvature(model, lossfn, [KFLR(kfac_approx=approx)])(X, y)["kflr"]
    B_expand, B_reduce = output_factors(model, lossfn, X, y, "0")
    A_none, A_expand, A_reduce = input_factors(model, X, "0")
    B = B_expand if approx == "expand" else B_reduce
    A = {None: A_none, "expand": A_expand, "reduce": A_reduce}[approx]
    Bw, Aw = got["0.weight"]
    o, a = c_out, c_in * k**2
    assert Bw.shape == (groups, o, o) and Aw.shape == (groups, a, a)
    for g in range(groups):
        _close(Bw[g], B[g * o:(g + 1) * o, g * o:(g + 1) * o], f"B[{g}]")
        _close(Aw[g], A[g * a:(g + 1) * a, g * a:(g + 1) * a], f"A[{g}]")
    if bias:
        _close(got["0.bias"][0], B, "bias")


def test_kfra_keeps_refusing_new_layers():
    torch.manual_seed(0)
    model = Tokens(5, 2, None).to(DT)
    X, y = torch.randint(0, 5, (4, 3)), _targets("ce", 4, 3, 0)
    with pytest.raises(CurvatureError, match=r"KFRA is not supported for module 'emb'.*supported families: "
                       r"linear, conv, conv_transpose"):
        curvature(model, nn.CrossEntropyLoss(), [KFRA()])(X, y)


# --------------------------------------------------------------- aggregation of layouts


class Mixed(nn.Module):
    """Every new layout at once: Embedding, LayerNorm, grouped Conv, GroupNorm, BatchNorm, a
    bias-like position parameter and a generic 2-D one."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(6, 4, padding_idx=0)
        self.ln = nn.LayerNorm(4)
        self.conv = nn.Conv1d(4, 4, 2, groups=2)
        self.gn = nn.GroupNorm(2, 4)
        self.bn = nn.BatchNorm1d(4)
        self.out = nn.Linear(8, 3)
        self.pos = nn.Parameter(torch.randn(3, 4))  # bias-like: Embedding's layout at fixed rows
        self.mix = nn.Parameter(torch.randn(4, 4))  # generic 2-D: the diagonal block

    def forward(self, idx):
        h = self.ln(self.emb(idx) + self.pos) @ self.mix
        h = h.transpose(1, 2)  # [N, 4, T]
        h = self.bn(torch.tanh(self.gn(self.conv(h))))
        return self.out(h.flatten(1))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_new_layouts_combine_over_chunks_and_slices(reduction):
    """Column chunks and batch slices give the whole batch's factors: the root factor summed
    (rescaled like the loss), the input factors (Embedding's 1-D ``A``, per-group ``A``) averaged."""
    torch.manual_seed(0)
    model = Mixed().to(DT).eval()
    X, y = torch.randint(0, 6, (5, 3)), _targets("ce", 5, 3, 0)
    X[0, 1] = 0
    lossfn = nn.CrossEntropyLoss(reduction=reduction)
    exts = [KFLR(), KFACEmpirical(kfac_approx="expand")]
    whole = curvature(model, lossfn, exts)(X, y)
    assert [f.dim() for f in whole["kflr"]["emb.weight"]] == [1, 2]
    assert [f.dim() for f in whole["kflr"]["conv.weight"]] == [3, 3]
    assert [f.dim() for f in whole["kflr"]["pos"]] == [1, 2] and [f.dim() for f in whole["kflr"]["mix"]] == [1]
    for kw in ({"chunk_size": 1}, {"batch_chunk_size": 2}, {"chunk_size": 2, "batch_chunk_size": 3}):
        parts = curvature(model, lossfn, exts, **kw)(X, y)
        for ext in exts:
            for name, factors in whole[ext.name].items():
                assert len(parts[ext.name][name]) == len(factors)
                for a, b in zip(parts[ext.name][name], factors):
                    _close(a, b, f"{kw} {ext.name} {name}")
