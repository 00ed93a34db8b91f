"""Layer normalisation (``nn.LayerNorm``), batched with an explicit ``n``.

The layer normalises each position over its trailing ``normalized_shape``
axes ``*D`` and applies an element-wise affine map:

    x̂[..., d] = (x[..., d] - mean_D(x)) / √(var_D(x) + ε),
    y[..., d] = x̂[..., d] w[d] + b[d].

Shapes: ``x [*L, *D]`` with the batch in one of the leading axes ``*L``
(anywhere, e.g. ``[N, T, D]`` or ``[T, N, D]``), ``g = ∂L/∂y`` like ``x``,
``w = weight [*D]``, ``b = bias [*D]``. The statistics are taken per leading
position, so samples never mix. With the batch moved to the front, the other
leading axes are flattened into ``s`` and ``*D`` into ``d``; the rule works on
``x̂ [n, s, d]`` and ``g [n, s, d]``.

Given ``x̂`` the site is linear in ``(w, b)``, so the individual gradients are

    ∂ℓ_n/∂w = Σ_s g[n, s] ⊙ x̂[n, s],      ∂ℓ_n/∂b = Σ_s g[n, s],

``[N, *D]`` tensors (no larger than one leading position of the input per
sample), from which every first-order quantity is read off. Because ``x̂`` is
saved, the GGN family (which pulls ``V`` vectors back to the site's output and
applies these functions per vector) needs nothing more. The Hessian family
additionally needs the normalisation's second derivative: the engine takes it
as a dense per-sample residual of the node (see :mod:`curvlib._hessian.residuals`;
over ``x``, and over ``(w, b, x)`` where ``x`` depends on them, for a module
used twice).

The forward is ``x̂ = F.layer_norm(x)`` *without* the affine map, then
``y = b + x̂ ⊙ w`` (``torch.addcmul``): one fused normalisation gives both the
output and the saved ``x̂``, and it agrees with the module to rounding (float64:
~1e-16). Under a torch.func transform (derivatives through results) ``x̂`` is
written from primitives instead (:func:`normalise`): torch 2.13's *third*
derivative of ``F.layer_norm`` is wrong. It also keeps every transform exact: in torch 2.13, ``torch.func``'s
second derivative of ``F.layer_norm`` *with* a weight is wrong in its
weight-input coupling (``torch.func.hessian`` of ``(w, x) ↦ ⟨c, LN(x; w)⟩``
differs from autograd's and from finite differences; see
``tests/rules/test_layernorm.py``), whereas the normalisation alone and the
product are exact.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._core.calls import argument
from .._core.errors import CurvatureError
from .._core.family import Family
from .._core.site import Recorder, RoleTensors, Rule, Site
from .._core.tensors import inside_transform


def _canon(site: Site, t: Tensor) -> Tensor:
    """``t [n, *L', *D]`` (batch first: the recorder's layout; the planner never finds the batch
    among the normalised axes ``*D``, which would mix samples) -> ``[n, s, d]``, ``*D`` flattened."""
    return t.reshape(t.shape[0], -1, site.meta["norm_numel"])


def _per_sample(site: Site, g: Tensor, roles: Sequence[str]) -> Tuple[RoleTensors, Tuple[int, ...]]:
    """Individual gradients flattened to ``[N, d]``, and the parameter shape ``*D``."""
    gc = _canon(site, g)
    out = {}
    if "weight" in roles:
        out["weight"] = (gc * _canon(site, site.saved["xhat"])).sum(1)
    if "bias" in roles:
        out["bias"] = gc.sum(1)
    return out, site.meta["norm_shape"]


def grad_batch(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``[N, *D]`` per role: ``Σ_s g ⊙ x̂`` and ``Σ_s g``."""
    vals, shape = _per_sample(site, g, roles)
    return {role: v.reshape((v.shape[0],) + shape) for role, v in vals.items()}


