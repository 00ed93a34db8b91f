"""Pair regions (``curvlib._hessian.pairs``, ``curvlib._hessian.pointwise.PairRegion``): an
element-wise function of two tensors of one shape, a gated MLP's ``act(a) ⊙ b``, recorded as one
residual with a ``2 × 2`` block per entry.

The weighted eigen-columns and the smooth polarised ones against the per-sample ``torch.func``
Hessian of ``g · φ(a, b)`` (float64, hypothesis over ``φ``, shapes and the batch dim); end to end,
DiagHessian and BatchDiagHessian of gated MLPs (silu, gelu, tanh-approximated gelu, one written
out in primitives; ``gate``/``up`` apart or one Linear chunked; the batch in a later dim; ``a``,
``b`` or the activation also used elsewhere) against float64 ``torch.func`` Hessians, and which
regions the plan fuses: none where the activation is used elsewhere, and a pair whose inputs
broadcast is split back into its nodes by the planning pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.func import hessian

from curvlib._core.site import Residual
from curvlib._hessian.algebra import factor
from curvlib._hessian.pairs import pair_blocks, pair_weighted
from curvlib._hessian.pointwise import PairRegion
from curvlib._hessian.residuals import residual_plan
from curvlib._plan.plan import make_plan
from curvlib._plan.traces import trace
from curvlib import curvature
from curvlib._trace.program import trace_program
from curvlib.extensions import DiagHessian

from oracles.cases import DT
from oracles.checks import check_close, check_hessian_diagonals, check_hessian_family
from oracles.on_device import seeded
from oracles.second_order import hessian_block


def _gelu_written(x):
    return 0.5 * x * (1 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))


ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
               "written": _gelu_written}
# φ(a, b): gated products (φ_bb = 0) and functions with φ_bb ≠ 0 (blocks of any signs)
PHIS = {**{f"{k}*b": (lambda act: lambda a, b: act(a) * b)(act) for k, act in ACTIVATIONS.items()},
        "tanh(a)*b^2": lambda a, b: torch.tanh(a) * b * b, "a/(1+b^2)": lambda a, b: a / (1 + b * b),
        "sin(a)+a*cos(b)": lambda a, b: torch.sin(a) + a * torch.cos(b)}


def _signed_sum(sets, n: int, dim: int) -> torch.Tensor:
    """``Σ_c w_cn c_n c_nᵀ`` per sample ``[N, 2E, 2E]`` over ``(a, b)`` (``E`` entries per sample)."""
    total = 0
    for w, taps, _ in sets:
        v = taps[0].shape[0]
        c = torch.cat([taps[j][0:v].movedim(dim + 1, 1).reshape(v, n, -1) for j in (0, 1)], -1)  # [V, N, 2E]
        w = w if isinstance(w, torch.Tensor) else torch.full(c.shape[:2], w, dtype=c.dtype)
        total = total + torch.einsum("vn,vnd,vne->nde", w, c, c)
    return total


def _brute(phi, a, b, g, dim: int) -> torch.Tensor:
    """Per sample ``∇²_{(a, b)} (g · φ(a, b))`` ``[N, 2E, 2E]``."""
    a, b, g = (t.movedim(dim, 0) for t in (a, b, g))
    e = a[0].numel()

    def contracted(u, g_n):
        return (g_n * phi(u[:e].reshape(a.shape[1:]), u[e:].reshape(a.shape[1:]))).sum()

    return torch.stack([hessian(contracted)(torch.cat([a[k].flatten(), b[k].flatten()]), g[k])
                        for k in range(a.shape[0])])


@settings(max_examples=30, deadline=None)
@given(phi=st.sampled_from(sorted(PHIS)), n=st.integers(1, 3), t=st.integers(1, 3), f=st.integers(1, 4),
       dim=st.sampled_from([0, 1]), smooth=st.booleans(), seed=st.integers(0, 2**16))
def test_pair_columns_are_the_residual(phi, n, t, f, dim, smooth, seed):
    """The weighted eigen-columns (two sets, one sign each for a gated product) and the smooth
    polarised columns both sum to the per-sample Hessian of ``g · φ(a, b)``."""
    gen = seeded(seed)
    shape = (n, t, f) if dim == 0 else (t, n, f)
    a, b, g = (torch.randn(shape, generator=gen, dtype=DT) for _ in range(3))
    res = Residual("z", "pair", PHIS[phi], [a, b], taps=[0, 1], in_dims=(dim, dim), out_dim=dim)
    sets = factor(res, g) if smooth else pair_weighted(res, pair_blocks(res, g))
    assert len(sets) == (4 if smooth else 2) and all(s[1][0].shape[0] == t * f for s in sets)
    if phi.endswith("*b") and not smooth:  # det R ≤ 0: a positive and a negative set
        assert sorted(s[0] for s in sets) == [-1.0, 1.0]
    check_close(_signed_sum(sets, n, dim), _brute(PHIS[phi], a, b, g, dim), f"{phi}: Σ w c cᵀ")


class Gated(nn.Module):
    """``tanh(Linear) -> down(act(gate(h)) * up(h))`` on ``[N, T, D]``, summed over tokens.

    ``chunk``: ``gate`` and ``up`` one Linear chunked (GLM-4); ``late``: the batch in dim 1;
    ``shared``: ``"a"``, ``"b"`` or ``"act"`` also read by a second Linear; ``narrow``: ``up``
    has one output, broadcast over the activation's; ``first``: ``b`` of the first token alone."""

    def __init__(self, act: str, f: int = 3, chunk=False, late=False, shared=None, narrow=False, swap=False,
                 first=False):
        super().__init__()
        self.act, self.chunk, self.late, self.shared, self.swap = ACTIVATIONS[act], chunk, late, shared, swap
        self.first = first
        self.inp, self.down = nn.Linear(3, 3), nn.Linear(f, 2)
        if chunk:
            self.gate_up = nn.Linear(3, 2 * f)
        else:
            self.gate, self.up = nn.Linear(3, f), nn.Linear(3, 1 if narrow else f)
        if shared is not None:
            self.side = nn.Linear(1 if narrow and shared == "b" else f, 2)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = h.transpose(0, 1) if self.late else h
        a, b = self.gate_up(h).chunk(2, dim=-1) if self.chunk else (self.gate(h), self.up(h))
        b = b[:, :1] if self.first else b  # (the first token's: broadcast over tokens unless there is one)
        act = self.act(a)
        out = self.down(b * act if self.swap else act * b)
        if self.shared is not None:
            out = out + self.side({"a": a, "b": b, "act": act}[self.shared])
        return (out.transpose(0, 1) if self.late else out).sum(1)


