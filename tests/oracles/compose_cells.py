"""One cell of the composition matrix: model x extension x transform.

:func:`run_cell` applies a ``torch.func`` transform (or plain autograd) to
curvlib's ``f`` and to the oracle in the same way, and raises
``AssertionError`` naming the cell and the error relative to the largest
entry of the expected result. Oracles (:func:`oracle_kind`):

* ``"brute"``: the pure brute force of :mod:`oracles.compose`, transformed
  exactly like ``f``;
* ``"self"``: curvlib's own plain (untransformed) value, correct by the rest
  of the suite: per-member calls for ``vmap``; central finite differences of it
  along a random direction for derivatives (Monte-Carlo extensions with the
  same generator seed in every call, so every evaluation draws the same).

Transforms: ``vmap_params`` (stacked members, with their buffers for models
that have some), ``vmap_task`` (a leading task dim of ``X``/``y``),
``vmap_both``, ``grad``, ``jvp``, ``jacrev``, ``hessian`` (w.r.t. one small
parameter), ``autograd`` (``torch.autograd.grad`` with ``params`` requiring
grad), ``grad_X``. The scalar of a result is a fixed random weighting of every
returned tensor (:func:`oracles.compose.canonical`: products applied to fixed
vectors, square roots as ``Σ_v S_v S_vᵀ``, every Kronecker factor).
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Dict

import torch
from torch import Tensor
from torch.func import grad, hessian, jacrev, jvp

import curvlib.extensions as E
from curvlib import CurvatureError, curvature
from curvlib.extensions import Extension

from oracles.compose import BRUTE_NAMES, brute, canonical, full_params, random_like, split, weighted_sum
from oracles.compose_models import build
from oracles.on_device import seeded

TRANSFORMS = ("vmap_params", "vmap_task", "vmap_both", "grad", "jvp", "jacrev", "hessian", "autograd", "grad_X")
# The parameter the ``hessian`` transform differentiates twice (small, early in the model).
HESSIAN_PARAM = {"mlp": "0.bias", "mlp_ln": "1.weight", "cnn": "0.bias", "transformer": "body.norm1.weight",
                 "gru": "gru.bias_hh_l0", "embedding": "emb.weight", "resnet": "conv1.bias", "bn_cnn": "1.weight"}
MC = ("DiagGGNMC", "BatchDiagGGNMC", "KFAC", "SqrtGGNMC")


# (model, extension) -> the refusal every transform must raise (the plain call refuses too).
REFUSED = {
    ("mlp_ln", "KFRA"): r"KFRA is not supported for module '1' \(layer family 'layernorm'",
    ("bn_cnn", "KFRA"): r"KFRA is not supported for module '1' \(layer family 'batchnorm'",
    ("embedding", "KFRA"): r"KFRA is not supported for module 'emb'",
    ("transformer", "KFRA"): r"KFRA needs a chain of operations",
    ("resnet", "KFRA"): r"KFRA needs a chain of operations",
    ("gru", "KFRA"): r"KFRA is not defined for the recurrent module",
}

# Monte-Carlo extensions under torch.func.hessian (jacfwd's vmap, randomness="error", no
# option to change it): torch's own refusal of a random operation inside vmap.
MC_HESSIAN = (RuntimeError, r"randomness error mode")

# PCHMP's clip/abs of eigenvalues has no derivative (kinks at zero eigenvalues): curvlib
# refuses derivatives through it when the product is applied, under every transform that
# differentiates (vmap alone is exact).
DIFFERENTIATING = ("grad", "jvp", "jacrev", "hessian", "autograd", "grad_X")
PCHMP_DERIVATIVES = (CurvatureError, r"PCHMP\(modify='clip'\) with .*is not differentiable")


def expected_refusal(model: str, cls_name: str, transform: str):
    """``(exception type, message pattern)`` the cell must raise, or None."""
    if (model, cls_name) in REFUSED:
        return CurvatureError, REFUSED[(model, cls_name)]
    if cls_name in MC and transform == "hessian":
        return MC_HESSIAN
    if cls_name == "PCHMP" and transform in DIFFERENTIATING:
        return PCHMP_DERIVATIVES
    return None


def extension_classes() -> Dict[str, type]:
    """Every concrete extension class exported by ``curvlib.extensions`` (a result name)."""
    return {k: c for k, c in vars(E).items() if isinstance(c, type) and issubclass(c, Extension) and c.name}


# A row without extension: the result's own ``grad`` (every call returns it).
NO_EXTENSION = "NoExtension"


def rows() -> list:
    """The matrix's rows: every exported extension, and the plain gradient."""
    return sorted(extension_classes()) + [NO_EXTENSION]


