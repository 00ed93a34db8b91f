"""Derivatives *through* curvlib's results, float64.

For every model of the list (tanh MLP, MLP with LayerNorm, small CNN,
``nn.TransformerEncoderLayer`` in eval mode mean-pooled to logits, GRU, Embedding,
ResNet block) and every extension, a scalar ``obj(params, X)`` of the result (a
fixed weighted sum; a block product applied to a fixed vector; a norm of the
Kronecker factors) is differentiated with ``torch.func.grad``, ``torch.func.jvp``
and plain ``torch.autograd.grad`` (params that require grad), and w.r.t. ``X``:

* against central finite differences of curvlib's own values (every extension,
  Monte-Carlo ones with a re-seeded generator: the draws are constants);
* for the exact quantities, against the brute force differentiated the same way:
  the same scalar of the quantity built from ``torch.func`` (``hessian``,
  ``vmap(grad)``, ``jacrev``) on a *reference* copy of the model whose LayerNorm,
  attention and GRU are written from primitives (torch 2.13's third derivative of
  ``F.layer_norm`` is wrong, and its fused attention has no forward-mode AD; the
  reference copy shares the parameter names, so ``functional_call`` swaps the same
  tensors);
* second order (``jacrev(grad(...))``) of ``batch_l2``, ``diag_ggn_exact`` and
  ``diag_h`` against the brute force's, on one parameter.

``PCHMP`` has no derivatives (eigenvalue clip/abs): it is refused before any work
under ``grad``/``jvp`` and with params/X that require grad, and still runs under
``vmap`` and plain calls.
"""

from __future__ import annotations

import copy
from typing import Callable, Dict, Tuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import Tensor, nn
from torch.func import functional_call, grad, hessian, jacrev, jvp, vmap

from curvlib import curvature
from curvlib._core.errors import CurvatureError
from curvlib.extensions import (
    GGNMP, HMP, KFAC, KFLR, KFRA, PCHMP, BatchDiagGGNExact, BatchDiagGGNMC, BatchDiagHessian, BatchGrad,
    BatchL2Grad, DiagGGNExact, DiagGGNMC, DiagHessian, SqrtGGNExact, SqrtGGNMC, SumGradSquared, Variance,
)
from oracles.on_device import seeded

DT = torch.float64
C = 3  # classes


# ----------------------------------------------------------------------------- primitive references


def _layer_norm(x: Tensor, ln: nn.LayerNorm) -> Tensor:
    c = x - x.mean(-1, keepdim=True)
    return c * torch.rsqrt((c * c).mean(-1, keepdim=True) + ln.eps) * ln.weight + ln.bias


class PrimLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` from primitives (the oracle's copy; same parameters)."""

    def forward(self, x: Tensor) -> Tensor:
        return _layer_norm(x, self)


class Pool(nn.Module):
    """``head(mean_t(body(x)))``."""

    def __init__(self, body: nn.Module, head: nn.Module):
        super().__init__()
        self.body, self.head = body, head

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x).mean(1))


class PrimEncoder(nn.TransformerEncoderLayer):
    """The post-norm, batch-first, GELU ``TransformerEncoderLayer`` from primitives (same parameters)."""

    def forward(self, x: Tensor) -> Tensor:
        att = self.self_attn
        n, t, e = x.shape
        h = att.num_heads
        q, k, v = F.linear(x, att.in_proj_weight, att.in_proj_bias).chunk(3, -1)
        split = lambda z: z.reshape(n, t, h, e // h).transpose(1, 2)  # noqa: E731
        q, k, v = split(q), split(k), split(v)
        a = torch.softmax(q @ k.transpose(-1, -2) / (e // h) ** 0.5, -1) @ v
        a = att.out_proj(a.transpose(1, 2).reshape(n, t, e))
        x = _layer_norm(x + a, self.norm1)
        return _layer_norm(x + self.linear2(F.gelu(self.linear1(x))), self.norm2)


class LastStep(nn.Module):
    """``head(gru(x)[:, -1])``."""

    def __init__(self, rnn: nn.Module, head: nn.Module):
        super().__init__()
        self.rnn, self.head = rnn, head

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.rnn(x)[0][:, -1])


class PrimGRU(nn.GRU):
    """A one-layer batch-first ``nn.GRU`` unrolled from primitives (PyTorch's gate order)."""

    def forward(self, x: Tensor):
        h = x.new_zeros(x.shape[0], self.hidden_size)
        outs = []
        for t in range(x.shape[1]):
            ar, az, an = F.linear(x[:, t], self.weight_ih_l0, self.bias_ih_l0).chunk(3, -1)
            br, bz, bn = F.linear(h, self.weight_hh_l0, self.bias_hh_l0).chunk(3, -1)
            r, z = torch.sigmoid(ar + br), torch.sigmoid(az + bz)
            h = (1 - z) * torch.tanh(an + r * bn) + z * h
            outs.append(h)
        return torch.stack(outs, 1), h


class ResBlock(nn.Module):
    """``head(flatten(x + conv2(tanh(bn(conv1(x))))))``, BatchNorm in eval mode."""

    def __init__(self, c: int, size: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.head = nn.Linear(c * size * size, C)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.flatten(x + self.conv2(torch.tanh(self.bn(self.conv1(x)))), 1))


def _prim_copy(model: nn.Module) -> nn.Module:
    """A deep copy whose LayerNorms, encoder layers and GRUs compute from primitives."""
    ref = copy.deepcopy(model)
    swap = {nn.LayerNorm: PrimLayerNorm, nn.TransformerEncoderLayer: PrimEncoder, nn.GRU: PrimGRU}
    for m in ref.modules():
        if type(m) in swap:  # same parameters and names, forward from primitives
            m.__class__ = swap[type(m)]
    return ref


# ----------------------------------------------------------------------------- models


def _build(kind: str, seed: int, n: int) -> Tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(seed)
    gen = seeded(seed)
    if kind == "mlp":
        model, X = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, C)), torch.randn(n, 4, generator=gen)
    elif kind == "layernorm":
        model = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, C))
        X = torch.randn(n, 4, generator=gen)
    elif kind == "cnn":
        model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, C))
        X = torch.randn(n, 2, 4, 4, generator=gen)
    elif kind == "transformer":
        layer = nn.TransformerEncoderLayer(4, 2, 6, dropout=0.0, activation="gelu", batch_first=True)
        model, X = Pool(layer, nn.Linear(4, C)).eval(), torch.randn(n, 2, 4, generator=gen)
    elif kind == "gru":
        model, X = LastStep(nn.GRU(3, 4, batch_first=True), nn.Linear(4, C)), torch.randn(n, 3, 3, generator=gen)
    elif kind == "embedding":
        model = Pool(nn.Sequential(nn.Embedding(7, 4), nn.Tanh()), nn.Linear(4, C))
        X = torch.randint(0, 7, (n, 3), generator=gen)
    elif kind == "resblock":
        model, X = ResBlock(2, 3), torch.randn(n, 2, 3, 3, generator=gen)
        with torch.no_grad():
            model.bn.running_mean.normal_(generator=gen)
            model.bn.running_var.uniform_(0.5, 1.5, generator=gen)
        model.eval()
    else:  # pragma: no cover
        raise ValueError(kind)
    model = model.to(DT)
    X = X.to(DT) if X.is_floating_point() else X
    return model, X, torch.randint(0, C, (n,), generator=gen)


MODELS = ["mlp", "layernorm", "cnn", "transformer", "gru", "embedding", "resblock"]
HEAVY = {"transformer", "gru"}


# ----------------------------------------------------------------------------- brute force


class Brute:
    """The exact quantities as pure functions of ``(params, X)`` on the primitive copy."""

    def __init__(self, model: nn.Module, y: Tensor):
        self.ref, self.y, self.n = _prim_copy(model), y, y.shape[0]

    def out(self, p, X):
        return functional_call(self.ref, p, (X,))

    def loss(self, p, X):
        return F.cross_entropy(self.out(p, X), self.y)

    def _sample_loss(self, p, x, t):  # ℓ_n / N: the term of the mean loss (BackPACK's scaling)
        return F.cross_entropy(self.out(p, x[None]), t[None], reduction="sum") / self.n

    def grad_batch(self, p, X):
        return vmap(grad(self._sample_loss), in_dims=(None, 0, 0))(p, X, self.y)

    def diag_h(self, p, X, k):
        flat = lambda t: self.loss({**p, k: t.reshape(p[k].shape)}, X)  # noqa: E731
        return torch.diagonal(hessian(flat)(p[k].flatten())).reshape(p[k].shape)

    def diag_h_batch(self, p, X, k):
        def one(x, t):
            return torch.diagonal(hessian(lambda v: self._sample_loss({**p, k: v.reshape(p[k].shape)}, x, t))(
                p[k].flatten())).reshape(p[k].shape)
        return vmap(one)(X, self.y)

    def hmp(self, p, X, k, v):
        return jvp(grad(lambda t: self.loss({**p, k: t}, X)), (p[k],), (v,))[1]

    def _jac_hout(self, p, X, k):
        """``J [N, C, *p]`` and the per-sample loss Hessians ``[N, C, C]`` (mean loss)."""
        J = jacrev(lambda t: self.out({**p, k: t}, X))(p[k])
        out = self.out(p, X)
        H = vmap(hessian(lambda o, t: F.cross_entropy(o[None], t[None], reduction="sum") / self.n))(out, self.y)
        return J, H

    def diag_ggn_batch(self, p, X, k):
        J, H = self._jac_hout(p, X, k)
        Jf = J.reshape(J.shape[0], C, -1)
        return torch.einsum("ncp,ncd,ndp->np", Jf, H, Jf).reshape((-1,) + tuple(p[k].shape))

    def ggn_quadratic(self, p, X, k, v):
        """``Σ_n (J_n v)ᵀ H_n (J_n v)`` (what ``Σ_{c,n} (sqrt[c,n] · v)²`` equals)."""
        J, H = self._jac_hout(p, X, k)
        jv = (J.reshape(J.shape[0], C, -1) * v.reshape(1, 1, -1)).sum(-1)
        return torch.einsum("nc,ncd,nd->", jv, H, jv)

    def ggnmp(self, p, X, k, v):
        J, H = self._jac_hout(p, X, k)
        Jf = J.reshape(J.shape[0], C, -1)
        return torch.einsum("ncp,ncd,ndq,q->p", Jf, H, Jf, v.flatten()).reshape(p[k].shape)


# ----------------------------------------------------------------------------- scalars of results


def _weights(P: Dict[str, Tensor], seed: int):
    gen = seeded(seed + 1)
    W = {k: torch.randn(v.shape, dtype=DT, generator=gen) for k, v in P.items()}
    D = {k: torch.randn(v.shape, dtype=DT, generator=gen) for k, v in P.items()}
    return W, D


def _reduce(key: str, q, W, D, n: int) -> Tensor:
    """One scalar of an extension's result (smooth in it)."""
    if key in ("hmp", "ggnmp", "pchmp"):
        return sum((q[k](D[k][None])[0] * W[k]).sum() for k in q)
    if key in ("kfac", "kflr", "kfra"):
        return sum(sum((f * f).sum() + f.sum() for f in q[k]) for k in q)
    if key == "batch_l2":
        return sum((q[k] * torch.arange(1.0, n + 1, dtype=DT)).sum() for k in q)
    if key.startswith("sqrt"):  # the root's invariant Σ (sqrt·D)² plus a root-dependent part
        return sum(((q[k] * D[k]).flatten(2).sum(-1) ** 2).sum() + (q[k].sum((0, 1)) * W[k]).sum() for k in q)
    if key.endswith("_batch"):
        return sum((q[k] * W[k] * torch.arange(1.0, n + 1, dtype=DT).reshape((-1,) + (1,) * W[k].dim())).sum()
                   for k in q)
    return sum((q[k] * W[k]).sum() for k in q)


def _brute_scalar(key: str, b: Brute, p, X, W, D) -> Tensor:
    """The same scalar of the brute-force quantity (``None`` where there is none here)."""
    n = b.n
    ramp = lambda t: torch.arange(1.0, n + 1, dtype=DT).reshape((-1,) + (1,) * (t.dim() - 1))  # noqa: E731
    if key in ("grad_batch", "batch_l2", "sum_grad_squared", "variance"):
        gb = b.grad_batch(p, X)
        if key == "grad_batch":
            return sum((gb[k] * W[k] * ramp(gb[k])).sum() for k in p)
        if key == "batch_l2":
            return sum(((gb[k] ** 2).flatten(1).sum(1) * torch.arange(1.0, n + 1, dtype=DT)).sum() for k in p)
        if key == "sum_grad_squared":
            return sum(((gb[k] ** 2).sum(0) * W[k]).sum() for k in p)
        # BackPACK: (N Σ_n g_n² − (Σ_n g_n)²) / N² with g_n the terms of the mean loss's gradient
        return sum(((n * (gb[k] ** 2).sum(0) - gb[k].sum(0) ** 2) / n**2 * W[k]).sum() for k in p)
    if key == "diag_h":
        return sum((b.diag_h(p, X, k) * W[k]).sum() for k in p)
    if key == "diag_h_batch":
        return sum((b.diag_h_batch(p, X, k) * W[k] * ramp(b.diag_h_batch(p, X, k))).sum() for k in p)
    if key == "hmp":
        return sum((b.hmp(p, X, k, D[k]) * W[k]).sum() for k in p)
    if key == "ggnmp":
        return sum((b.ggnmp(p, X, k, D[k]) * W[k]).sum() for k in p)
    if key in ("diag_ggn_exact", "diag_ggn_exact_batch"):
        total = 0.0
        for k in p:
            g = b.diag_ggn_batch(p, X, k)
            total = total + ((g.sum(0) * W[k]).sum() if key == "diag_ggn_exact" else (g * W[k] * ramp(g)).sum())
        return total
    return None


EXTENSIONS: Dict[str, Callable] = {
    "grad_batch": lambda g: BatchGrad(),
    "batch_l2": lambda g: BatchL2Grad(),
    "sum_grad_squared": lambda g: SumGradSquared(),
    "variance": lambda g: Variance(),
    "diag_ggn_exact": lambda g: DiagGGNExact(),
    "diag_ggn_exact_batch": lambda g: BatchDiagGGNExact(),
    "sqrt_ggn_exact": lambda g: SqrtGGNExact(),
    "ggnmp": lambda g: GGNMP(),
    "diag_h": lambda g: DiagHessian(),
    "diag_h_batch": lambda g: BatchDiagHessian(),
    "hmp": lambda g: HMP(),
    "kflr": lambda g: KFLR(),
    "kfra": lambda g: KFRA(),
    "kfac": lambda g: KFAC(generator=g),
    "diag_ggn_mc": lambda g: DiagGGNMC(generator=g),
    "diag_ggn_mc_batch": lambda g: BatchDiagGGNMC(generator=g),
    "sqrt_ggn_mc": lambda g: SqrtGGNMC(generator=g),
}


class Case:
    """One model, one extension: ``obj(params, X)``, a scalar of its result."""

    def __init__(self, kind: str, key: str, seed: int, n: int):
        self.model, self.X, self.y = _build(kind, seed, n)
        self.key, self.seed, self.n = key, seed, n
        self.gen = seeded(seed + 7)  # re-seeded per call: Monte-Carlo draws are constants
        self.f = curvature(self.model, nn.CrossEntropyLoss(), [EXTENSIONS[key](self.gen)])
        self.P = {k: v.detach().clone() for k, v in self.model.named_parameters()}
        self.W, self.D = _weights(self.P, seed)

    def obj(self, p, X=None) -> Tensor:
        self.gen.manual_seed(self.seed)
        q = self.f(self.X if X is None else X, self.y, params=p)[self.key]
        return _reduce(self.key, q, self.W, self.D, self.n)

    def shifted(self, h: float):
        return {k: self.P[k] + h * self.D[k] for k in self.P}


def _dot(a: Dict[str, Tensor], b: Dict[str, Tensor]) -> Tensor:
    return sum((a[k] * b[k]).sum() for k in a)


def _close(actual: Tensor, expected: Tensor, scale: float, what: str, rtol: float) -> None:
    diff = torch.as_tensor(actual - expected)
    err = diff.abs().max().item()
    show = lambda t: f"{float(t):.10g}" if torch.as_tensor(t).numel() == 1 else "tensor"  # noqa: E731
    assert err <= rtol * scale, f"{what}: {show(actual)} vs {show(expected)} (err {err:.2e}, scale {scale:.2e})"


def _param(kind):
    return pytest.param(kind, marks=pytest.mark.slow) if kind in HEAVY else kind


@pytest.mark.parametrize("key", list(EXTENSIONS))
@pytest.mark.parametrize("kind", [_param(k) for k in MODELS])
@settings(max_examples=2)
@given(seed=st.integers(0, 2**16), n=st.integers(2, 3))
def test_first_derivatives_match_finite_differences(kind, key, seed, n):
    """grad, jvp, autograd.grad (params) and grad w.r.t. X of a scalar of the result agree with
    central differences of curvlib's own values, or the call is refused (CurvatureError) both
    without and with derivatives."""
    try:
        case = Case(kind, key, seed, n)
    except CurvatureError:  # refused at curvature(...) (KFRA on a branching graph): nothing to differentiate
        return
    try:
        with torch.no_grad():
            case.obj(case.P)
    except CurvatureError:  # refused at the call (KFRA on a LayerNorm): refused alike with derivatives
        with pytest.raises(CurvatureError):
            grad(case.obj)(case.P)
        return
    h = 1e-5
    fd = ((case.obj(case.shifted(h)) - case.obj(case.shifted(-h))) / (2 * h)).item()
    g = grad(case.obj)(case.P)
    scale = max(sum((g[k] * case.D[k]).abs().sum().item() for k in g), 1e-3)
    _close(_dot(g, case.D), fd, scale, f"{kind}/{key} grad", 1e-6)
    _close(jvp(case.obj, (case.P,), (case.D,))[1], fd, scale, f"{kind}/{key} jvp", 1e-6)
    leaves = {k: v.clone().requires_grad_(True) for k, v in case.P.items()}
    ag = torch.autograd.grad(case.obj(leaves), list(leaves.values()))
    _close(_dot(dict(zip(leaves, ag)), case.D), fd, scale, f"{kind}/{key} autograd.grad", 1e-6)
    if case.X.is_floating_point():
        dx = torch.randn(case.X.shape, dtype=DT, generator=seeded(seed + 3))
        fdx = ((case.obj(case.P, case.X + h * dx) - case.obj(case.P, case.X - h * dx)) / (2 * h)).item()
        gx = grad(lambda x: case.obj(case.P, x))(case.X)
        _close((gx * dx).sum(), fdx, max((gx * dx).abs().sum().item(), 1e-3), f"{kind}/{key} grad wrt X", 1e-6)


BRUTE = ["grad_batch", "batch_l2", "sum_grad_squared", "variance", "diag_ggn_exact", "diag_ggn_exact_batch",
         "ggnmp", "diag_h", "diag_h_batch", "hmp"]


@pytest.mark.parametrize("key", BRUTE)
@pytest.mark.parametrize("kind", [_param(k) for k in MODELS])
@settings(max_examples=2)
@given(seed=st.integers(0, 2**16), n=st.integers(2, 3))
def test_first_derivatives_match_brute_force(kind, key, seed, n):
    """The value, its gradient (torch.func.grad) w.r.t. every parameter and its jvp equal the
    brute force's, differentiated the same way."""
    case = Case(kind, key, seed, n)
    brute = Brute(case.model, case.y)
    ref = lambda p: _brute_scalar(key, brute, p, case.X, case.W, case.D)  # noqa: E731
    value, expected = case.obj(case.P), ref(case.P)
    _close(value, expected, max(abs(expected.item()), 1e-3), f"{kind}/{key} value", 1e-8)
    g, ge = grad(case.obj)(case.P), grad(ref)(case.P)
    scale = max(max(t.abs().max().item() for t in ge.values()), 1e-3)
    for k in g:
        _close(g[k], ge[k], scale, f"{kind}/{key} grad[{k}]", 1e-7)
    t, te = jvp(case.obj, (case.P,), (case.D,))[1], jvp(ref, (case.P,), (case.D,))[1]
    _close(t, te, max(abs(te.item()), scale), f"{kind}/{key} jvp", 1e-7)


@pytest.mark.parametrize("key", ["batch_l2", "diag_ggn_exact", "diag_h"])
@pytest.mark.parametrize("kind", ["mlp", "layernorm", pytest.param("transformer", marks=pytest.mark.slow)])
@settings(max_examples=2)
@given(seed=st.integers(0, 2**16), n=st.integers(2, 3))
def test_second_derivatives_match_brute_force(kind, key, seed, n):
    """``jacrev(grad(scalar))`` (the Hessian of a scalar of the result) w.r.t. one small
    parameter equals the brute force's (on the LayerNorm and transformer models torch's own
    F.layer_norm gives 0.13-0.39 off here)."""
    case = Case(kind, key, seed, n)
    brute = Brute(case.model, case.y)
    name = [k for k in case.P if k.endswith("bias")][0]  # the first bias: a small block
    on = lambda fn: (lambda t: fn({**case.P, name: t}))  # noqa: E731
    H = jacrev(grad(on(case.obj)))(case.P[name])
    He = jacrev(grad(on(lambda p: _brute_scalar(key, brute, p, case.X, case.W, case.D))))(case.P[name])
    _close(H, He, max(He.abs().max().item(), 1e-3), f"{kind}/{key} hessian", 1e-7)


def test_torch_hessian_through_diag_h_on_layernorm():
    """``torch.func.hessian`` of ``trace(diag_h)`` (a sharpness regulariser's curvature) on the
    LayerNorm model equals the brute force's: curvlib does not inherit torch's wrong
    F.layer_norm derivatives."""
    case = Case("layernorm", "diag_h", 3, 2)
    brute = Brute(case.model, case.y)
    name = "1.bias"
    tr = lambda p: sum(v.sum() for v in case.f(case.X, case.y, params=p)["diag_h"].values())  # noqa: E731
    tr_ref = lambda p: sum(brute.diag_h(p, case.X, k).sum() for k in p)  # noqa: E731
    H = hessian(lambda t: tr({**case.P, name: t}))(case.P[name])
    He = hessian(lambda t: tr_ref({**case.P, name: t}))(case.P[name])
    _close(H, He, He.abs().max().item(), "hessian of trace(diag_h)", 1e-7)


# ----------------------------------------------------------------------------- PCHMP: refused


@pytest.mark.parametrize("modify", ["clip", "abs"])
def test_pchmp_refuses_derivatives(modify):
    """PCHMP's eigenvalue clip/abs has no derivative: its product, from a call under grad or
    jvp or with params or X that require grad, is refused when applied (before its work),
    naming PCHMP; vmap and plain calls still run, and the call's other results stay
    differentiable."""
    model, X, y = _build("layernorm", 0, 3)
    f = curvature(model, nn.CrossEntropyLoss(), [PCHMP(modify=modify)])
    P = {k: v.detach().clone() for k, v in model.named_parameters()}
    scalar = lambda p, x=X: sum(q(torch.ones((1,) + P[k].shape, dtype=DT)).sum()  # noqa: E731
                                for k, q in f(x, y, params=p)["pchmp"].items())
    for attempt in (lambda: grad(scalar)(P), lambda: jvp(scalar, (P,), (P,)),
                    lambda: scalar({k: v.clone().requires_grad_(True) for k, v in P.items()}),
                    lambda: scalar(P, X.clone().requires_grad_(True))):
        with pytest.raises(CurvatureError, match="PCHMP"):
            attempt()
    plain = scalar(P)
    assert torch.isfinite(plain)
    assert torch.allclose(vmap(lambda p: scalar(p), randomness="same")({k: v[None] for k, v in P.items()})[0], plain)
    # the call's other results stay differentiable: only applying the PCHMP product is refused
    both = curvature(model, nn.CrossEntropyLoss(), [PCHMP(modify=modify), DiagHessian()])
    g = grad(lambda p: sum(v.sum() for v in both(X, y, params=p)["diag_h"].values()))(P)
    assert all(torch.isfinite(v).all() for v in g.values())
    with torch.no_grad():  # under no_grad leaves that require grad are read as values
        assert torch.allclose(scalar({k: v.clone().requires_grad_(True) for k, v in P.items()}), plain)
