"""PCHMP on shared modules and on opaque layers, against explicit dense oracles (float64).

Definition (``docs/conventions.md``, PCHMP): the block of parameter ``p`` is the
Hessian's chain recursion of ``L`` as a function of ``p`` alone, every node's
residual modified. Per node ``z = f(θ, x)`` and sample ``n``, ``u_p`` holds what
moves with ``p``: the node's inputs ``x``, and ``p`` itself where it is one of
the node's own parameters and some input depends on it (a later use of a shared
module); the node's other parameters are constants. Then

    PCH_p = Σ_n J_nᵀ mod(∇²ℓ_n) J_n + Σ_nodes Σ_n (∂u_p/∂p)ᵀ mod(R_n|u_p) (∂u_p/∂p).

Consequences checked here:

* a parameter of a module that is not shared gets BackPACK's chain recursion
  ``M_in = J_xᵀ M_out J_x + mod(R_xx)`` (a Linear's ``R_xx = 0``), whatever
  module is shared after (or before) it: :func:`chain_recursion_blocks`, the
  recursion written out per sample with dense ``M``;
* a shared Linear's weight ``W`` gets, at each use whose input depends on ``W``,
  the joint ``mod`` of ``R = [[0, Gᵀ⊗I], [G⊗I, 0]]`` over ``(W, x)``, pulled back
  by ``(I, ∂x/∂W)``: the sum over its uses with their cross terms
  (:func:`explicit_blocks`, residuals written by hand);
* an opaque (untraced) layer is one node whose ``u_p`` is ``(p, its float inputs)``;
  a parameter none of its inputs depends on keeps only its own block
  ``∇²_p (g_n · f_n)`` (its couplings with the inputs enter no diagonal block).
  Integer inputs (token ids) are sample ``n``'s rows in ``f_n``
  (:func:`explicit_opaque_blocks`; and the graph oracle with the layer as a leaf).

Every case also checks ``2·PCH(clip) − PCH(abs) = H`` (autograd's Hessian blocks);
the opaque layers' Hessian diagonals (DiagHessian, BatchDiagHessian: the same
residuals, as signed columns) are checked against autograd too.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Sequence

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import Tensor, nn
from torch.autograd.functional import hessian, jacobian

from curvlib import curvature
from curvlib._core.settings import override
from curvlib.extensions import BatchDiagHessian, DiagHessian
from oracles.first_order import functional_call
from oracles.checks import curvlib_blocks
from oracles.pchmp import assert_blocks_close, hessian_blocks_autograd, mod, pchmp_blocks
from oracles.second_order import loss_hessian_blocks
from oracles.on_device import seeded

DT = torch.float64
PHI = {"tanh": torch.tanh, "sigmoid": torch.sigmoid}


def _d2(act: str, x: Tensor) -> Tensor:
    """``φ''(x)`` by hand (tanh: ``−2t(1−t²)``, sigmoid: ``s(1−s)(1−2s)``)."""
    t = PHI[act](x)
    return -2 * t * (1 - t * t) if act == "tanh" else t * (1 - t) * (1 - 2 * t)


def _d1(act: str, x: Tensor) -> Tensor:
    t = PHI[act](x)
    return 1 - t * t if act == "tanh" else t * (1 - t)


# ----------------------------------------------------------------------------- chains with shared Linears


class Chain(nn.Module):
    """``steps``: Linear module names (a name used twice is one shared module) or activations."""

    def __init__(self, steps: Sequence[str], d: int, c: int):
        super().__init__()
        self.steps = list(steps)
        names = [s for s in steps if s not in PHI]
        last = max(k for k, s in enumerate(steps) if s not in PHI)
        for name in dict.fromkeys(names):
            out = c if (name == steps[last] and names.count(name) == 1) else d
            self.add_module(name, nn.Linear(d, out))

    def forward(self, x: Tensor) -> Tensor:
        for s in self.steps:
            x = PHI[s](x) if s in PHI else getattr(self, s)(x)
        return x


def _trace(model: Chain, params: Dict[str, Tensor], X: Tensor, offsets=None):
    """``(out, inputs)``: the output and every step's input, with ``params``; ``offsets``
    added to the steps' outputs (for ``g_k = ∂L/∂z_k``)."""
    xs, x = [], X
    for k, s in enumerate(model.steps):
        xs.append(x)
        x = PHI[s](x) if s in PHI else nn.functional.linear(x, params[f"{s}.weight"], params[f"{s}.bias"])
        if offsets is not None:
            x = x + offsets[k]
    return x, xs