def make_extension(cls_name: str, generator=None) -> Extension:
    """An instance with default options (Monte-Carlo: drawing from ``generator``)."""
    cls = extension_classes()[cls_name]
    if cls_name not in MC:
        return cls()
    return cls(mc_samples=2 if cls_name == "SqrtGGNMC" else 1, generator=generator)


def oracle_kind(cls_name: str, problem) -> str:
    if cls_name == NO_EXTENSION:
        return "brute"
    name = extension_classes()[cls_name].name
    if cls_name in MC or name not in BRUTE_NAMES or (name == "pchmp" and not problem.tanh_only):
        return "self"
    return "brute"


def _call(f, X, y, params, buffers=None):
    """``f(X, y, params=...)``; members' buffers by ``buffers=`` if ``f`` has that argument,
    else as entries of ``params`` (the two spellings curvlib accepts)."""
    if buffers and "buffers" in inspect.signature(f).parameters:
        return f(X, y, params=params, buffers=buffers)
    return f(X, y, params={**params, **(buffers or {})})


class Cell:
    """Everything one cell needs, drawn from ``seed`` with ``n`` samples."""

    def __init__(self, model_name: str, cls_name: str, seed: int, n: int):
        self.problem = build(model_name, seed)
        self.model_name, self.cls_name, self.seed = model_name, cls_name, seed
        self.mc_generator = seeded(seed + 7)  # reset to this seed before every call of f
        self.ext = None if cls_name == NO_EXTENSION else make_extension(cls_name, self.mc_generator)
        self.name = "grad" if self.ext is None else self.ext.name
        self.kind = oracle_kind(cls_name, self.problem)
        self.f = curvature(self.problem.model, self.problem.lossfn, [self.ext] if self.ext else [])
        gen = seeded(seed + 1)
        self.X, self.y = self.problem.data(gen, n)
        self.params, self.buffers = split(self.problem.model, full_params(self.problem.model))
        self.vectors = {k: torch.randn((2,) + v.shape, generator=gen, dtype=v.dtype) for k, v in self.params.items()}
        self.weights = random_like(self.curv(self.params, self.X, self.y), gen)
        self.weights2 = random_like(self.weights, gen)
        self.gen = gen

    def curv(self, params, X, y, buffers=None) -> Dict[str, Tensor]:
        """curvlib's result, canonical (see module doc); Monte-Carlo extensions draw from
        their generator reset to the same seed, so every call draws the same."""
        self.mc_generator.manual_seed(self.seed + 7)
        qs = _call(self.f, X, y, params, buffers)
        return canonical(self.name, qs[self.name], self.vectors, False)

    def oracle(self, params, X, y, buffers=None) -> Dict[str, Tensor]:
        """The brute force's result, canonical (``"self"``: curvlib's plain call)."""
        if self.kind == "self":
            return self.curv(params, X, y, buffers)
        full = {**self.params, **self.buffers, **params, **(buffers or {})}
        return canonical(self.name, brute(self.name, self.problem.model, self.problem.lossfn, full, X, y),
                         self.vectors, True)

    def scalar(self, fn):
        return lambda *a: weighted_sum(fn(*a), self.weights)

    def vector(self, fn):
        return lambda *a: torch.stack([weighted_sum(fn(*a), self.weights), weighted_sum(fn(*a), self.weights2)])

    def like(self, tensors):
        return {k: torch.randn(v.shape, generator=self.gen, dtype=v.dtype) for k, v in tensors.items()}


