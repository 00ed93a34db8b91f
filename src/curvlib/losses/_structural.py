"""Curvature of the hand-written losses: ``MSELoss``, ``CrossEntropyLoss``, ``BCEWithLogitsLoss``.

Each is a sum of per-sample terms whose Hessian w.r.t. the model output is a
*scale* times a base matrix that depends on the output alone:

    c · ∇²ℓ_n = s_n ⊙ K(f_n),

* MSE: ``K = 2 I``, ``s = c``;
* BCE: ``K = diag(σ(f)(1 − σ(f)))``; per entry ``s = c · w · (p_w y + 1 − y)``
  (``w`` the element ``weight``, ``p_w`` the ``pos_weight``; both 1 when unset);
* CE (per sample and position, over the classes): ``K = diag(p) − p pᵀ``,
  ``p = softmax(f)``, and ``s = c · κ`` with the target's weight mass

      κ = (1 − ε) w[y] + (ε / K) Σ_k w_k      (class-index targets; 0 where y = ignore_index),
      κ = Σ_k w_k q'_k,  q' = (1 − ε) q + ε/K  (class-probability targets q),

  (``w`` the class ``weight``, ``ε`` the ``label_smoothing``): the log-softmax
  has the same Hessian ``K`` whatever the target, so smoothing, weights and
  soft labels only change the scale.

``c`` is the reduction factor, ``1 / normaliser`` for ``"mean"`` (see
:func:`curvlib.losses.normaliser`) and 1 for ``"sum"``. A negative scale (a
negative weight, or BCE targets outside ``[0, 1]`` with a ``pos_weight``) makes
the term concave: its roots are then split by sign.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .._core import draws as _draws, settings
from .._core.tensors import is_concrete
from .._core.strategy import batched

__all__ = ["StructuralCurvature", "negative_scale"]


class StructuralCurvature:
    """The loss Hessian of one ``(out, y)`` for a hand-written loss (module doc).

    Args:
        spec: the loss (:class:`curvlib.losses.LossSpec`, kind ``"mse"``, ``"ce"`` or ``"bce"``).
        out: model output ``[N, *]``.
        y: targets (already checked).
        c: the reduction factor.
        negative: whether some scale is negative, when already read (see :func:`negative_scale`).
    """

    def __init__(self, spec, out: Tensor, y: Tensor, c: float, negative: Optional[bool] = None):
        self.kind, self.out, self.y = spec.kind, out, y
        self.scale = _scale(spec, out, y, c)  # float (MSE; CE counting every target alike), [N, *out[1:]] (BCE), [N, *D] (CE)
        self.signed = may_be_negative(spec, y) and (
            # unknown values (traced): split by sign; else read here unless the target check did
            (not _concrete(self.scale) or bool((self.scale < 0).any())) if negative is None else negative
        )

    # ------------------------------------------------------------------ roots
    def roots(self) -> List[Tuple[float, Tensor]]:
        """``[(sign, S [C, N, *out[1:]])]`` with ``Σ sign · S Sᵀ = c∇²ℓ`` per sample (BackPACK's columns)."""
        return [(sign, self._root(part)) for sign, part in self._signed_scales()]

    def sampled_roots(self, mc_samples: int, generator: Optional[torch.Generator]) -> List[Tuple[float, Tensor]]:
        """``[(sign, S [M, N, *out[1:]])]`` with ``E[Σ sign · S Sᵀ] = c∇²ℓ``: sampled labels' gradients."""
        base = self._sampled_base(mc_samples, generator)  # [M, N, *out[1:]], E[b bᵀ] = K
        if not self.signed:  # one root: scaled in place where nothing differentiates through it
            scale = (self.scale / mc_samples) ** 0.5 if isinstance(self.scale, float) else \
                _broadcast_scale(self, self.scale, 1).sqrt() / mc_samples**0.5
            return [(1.0, base.mul_(scale) if _writable(base) else base * scale)]
        return [(sign, base * _broadcast_scale(self, part, 1).sqrt() / mc_samples**0.5)
                for sign, part in self._signed_scales()]

    def matvec(self, mat: Tensor) -> Tensor:
        """``c∇²ℓ`` per sample: ``mat [V, N, *out[1:]]`` -> same shape."""
        return _broadcast_scale(self, self.scale, 1) * self._base_matvec(mat)

    def modified_matvec(self, mat: Tensor, modify: str) -> Tensor:
        """The loss Hessian with its eigenvalues clipped (``"clip"``) or made absolute (``"abs"``)."""
        if not self.signed:
            return self.matvec(mat)
        scale = self.scale.clamp(min=0) if modify == "clip" else self.scale.abs()
        return _broadcast_scale(self, scale, 1) * self._base_matvec(mat)

    def most_negative(self) -> Tuple[float, int]:
        """The most negative scale and its sample (for messages; ``signed`` losses only)."""
        lowest = self.scale.reshape(self.out.shape[0], -1).min(1).values
        n = int(lowest.argmin())
        return float(lowest[n]), n

    # --------------------------------------------------------------- helpers
    def _signed_scales(self):
        if not self.signed:
            return [(1.0, self.scale)]
        return [(1.0, self.scale.clamp(min=0)), (-1.0, (-self.scale).clamp(min=0))]

    def _root(self, scale) -> Tensor:
        out = self.out
        per = out[0].numel()
        if self.kind == "ce":
            return _ce_root(out, scale)
        if self.kind == "mse":
            diag = torch.full_like(out, (2.0 * scale) ** 0.5)
        else:
            s = torch.sigmoid(out)
            diag = (s * (1 - s) * scale).sqrt()
        eye = torch.eye(per, dtype=out.dtype, device=out.device)
        return eye.reshape((per, 1) + tuple(out.shape[1:])) * diag.unsqueeze(0)

    def _sampled_base(self, m: int, generator) -> Tensor:
        out = self.out
        shape = (m,) + tuple(out.shape)
        if self.kind == "mse":  # ∇ℓ of ‖f − ŷ‖², ŷ ~ N(f, ½I): √2 ε
            return _draws.randn(shape, generator, out.dtype, out.device) * 2.0**0.5
        if self.kind == "bce":  # ŷ ~ Bernoulli(σ(f)): σ(f) − ŷ
            s = torch.sigmoid(out)
            draws = _draws.bernoulli(s.detach().expand(shape).contiguous(), generator)
            return s - draws
        return _ce_sampled(out, m, generator)

    def _base_matvec(self, mat: Tensor) -> Tensor:
        if self.kind == "mse":
            return 2.0 * mat
        if self.kind == "bce":
            s = torch.sigmoid(self.out)
            return s * (1 - s) * mat
        p = torch.softmax(self.out, dim=1)
        pm = p * mat  # (diag(p) − p pᵀ) u = p ⊙ u − p (pᵀ u), subtracted in place: one output-sized temporary fewer
        return pm.sub_(p * pm.sum(2, keepdim=True))


def may_be_negative(spec, y: Tensor) -> bool:
    """Whether the options allow a negative scale (weights, ``pos_weight``, probability targets)."""
    m = spec.module
    if spec.kind == "bce":
        return m.weight is not None or m.pos_weight is not None
    return spec.kind == "ce" and (m.weight is not None or y.is_floating_point())


def negative_scale(spec, out: Tensor, y: Tensor, c) -> Optional[Tensor]:
    """Whether some entry of the scale ``s`` (module doc) is negative, as a 0-dim bool tensor
    (not read: the caller reads it with its other checks, one host sync), or ``None`` when
    the options allow no negative scale. ``out`` may be a meta tensor: only its shape and
    dtype are used; ``c`` is the reduction factor (a float or a 0-dim tensor)."""
    if not may_be_negative(spec, y):
        return None
    module = spec.module
    if spec.kind == "ce":
        return (c * target_mass(module, out, y) < 0).any()
    # BCE: c > 0 leaves the sign alone
    return (_bce_weights(module, y, torch.ones((), dtype=y.dtype, device=y.device)) < 0).any()


def _concrete(t) -> bool:
    if isinstance(t, float):
        return True
    return is_concrete(t)


def _writable(t: Tensor) -> bool:
    """A result of ours that may be overwritten: concrete, nothing differentiates through it."""
    return not t.requires_grad and _concrete(t)


def _broadcast_scale(curv: StructuralCurvature, scale, lead: int):
    """``scale`` shaped to multiply ``[*lead, N, *out[1:]]`` tensors."""
    if isinstance(scale, float):
        return torch.tensor(scale, dtype=curv.out.dtype, device=curv.out.device)
    if curv.kind == "ce":
        scale = scale.unsqueeze(1)  # [N, 1, *D]: the same for every class
    return scale.reshape((1,) * lead + tuple(scale.shape))


def _scale(spec, out: Tensor, y: Tensor, c: float):
    """``s`` of the module doc (``c`` included)."""
    module = spec.module
    if spec.kind == "mse":
        return float(c)
    if spec.kind == "bce":
        return _bce_weights(module, y, torch.full_like(out, c)).expand(out.shape)
    if module.weight is None and not module.label_smoothing and not y.is_floating_point() \
            and _concrete(y) and not batched(out.device) and not bool((y == module.ignore_index).any()):
        return float(c)  # κ = 1 everywhere: the scale of every sample and position is c
    # (under "batched", the CUDA default, whether a target is ignored is not read: a host sync)
    return c * target_mass(module, out, y)


def _bce_weights(module, y: Tensor, base: Tensor) -> Tensor:
    """``base · (p·y + 1 − y) · w``: BCE's scale with ``pos_weight`` ``p`` and ``weight`` ``w``."""
    if module.pos_weight is not None:
        base = base * (module.pos_weight * y + 1 - y)
    if module.weight is not None:
        base = base * module.weight
    return base


def target_mass(module, out: Tensor, y: Tensor) -> Tensor:
    """``κ [N, *D]`` of cross-entropy (module doc): each sample's and position's weight mass."""
    k = out.shape[1]
    eps = float(module.label_smoothing)
    w = module.weight
    if y.is_floating_point():  # class probabilities [N, K, *D]
        q = y * (1 - eps) + eps / k if eps else y
        if w is not None:
            q = q * w.reshape((1, k) + (1,) * (y.dim() - 2))
        return q.sum(1)
    counted = y != module.ignore_index
    if w is None and not eps:  # κ = 1 where counted
        return counted.to(out.dtype)
    safe = torch.where(counted, y, torch.zeros_like(y))
    kappa = (1 - eps) * (w[safe] if w is not None else torch.ones_like(safe, dtype=out.dtype))
    if eps:
        kappa = kappa + eps / k * (w.sum() if w is not None else float(k))
    return kappa * counted


def _ce_root(out: Tensor, scale) -> Tensor:
    """Column ``(a, r)``: ``√s[n, r] √p_{a,r} (e_a − p_{:,r})`` at position ``r`` (BackPACK's root)."""
    n, k = out.shape[0], out.shape[1]
    rest = out[0, 0].numel() if n else 1
    p_flat = torch.softmax(out, dim=1).reshape(n, k, rest)  # [N, K, R]
    eye_k = torch.eye(k, dtype=out.dtype, device=out.device)
    # block[a, r, n, b] = √(s[n, r] p[n, a, r]) (δ(a, b) − p[n, b, r])
    s = scale if isinstance(scale, float) else scale.reshape(n, 1, rest)
    weight = (p_flat * s).sqrt().permute(1, 2, 0)  # [K(a), R, N]
    block = weight[:, :, :, None] * (eye_k[:, None, None, :] - p_flat.permute(2, 0, 1)[None])
    eye_r = torch.eye(rest, dtype=out.dtype, device=out.device)
    S = block[..., None] * eye_r[None, :, None, None, :]  # [a, r, n, b, r']
    return S.reshape((k * rest, n) + tuple(out.shape[1:]))


def _ce_sampled(out: Tensor, m: int, generator) -> Tensor:
    """``p − onehot(ŷ)``, ``ŷ ~ Categorical(softmax(f))`` per sample and position: ``[M, N, K, *D]``.

    At a language model's ``K = V = 50257`` every ``[N, K, *D]`` tensor is the size of the
    logits, so the draw forms no other: the probabilities ``p`` (a view of ``[N·R, K]``
    rows when the classes are the innermost dim in memory, as for ``logits.transpose(1,
    2)``), their cumulative sums
    :attr:`~curvlib._core.settings.Settings.draw_entries` entries at a time, and the
    result written over ``p`` when nothing differentiates through it (else one new tensor):
    ``−1`` added at the drawn class by a scatter, no one-hot.
    """
    k = out.shape[1]
    # softmax over the last dim of the moved view: a view (no copy) when the classes are
    # innermost in memory, and a contiguous [N, *D, K] result whose rows are views
    p_rows = torch.softmax(out.movedim(1, -1), dim=-1).reshape(-1, k)  # [N·R, K]
    # Inverse-CDF sampling, ŷ = #{j : P_j ≤ u} with P the cumulative probabilities and
    # u ~ U[0, 1): a binary search per draw, several times cheaper than torch.multinomial
    # (rounding in P only shifts mass ~1e-7).
    u = _draws.rand((m, p_rows.shape[0], 1), generator, out.dtype, out.device)
    draws = _inverse_cdf(p_rows.detach(), u[..., 0])  # [M, N·R]
    minus = torch.full((1, 1, 1), -1.0, dtype=out.dtype, device=out.device).expand(m, p_rows.shape[0], 1)
    if m == 1 and _writable(p_rows):
        grads = p_rows.unsqueeze(0).scatter_add_(-1, draws.unsqueeze(-1), minus)  # over p: no copy
    else:
        grads = torch.scatter_add(p_rows.unsqueeze(0).expand(m, -1, -1), -1, draws.unsqueeze(-1), minus)
    moved = tuple(out.movedim(1, -1).shape)
    return grads.reshape((m,) + moved).movedim(-1, 2)


def _inverse_cdf(p_rows: Tensor, u: Tensor) -> Tensor:
    """``#{j : Σ_{i≤j} p[r, i] ≤ u[m, r]}`` ``[M, R]`` (clamped to ``K − 1``) for ``p_rows [R, K]``,
    ``u [M, R]``: a binary search of each row's cumulative sums,
    :attr:`~curvlib._core.settings.Settings.draw_entries` entries at a time."""
    k, rows = p_rows.shape[-1], p_rows.shape[0]
    block = max(1, settings.current().draw_entries // max(k, 1))
    parts = []
    for start in range(0, max(rows, 1), block):
        cdf = p_rows[start:start + block].cumsum(-1)  # [rows', K]
        values = u[:, start:start + block].t().contiguous()  # [rows', M]
        parts.append(torch.searchsorted(cdf, values, right=True).t())
    draws = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
    return draws.clamp(max=k - 1)