def _node_grads(model: Chain, params, X, lossfn, y) -> List[Tensor]:
    with torch.no_grad():
        _, xs = _trace(model, params, X)
        outs = xs[1:] + [_trace(model, params, X)[0]]
    offsets = [torch.zeros_like(o, requires_grad=True) for o in outs]
    out, _ = _trace(model, params, X, offsets)
    return list(torch.autograd.grad(lossfn(out, y), offsets))


def _jacobians(model: Chain, params, X, name: str):
    """``∂out/∂p [N, C, P]`` and per step ``∂x_k/∂p [N, d_k, P]`` (samples independent)."""
    def values(t):
        out, xs = _trace(model, {**params, name: t}, X)
        return (out,) + tuple(xs)

    P, n = params[name].numel(), X.shape[0]
    jac = jacobian(values, params[name])
    return [j.reshape(n, -1, P) for j in jac]


def _linear_residual(x: Tensor, g: Tensor) -> Tensor:
    """Per sample ``R [N, O·I + I, O·I + I]`` of ``g · (W x)`` over ``(W, x)``:
    ``∂²/∂W_oi ∂x_j = g_o δ_ij``, no ``W W`` or ``x x`` term."""
    n, i = x.shape
    o = g.shape[1]
    C = torch.einsum("no,ij->noij", g, torch.eye(i, dtype=DT)).reshape(n, o * i, i)
    R = x.new_zeros(n, o * i + i, o * i + i)
    R[:, : o * i, o * i:] = C
    R[:, o * i:, : o * i] = C.transpose(1, 2)
    return R


def explicit_blocks(model: Chain, lossfn, X, y, modify) -> Dict[str, Tensor]:
    """``{name: [P, P]}`` by the definition, with every residual written by hand."""
    params = {k: p.detach() for k, p in model.named_parameters()}
    out = _trace(model, params, X)[0]
    H = mod(loss_hessian_blocks(lossfn, out, y), modify)
    grads, (_, xs) = _node_grads(model, params, X, lossfn, y), _trace(model, params, X)
    blocks = {}
    for name in params:
        module, role = name.split(".")
        P = params[name].numel()
        J_out, *J_x = _jacobians(model, params, X, name)
        total = torch.einsum("ncp,ncd,ndq->pq", J_out, H, J_out)
        for k, s in enumerate(model.steps):
            if s in PHI:  # R = diag(φ''(x) g) over x
                M = mod(torch.diag_embed(_d2(s, xs[k]) * grads[k]), modify)
                total = total + torch.einsum("ndp,nde,neq->pq", J_x[k], M, J_x[k])
            elif s == module and role == "weight" and module in model.steps[:k]:
                # a later use of p's own Linear: u_p = (W, x), R joint; (the bias: R|(b, x) = 0;
                # a first use: u_p = (W) alone, R_WW = 0; another Linear: R|x = 0)
                Ju = torch.cat([torch.eye(P, dtype=DT).expand(X.shape[0], P, P), J_x[k]], 1)
                M = mod(_linear_residual(xs[k], grads[k]), modify)
                total = total + torch.einsum("ndp,nde,neq->pq", Ju, M, Ju)
        blocks[name] = total
    return blocks


def chain_recursion_blocks(model: Chain, lossfn, X, y, modify) -> Dict[str, Tensor]:
    """Blocks of the parameters of Linears used once, by BackPACK's backward recursion
    ``M ← J_xᵀ M J_x + mod(R_xx)`` per sample (dense ``M``), from ``M = mod(∇²ℓ_n)``."""
    params = {k: p.detach() for k, p in model.named_parameters()}
    out, xs = _trace(model, params, X)
    M = mod(loss_hessian_blocks(lossfn, out, y), modify)  # [N, C, C]
    grads, blocks = _node_grads(model, params, X, lossfn, y), {}
    for k in reversed(range(len(model.steps))):
        s, x = model.steps[k], xs[k]
        if s in PHI:
            D = _d1(s, x)
            M = D[:, :, None] * M * D[:, None, :] + mod(torch.diag_embed(_d2(s, x) * grads[k]), modify)
            continue
        W = params[f"{s}.weight"]
        if model.steps.count(s) == 1:
            o, i = W.shape
            Jw = torch.einsum("ab,nj->nabj", torch.eye(o, dtype=DT), x).reshape(x.shape[0], o, o * i)  # ∂z/∂W
            blocks[f"{s}.weight"] = torch.einsum("nap,nab,nbq->pq", Jw, M, Jw)
            blocks[f"{s}.bias"] = M.sum(0)
        M = W.t() @ M @ W
    return blocks