def grad(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``[*D]`` per role: the sum over the batch and the leading positions at once."""
    gc = _canon(site, g)
    shape = site.meta["norm_shape"]
    out = {}
    if "weight" in roles:
        out["weight"] = (gc * _canon(site, site.saved["xhat"])).sum((0, 1)).reshape(shape)
    if "bias" in roles:
        out["bias"] = gc.sum((0, 1)).reshape(shape)
    return out


def batch_l2(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``[N]`` per role: squared norms of the ``[N, d]`` individual gradients."""
    vals, _ = _per_sample(site, g, roles)
    return {role: (v**2).sum(1) for role, v in vals.items()}


def sum_grad_squared(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``[*D]`` per role: ``Σ_n (∂ℓ_n/∂p)²``."""
    vals, shape = _per_sample(site, g, roles)
    return {role: (v**2).sum(0).reshape(shape) for role, v in vals.items()}


def _column_gradients(site: Site, m: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``[C, N, d]`` per role: the individual gradients of every column of a root ``m [C, *out]``."""
    c = m.shape[0]
    gc = m.reshape((c, m.shape[1], -1, site.meta["norm_numel"]))  # [C, N, s, d]
    out = {}
    if "weight" in roles:
        out["weight"] = (gc * _canon(site, site.saved["xhat"])).sum(2)
    if "bias" in roles:
        out["bias"] = gc.sum(2)
    return out


def sum_squares_over_columns(site: Site, m: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``[1, *D]`` per role: ``Σ_c Σ_n (∂ℓ_n/∂p)²`` for a root ``m [C, *out]`` in one pass."""
    shape = site.meta["norm_shape"]
    return {role: (v**2).sum((0, 1)).reshape((1,) + shape) for role, v in _column_gradients(site, m, roles).items()}


def batch_sum_squares_over_columns(site: Site, m: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``[N, *D]`` per role: ``Σ_c (∂ℓ_n/∂p)²`` for a root ``m [C, *out]`` in one pass."""
    shape = site.meta["norm_shape"]
    return {role: (v**2).sum(0).reshape((v.shape[1],) + shape) for role, v in _column_gradients(site, m, roles).items()}


def weighted_squares_over_columns(site: Site, m: Tensor, roles: Sequence[str], weights: Tensor,
                                  per_sample: bool) -> RoleTensors:
    """``Σ_c w_cn (∂ℓ_n/∂p)²`` for a root ``m [C, *out]`` and weights ``[C, N]``: ``[N, *D]`` per
    role (``per_sample``), else summed over the samples, ``[*D]`` (the columns are formed anyway:
    weighting them costs what summing them does)."""
    shape = site.meta["norm_shape"]
    out = {}
    for role, v in _column_gradients(site, m, roles).items():  # [C, N, d]
        squares = (v**2 * weights.unsqueeze(-1).to(v.dtype)).sum(0)  # [N, d]
        out[role] = squares.reshape((v.shape[1],) + shape) if per_sample else squares.sum(0).reshape(shape)
    return out


LAYERNORM = Rule(
    kind="layernorm",
    grad_batch=grad_batch,
    grad=grad,
    batch_l2=batch_l2,
    sum_grad_squared=sum_grad_squared,
    sum_squares_over_columns=sum_squares_over_columns,
    batch_sum_squares_over_columns=batch_sum_squares_over_columns,
    weighted_squares_over_columns=weighted_squares_over_columns,
    any_batch_dim=True,
)


#: Whether :func:`normalise` writes ``x̂`` from primitives outside transforms too (see
#: :func:`from_primitives`).
_PRIMITIVES = contextvars.ContextVar("curvlib_layernorm_primitives", default=False)


@contextlib.contextmanager
def from_primitives(on: bool = True) -> Iterator[None]:
    """While active (``on``), :func:`normalise` uses primitives outside transforms too: for a
    forward whose graph is pulled back with many columns at once (``is_grads_batched``), where
    the fused ``layer_norm`` backward has no batching rule and runs once per column (tiny
    GPT-2's Hessian diagonal: 9720 calls of it)."""
    token = _PRIMITIVES.set(on)
    try:
        yield
    finally:
        _PRIMITIVES.reset(token)


def primitives_active() -> bool:
    """Whether :func:`from_primitives` is active."""
    return _PRIMITIVES.get()


def normalise(x: Tensor, shape: Tuple[int, ...], eps: float) -> Tensor:
    """``x̂ = (x - mean_D(x)) / √(var_D(x) + ε)`` over the trailing axes ``shape``, ``x [*L, *D]``.

    ``F.layer_norm`` (one fused kernel) outside torch.func transforms; inside one (also
    curvlib's own route when results must be differentiable), the same formula from
    primitives, for two torch 2.13 bugs: the double backward of ``layer_norm`` adds a
    vmapped tensor into an unbatched one in place, so a Hessian product under ``vmap`` over
    an ensemble's parameters or over tasks fails ("vmap: inplace arithmetic ..."); and its
    third derivative (the derivative of the double backward) is wrong: ``grad`` of a
    Hessian-vector product through it is 0.2-0.5 off finite differences
    (``tests/_transform/test_compose_derivatives.py``), the primitives are exact. The result is
    contiguous, as the kernel's is whatever the input's strides: a traced graph may rely on it
    (an ATen trace records no ``contiguous()`` where the tensor already was).
    """
    if not inside_transform() and not _PRIMITIVES.get():
        return F.layer_norm(x, shape, None, None, eps)
    x = x.contiguous()
    dims = tuple(range(x.dim() - len(shape), x.dim()))
    centred = x - x.mean(dims, keepdim=True)
    return centred * torch.rsqrt((centred * centred).mean(dims, keepdim=True) + eps)


def layer_norm(input: Tensor, normalized_shape, weight=None, bias=None, eps: float = 1e-5, *_cudnn) -> Tensor:
    """``F.layer_norm`` as :func:`normalise` and the affine map: what a graph's functional
    ``F.layer_norm`` / ``torch.layer_norm`` node runs inside torch.func transforms (the same
    values; torch's fused op fails under vmap at second order, see :func:`normalise`)."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    return _affine(normalise(input, shape, eps), weight, bias)


def _affine(xhat: Tensor, weight, bias) -> Tensor:
    """``x̂ ⊙ w + b`` with ``w``/``b`` broadcast over the leading dims (either may be ``None``)."""
    if weight is None:
        return xhat if bias is None else xhat + bias
    return xhat * weight if bias is None else torch.addcmul(bias, xhat, weight)


def forward(module: nn.LayerNorm, where: str, names: dict, tensors: dict, args, kwargs, rec: Recorder):
    """Run ``nn.LayerNorm`` functionally and record its site."""
    x = argument(args, kwargs, 0, "input")
    shape = tuple(module.normalized_shape)
    k = len(shape)
    if x.dim() < k + 1 or tuple(x.shape[x.dim() - k:]) != shape:
        raise CurvatureError(
            f"LayerNorm '{where}' (normalized_shape={list(shape)}) got an input of shape "
            f"{list(x.shape)}; it needs [*leading, {', '.join(map(str, shape))}] with the "
            "batch among the leading dims."
        )
    xhat = normalise(x, shape, module.eps)
    out = _affine(xhat, tensors.get("weight"), tensors.get("bias"))
    saved = {"xhat": xhat} if "weight" in names else {}
    numel = 1
    for s in shape:
        numel *= s
    meta = {"norm_dims": k, "norm_shape": shape, "norm_numel": numel}
    return rec.add(Site(LAYERNORM, names, where, saved=saved, meta=meta), out)


def norm_blocks(module: nn.LayerNorm) -> dict:
    """What the per-row blocks of its ``"norm"`` residual need: the normalised trailing axes."""
    return {"groups": None, "norm_dims": len(module.normalized_shape)}


#: The family's record (:class:`~curvlib._core.family.Family`), registered in :data:`curvlib.rules.FAMILIES`.
FAMILY = Family("layernorm", (nn.LayerNorm,), forward, affine_in_parameters=True, norm_residual=norm_blocks,
                exact_block=True, shared_hessian=True, row_wise=True)