def assert_close(got, want, what: str, rtol: float) -> None:
    """Every entry; ``max |a − e| ≤ rtol · max |e|`` over the whole result (plus 1e-12)."""
    if isinstance(want, Tensor):
        got, want = {"": got}, {"": want}
    assert set(got) == set(want), f"{what}: keys {sorted(got)} != {sorted(want)}"
    scale = max((w.abs().max().item() for w in want.values() if w.numel()), default=0.0)
    err = 0.0
    for k, w in want.items():
        g = got[k]
        assert g.shape == w.shape, f"{what}[{k}]: shape {tuple(g.shape)} != {tuple(w.shape)}"
        if w.numel():
            d = (g - w).abs().max().item()
            err = max(err, d if d == d else float("inf"))
    assert err <= 1e-12 + rtol * scale, f"{what}: max error {err:.3g} at scale {scale:.3g} (rel {err / max(scale, 1e-300):.3g})"


def _stack(dicts):
    return {k: torch.stack([d[k] for d in dicts]) for k in dicts[0]}


def _members(c: Cell, k: int = 2):
    params = [c.params] + [{n: v + 0.2 * torch.randn(v.shape, generator=c.gen, dtype=v.dtype) for n, v in c.params.items()}
                           for _ in range(k - 1)]
    if not c.buffers:
        return params, [None] * k
    bufs = [{n: (b + 0.3 * torch.rand(b.shape, generator=c.gen, dtype=b.dtype)) if b.is_floating_point() else b
             for n, b in c.buffers.items()} for _ in range(k)]
    return params, bufs


def _tasks(c: Cell, k: int = 2):
    draws = [(c.X, c.y)] + [c.problem.data(c.gen, c.X.shape[0]) for _ in range(k - 1)]
    return torch.stack([d[0] for d in draws]), torch.stack([d[1] for d in draws])


def _fd(fn, args: dict, direction: dict, eps: float = 1e-4):
    """Directional derivative of ``fn(args)`` along ``direction`` (dicts of tensors): central
    differences at ``eps`` and ``eps/2``, Richardson-extrapolated (error O(eps⁴))."""

    def central(h):
        plus = fn({k: v + h * direction.get(k, 0) for k, v in args.items()})
        minus = fn({k: v - h * direction.get(k, 0) for k, v in args.items()})
        if isinstance(plus, Tensor):
            return (plus - minus) / (2 * h)
        return {k: (plus[k] - minus[k]) / (2 * h) for k in plus}

    d1, d2 = central(eps), central(eps / 2)
    if isinstance(d1, Tensor):
        return (4 * d2 - d1) / 3
    return {k: (4 * d2[k] - d1[k]) / 3 for k in d1}


def _vmap(c: Cell, what: str, rtol: float):
    ps, bs = _members(c)
    Xs, ys = _tasks(c)
    with_bufs = bs[0] is not None
    # Monte-Carlo: every member draws what its own call draws from the same generator state.
    vmap = partial(torch.func.vmap, randomness="same" if c.cls_name in MC else "error")
    b_dim = 0 if with_bufs else None
    if what == "vmap_params":
        got = vmap(lambda p, b: c.curv(p, c.X, c.y, b), in_dims=(0, b_dim))(_stack(ps), _stack(bs) if with_bufs else None)
        want = _stack([c.oracle(p, c.X, c.y, b) for p, b in zip(ps, bs)])
    elif what == "vmap_task":
        got = vmap(lambda X, y: c.curv(c.params, X, y))(Xs, ys)
        want = _stack([c.oracle(c.params, X, y) for X, y in zip(Xs, ys)])
    else:
        got = vmap(lambda p, b, X, y: c.curv(p, X, y, b), in_dims=(0, b_dim, 0, 0))(
            _stack(ps), _stack(bs) if with_bufs else None, Xs, ys)
        want = _stack([c.oracle(p, X, y, b) for p, b, X, y in zip(ps, bs, Xs, ys)])
    assert_close(got, want, what, rtol)