CHAINS = {
    "issue": ["a", "tanh", "sh", "sigmoid", "sh", "b"],
    "shared_first": ["sh", "tanh", "sh", "sigmoid", "b"],
    "shared_last": ["a", "sigmoid", "sh", "tanh", "sh"],
    "apart": ["sh", "tanh", "a", "sigmoid", "sh", "b"],
    "thrice": ["a", "tanh", "sh", "sigmoid", "sh", "tanh", "sh", "b"],
    "two_tied": ["s1", "tanh", "s2", "sigmoid", "s1", "tanh", "s2", "b"],
}


def _chain_case(chain: str, n: int, d: int, loss: str, seed: int):
    gen = seeded(seed)
    model = Chain(CHAINS[chain], d, 2).to(DT)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=DT))
    X = torch.randn(n, d, generator=gen, dtype=DT)
    with torch.no_grad():
        out = model(X)
    if loss == "ce":
        return model, nn.CrossEntropyLoss(), X, torch.randint(0, out.shape[1], (n,), generator=gen)
    return model, nn.MSELoss(reduction="sum"), X, torch.randn(out.shape, generator=gen, dtype=DT)


def assert_identity(clip: Dict[str, Tensor], absolute: Dict[str, Tensor], H: Dict[str, Tensor]) -> None:
    """``2·PCH(clip) − PCH(abs) = H``: per eigenvalue ``2 max(λ, 0) − |λ| = λ``."""
    assert_blocks_close({k: 2 * clip[k] - absolute[k] for k in H}, H, "2·clip − abs vs Hessian")


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_explicit_oracle_without_modification_is_the_hessian(chain):
    """The hand-written decomposition loses nothing: unmodified, it is ``∇²_p L``; and it
    agrees with the chain recursion on the modules used once."""
    model, lossfn, X, y = _chain_case(chain, 3, 3, "ce", 0)
    H = hessian_blocks_autograd(model, lossfn, X, y)
    assert_blocks_close(explicit_blocks(model, lossfn, X, y, None), H, "explicit, unmodified")
    for modify in ("clip", "abs"):
        rec, full = chain_recursion_blocks(model, lossfn, X, y, modify), explicit_blocks(model, lossfn, X, y, modify)
        assert_blocks_close(rec, {k: full[k] for k in rec}, f"recursion vs explicit ({modify})")


@settings(max_examples=6)
@given(chain=st.sampled_from(sorted(CHAINS)), n=st.integers(1, 3), d=st.integers(2, 3),
       loss=st.sampled_from(["mse", "ce"]), seed=st.integers(0, 2**16))
def test_shared_linear_every_block(chain, n, d, loss, seed):
    """Every block, shared or not, against the explicit oracle (both modifications);
    the blocks of modules used once also against the plain chain recursion (a later
    module's sharing does not change them); the identity against the Hessian."""
    model, lossfn, X, y = _chain_case(chain, n, d, loss, seed)
    got = {m: curvlib_blocks(model, lossfn, X, y, m) for m in ("clip", "abs")}
    for modify in ("clip", "abs"):
        assert_blocks_close(got[modify], explicit_blocks(model, lossfn, X, y, modify), f"explicit ({modify})")
        rec = chain_recursion_blocks(model, lossfn, X, y, modify)
        assert_blocks_close({k: got[modify][k] for k in rec}, rec, f"chain recursion ({modify})")
    assert_identity(got["clip"], got["abs"], hessian_blocks_autograd(model, lossfn, X, y))