def _data(n: int, seed: int):
    gen = seeded(seed)
    return torch.randn(n, 2, 3, generator=gen, dtype=DT), torch.randint(0, 2, (n,), generator=gen)


@settings(max_examples=14, deadline=None)
@given(act=st.sampled_from(sorted(ACTIVATIONS)), f=st.integers(1, 4), chunk=st.booleans(), late=st.booleans(),
       shared=st.sampled_from([None, "a", "b", "act"]), swap=st.booleans(), n=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_hessian_diagonals_through_a_gated_mlp(act, f, chunk, late, shared, swap, n, seed):
    """Exact, and the gate's product is one pair region unless the activation is used elsewhere
    (then nothing fuses: its value is needed outside)."""
    torch.manual_seed(seed)
    model = Gated(act, f, chunk=chunk, late=late, shared=shared, swap=swap).to(DT)
    pairs = [phi for kind, phi, _ in residual_plan(trace_program(model, None)).values() if kind == "pair"]
    assert len(pairs) == (0 if shared == "act" else 1)
    check_hessian_diagonals(model, nn.CrossEntropyLoss(), *_data(n, seed))


def test_hessian_family_through_a_gated_mlp():
    """HMP, GGNMP and PCHMP (per node) alongside the fused diagonals."""
    torch.manual_seed(3)
    model = Gated("silu").to(DT)
    check_hessian_family(model, nn.CrossEntropyLoss(), *_data(3, 3), exact_pchmp=False)


def test_a_pair_that_broadcasts_is_split_back():
    """``act(a) [N, T, F] * b [N, T, 1]`` fuses by the graph alone; the planning pass sees the
    shapes and puts the nodes' own residuals back (the product's is the structured broadcast),
    and the diagonals stay exact."""
    torch.manual_seed(4)
    model = Gated("silu", narrow=True).to(DT)
    X, y = _data(3, 4)
    traced = trace(model, [DiagHessian()], X, real_input=True)
    assert sum(isinstance(phi, PairRegion) for _, phi, _ in traced.residual_nodes.values()) == 1
    values = {k: p.detach() for k, p in model.named_parameters()}
    make_plan(traced.program, X, values, frozenset(values), traced.residual_nodes)
    assert sorted(kind for kind, _, _ in traced.residual_nodes.values()) == ["diag", "diag", "product"]  # (tanh, silu, ⊙)
    check_hessian_diagonals(model, nn.CrossEntropyLoss(), X, y)


def test_a_pair_split_by_a_later_input_replans_the_earlier_ones():
    """``act(a) * b[:, :1]`` has one shape for one token and broadcasts for two: the call on two
    tokens splits the region, and the call on one token after it is planned again (exact)."""
    torch.manual_seed(5)
    model = Gated("gelu", first=True).to(DT)
    f = curvature(model, nn.CrossEntropyLoss(), [DiagHessian()])
    for t in (1, 2, 1):
        X = torch.randn(3, t, 3, generator=seeded(t), dtype=DT)
        y = torch.tensor([0, 1, 1])
        got = f(X, y)["diag_h"]
        for name, p in model.named_parameters():
            H = hessian_block(model, nn.CrossEntropyLoss(), X, y, name)
            check_close(got[name], H.diagonal().reshape(p.shape), f"T={t}: diag_h[{name}]")