def _derivative_brute(c: Cell, what: str, rtol: float):
    curv, orac = (lambda p: c.curv(p, c.X, c.y)), (lambda p: c.oracle(p, c.X, c.y))
    if what in ("grad", "autograd"):
        want = grad(c.scalar(orac))(c.params)
        got = grad(c.scalar(curv))(c.params) if what == "grad" else _autograd(c)
    elif what == "jvp":
        t = c.like(c.params)
        got, want = jvp(curv, (c.params,), (t,))[1], jvp(orac, (c.params,), (t,))[1]
    elif what == "jacrev":
        got, want = jacrev(c.vector(curv))(c.params), jacrev(c.vector(orac))(c.params)
    elif what == "hessian":
        k = HESSIAN_PARAM[c.model_name]
        got = hessian(c.scalar(lambda t: c.curv({**c.params, k: t}, c.X, c.y)))(c.params[k])
        want = hessian(c.scalar(lambda t: c.oracle({**c.params, k: t}, c.X, c.y)))(c.params[k])
    else:  # grad_X
        got = grad(c.scalar(lambda X: c.curv(c.params, X, c.y)))(c.X)
        want = grad(c.scalar(lambda X: c.oracle(c.params, X, c.y)))(c.X)
    assert_close(got, want, what, rtol)


def _autograd(c: Cell):
    leaves = {k: v.clone().requires_grad_(True) for k, v in c.params.items()}
    s = c.scalar(lambda p: c.curv(p, c.X, c.y))(leaves)
    gs = torch.autograd.grad(s, list(leaves.values()), allow_unused=True, materialize_grads=True)
    return dict(zip(leaves, gs))


def _derivative_self(c: Cell, what: str, rtol: float):
    """Directional derivatives against central differences of curvlib's plain values."""
    curv = lambda p: c.curv(p, c.X, c.y)  # noqa: E731
    v = c.like(c.params)
    if what in ("grad", "autograd"):
        g = grad(c.scalar(curv))(c.params) if what == "grad" else _autograd(c)
        got, want = sum((g[k] * v[k]).sum() for k in g), _fd(c.scalar(curv), c.params, v)
    elif what == "jvp":
        got, want = jvp(curv, (c.params,), (v,))[1], _fd(curv, c.params, v)
    elif what == "jacrev":
        J = jacrev(c.vector(curv))(c.params)
        got, want = sum((J[k] * v[k]).flatten(1).sum(1) for k in J), _fd(c.vector(curv), c.params, v)
    elif what == "hessian":
        k = HESSIAN_PARAM[c.model_name]
        s = c.scalar(lambda t: c.curv({**c.params, k: t}, c.X, c.y))
        H = hessian(s)(c.params[k])
        u, p = v[k], c.params[k]
        got = (H.reshape(u.numel(), u.numel()) @ u.flatten()) @ u.flatten()
        second = [(s(p + h * u) - 2 * s(p) + s(p - h * u)) / h**2 for h in (1e-3, 5e-4)]
        want = (4 * second[1] - second[0]) / 3  # Richardson: O(h⁴)
        rtol = max(rtol, 1e-5)
    else:  # grad_X
        s = c.scalar(lambda X: c.curv(c.params, X, c.y))
        d = torch.randn(c.X.shape, generator=c.gen, dtype=c.X.dtype)
        got, want = (grad(s)(c.X) * d).sum(), _fd(lambda a: s(a["X"]), {"X": c.X}, {"X": d})
    assert_close(got, want, what, rtol)


def run_cell(model_name: str, cls_name: str, transform: str, seed: int = 0, n: int = 2) -> None:
    """Run one cell; ``AssertionError`` (wrong), any other exception (crash), or nothing (exact)."""
    c = Cell(model_name, cls_name, seed, n)
    label = f"{model_name} x {cls_name} x {transform} (oracle: {c.kind})"
    if transform == "grad_X" and not c.problem.float_input:
        raise ValueError(f"{label}: integer inputs have no gradient")
    try:
        if transform.startswith("vmap"):
            _vmap(c, transform, 1e-7 if c.kind == "brute" else 1e-9)
        elif c.kind == "brute":
            _derivative_brute(c, transform, 1e-7)
        else:
            _derivative_self(c, transform, 1e-6)
    except AssertionError as e:
        raise AssertionError(f"{label}: {e}") from None