def test_issue_model_first_linear_is_the_chain_recursion():
    """The issue's model ``Linear → Tanh → sh → Sigmoid → sh → Linear``: ``a``'s block is the
    one of the same model with ``sh`` replaced by two copies (the recursion does not see
    the tie), and differs from what a joint ``mod`` over the later use's ``(W, x)`` gives."""
    model, lossfn, X, y = _chain_case("issue", 3, 3, "mse", 5)
    untied = Chain(["a", "tanh", "sh", "sigmoid", "sh2", "b"], 3, 2).to(DT)
    untied.load_state_dict({**model.state_dict(), "sh2.weight": model.sh.weight, "sh2.bias": model.sh.bias})
    for modify in ("clip", "abs"):
        tied, twin = curvlib_blocks(model, lossfn, X, y, modify), curvlib_blocks(untied, lossfn, X, y, modify)
        assert_blocks_close({k: tied[k] for k in ("a.weight", "a.bias", "b.weight", "b.bias")},
                            {k: twin[k] for k in ("a.weight", "a.bias", "b.weight", "b.bias")}, f"tied vs copies ({modify})")


def test_graph_oracle_agrees_with_explicit_oracle():
    """The graph-walking oracle (``oracles.pchmp``) follows the same definition."""
    for chain in ("issue", "two_tied"):
        model, lossfn, X, y = _chain_case(chain, 2, 2, "mse", 1)
        for modify in ("clip", "abs"):
            assert_blocks_close(pchmp_blocks(model, lossfn, X, y, modify), explicit_blocks(model, lossfn, X, y, modify),
                                f"{chain}: graph oracle vs explicit ({modify})")


# ----------------------------------------------------------------------------- opaque layers


class Opaque(nn.Module):
    """``lin(tanh(emb(ids) [+ h])).mean(1)``: untraceable (an assertion on its input's rank).

    ``kind``: ``"ids"`` (integer input), ``"float"`` (``emb`` a Linear on ``[N, T, D]``),
    ``"both"`` (a float input ``h`` depending on traced parameters, and the ids)."""

    def __init__(self, kind: str, v: int = 5, d: int = 3):
        super().__init__()
        self.kind = kind
        self.emb = nn.Linear(2, d) if kind == "float" else nn.Embedding(v, d)
        self.lin = nn.Linear(d, d)

    def forward(self, x: Tensor, ids: Tensor = None) -> Tensor:
        assert x.dim() == (3 if self.kind != "ids" else 2)
        e = self.emb(x) if self.kind != "both" else x + self.emb(ids)
        return self.lin(torch.tanh(e)).mean(1)


class OpaqueNet(nn.Module):
    """The opaque layer on the model's input (or, ``"both"``, on a traced embedding and the
    ids), then an optional traced head ``Linear(σ(·))``."""

    def __init__(self, kind: str, head: bool):
        super().__init__()
        self.kind = kind
        self.pre = nn.Embedding(5, 3) if kind == "both" else None
        self.op = Opaque(kind)
        self.head = nn.Linear(3, 2) if head else None

    def forward(self, x: Tensor) -> Tensor:
        h = self.op(torch.tanh(self.pre(x)), x) if self.kind == "both" else self.op(x)
        return self.head(torch.sigmoid(h)) if self.head is not None else h


def _opaque_case(kind: str, head: bool, n: int, t: int, seed: int):
    gen = seeded(seed)
    model = OpaqueNet(kind, head).to(DT)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=DT))
    X = torch.randn(n, t, 2, generator=gen, dtype=DT) if kind == "float" else torch.randint(0, 5, (n, t), generator=gen)
    y = torch.randint(0, 3 if not head else 2, (n,), generator=gen)
    return model, nn.CrossEntropyLoss(), X, y


def explicit_opaque_blocks(model: OpaqueNet, lossfn, X, y, modify) -> Dict[str, Tensor]:
    """``{name: [P, P]}`` for ``op(ids)`` (kind ``"ids"``) followed by the optional head:
    per sample ``n``, the opaque node's ``mod(∇²_p (g_n · op(p; ids_n)))`` (no float input:
    ``u_p = (p)``), the sigmoid's ``mod(diag(σ'' g))`` and the loss's ``mod(∇²ℓ_n)``."""
    params = {k: p.detach() for k, p in model.named_parameters()}
    out = functional_call(model, params, (X,))
    H = mod(loss_hessian_blocks(lossfn, out, y), modify)
    with torch.no_grad():
        h = functional_call(model.op, {k[3:]: v for k, v in params.items() if k.startswith("op.")}, (X,))
    h0 = h.clone().requires_grad_(True)
    g_h, = torch.autograd.grad(lossfn(model.head(torch.sigmoid(h0)) if model.head else h0, y), h0)
    blocks = {}
    for name, p0 in params.items():
        P = p0.numel()
        J = jacobian(lambda t: functional_call(model, {**params, name: t}, (X,)), p0).reshape(X.shape[0], -1, P)
        total = torch.einsum("ncp,ncd,ndq->pq", J, H, J)
        if name.startswith("op."):
            role, op_params = name[3:], {k[3:]: v for k, v in params.items() if k.startswith("op.")}
            for i in range(X.shape[0]):  # sample i alone: its ids, its gradient
                R = hessian(lambda t: (functional_call(model.op, {**op_params, role: t}, (X[i:i + 1],)) * g_h[i]).sum(), p0)
                total = total + mod(R.reshape(P, P), modify)
            if model.head is not None:  # the sigmoid between: its residual over h
                Jh = jacobian(lambda t: functional_call(model.op, {**op_params, role: t}, (X,)), p0).reshape(X.shape[0], -1, P)
                s0 = torch.sigmoid(h).requires_grad_(True)
                g_s, = torch.autograd.grad(lossfn(model.head(s0), y), s0)  # ∂L/∂σ(h)
                M = mod(torch.diag_embed(_d2("sigmoid", h) * g_s), modify)
                total = total + torch.einsum("ndp,nde,neq->pq", Jh, M, Jh)
        blocks[name] = total
    return blocks


def _quiet_blocks(model, lossfn, X, y, modify):
    """PCHMP's blocks with the opaque layer as one graph node, as the oracle defines them (PCHMP
    depends on the graph's nodes): the ATen front end, which traces inside it, is switched off."""
    with warnings.catch_warnings(), override(aten_front_end=False):
        warnings.simplefilter("ignore")  # "torch.fx could not trace ..."
        return curvlib_blocks(model, lossfn, X, y, modify)


@settings(max_examples=6)
@given(kind=st.sampled_from(["ids", "float", "both"]), head=st.booleans(), n=st.integers(1, 3),
       t=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_opaque_layer(kind, head, n, t, seed):
    """An opaque layer on integer ids, on floats, or on both: every block against the graph
    oracle with the layer as one node, and the identity against the Hessian."""
    model, lossfn, X, y = _opaque_case(kind, head, n, t, seed)
    got = {m: _quiet_blocks(model, lossfn, X, y, m) for m in ("clip", "abs")}
    for modify in ("clip", "abs"):
        assert_blocks_close(got[modify], pchmp_blocks(model, lossfn, X, y, modify, leaves=(Opaque,)),
                            f"{kind}: graph oracle ({modify})")
    assert_identity(got["clip"], got["abs"], hessian_blocks_autograd(model, lossfn, X, y))


@settings(max_examples=4)
@given(head=st.booleans(), n=st.integers(2, 3), t=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_opaque_layer_on_ids_explicit(head, n, t, seed):
    """The issue's smallest case ``lin(tanh(emb(ids))).mean(1)``: per sample, the opaque
    node's residual is over its parameters with *that sample's* ids."""
    model, lossfn, X, y = _opaque_case("ids", head, n, t, seed)
    for modify in ("clip", "abs"):
        assert_blocks_close(_quiet_blocks(model, lossfn, X, y, modify),
                            explicit_opaque_blocks(model, lossfn, X, y, modify), f"explicit ({modify})")


@settings(max_examples=4)
@given(kind=st.sampled_from(["ids", "float", "both"]), head=st.booleans(), n=st.integers(1, 3),
       t=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_opaque_layer_hessian_diagonals(kind, head, n, t, seed):
    """The same residuals' signed columns: DiagHessian and BatchDiagHessian against autograd's
    Hessians (of the batch, and of each sample alone: ``mean`` divides by ``N``), also
    where the opaque layer has no float input at all (direct columns only)."""
    model, lossfn, X, y = _opaque_case(kind, head, n, t, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qs = curvature(model, lossfn, [DiagHessian(), BatchDiagHessian()])(X, y)
    H = hessian_blocks_autograd(model, lossfn, X, y)
    diag = {k: qs["diag_h"][k].flatten() for k in H}
    assert_blocks_close(diag, {k: h.diagonal() for k, h in H.items()}, f"{kind}: diag_h")
    alone = [hessian_blocks_autograd(model, lossfn, X[i:i + 1], y[i:i + 1]) for i in range(n)]
    batch = {k: qs["diag_h_batch"][k].flatten(1) for k in H}
    assert_blocks_close(batch, {k: torch.stack([a[k].diagonal() / n for a in alone]) for k in H},
                        f"{kind}: diag_h_batch")
