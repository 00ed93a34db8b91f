"""Argument checks and random draws shared by the operator algorithms.

An *operator* is anything with ``shape == (P, P)``, ``dtype``, ``device`` and ``A @ X``
for ``X`` of shape ``[P]`` or ``[P, K]``; a dense ``torch.Tensor`` is one. Every check
runs before any product with the operator and raises ``CurvatureError`` (bad
value) or ``CurvatureTypeError`` (bad type) naming the argument.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from .._core.errors import CurvatureError, CurvatureTypeError

DISTRIBUTIONS = ("rademacher", "normal")


def operator_size(A) -> int:
    """``P`` for a square operator ``A`` of shape ``(P, P)`` with a floating dtype."""
    missing = [name for name in ("shape", "dtype", "device", "__matmul__") if not hasattr(A, name)]
    if missing:
        raise CurvatureTypeError(
            f"A must be a linear operator with shape, dtype, device and `A @ X`; "
            f"{type(A).__name__} lacks {', '.join(missing)}. Pass a torch.Tensor or a curvlib operator."
        )
    shape = tuple(A.shape)
    if len(shape) != 2 or not all(isinstance(s, int) and s > 0 for s in shape) or shape[0] != shape[1]:
        raise CurvatureError(f"A must be square, of shape (P, P) with P >= 1; got shape {shape}.")
    if not (isinstance(A.dtype, torch.dtype) and A.dtype.is_floating_point):
        raise CurvatureTypeError(
            f"A.dtype must be a real floating dtype (float64, float32, ...); got {A.dtype}."
        )
    return shape[0]


def count(value, name: str, minimum: int) -> int:
    """``value`` as an int ``>= minimum``, or an error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise CurvatureTypeError(f"{name} must be an int; got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise CurvatureError(f"{name} must be at least {minimum}; got {value}.")
    return int(value)


def positive_real(value, name: str) -> float:
    """``value`` as a finite float ``> 0``, or an error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise CurvatureTypeError(f"{name} must be a real number; got {value!r} ({type(value).__name__}).")
    if not (math.isfinite(value) and value > 0):
        raise CurvatureError(f"{name} must be a finite number > 0; got {value}.")
    return float(value)


def real(value, name: str) -> float:
    """``value`` as a finite float, or an error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise CurvatureTypeError(f"{name} must be a real number; got {value!r} ({type(value).__name__}).")
    if not math.isfinite(value):
        raise CurvatureError(f"{name} must be finite; got {value}.")
    return float(value)


def choice(value, name: str, options: tuple[str, ...]) -> str:
    """``value`` if it is one of ``options``, or an error listing them."""
    if not isinstance(value, str) or value not in options:
        raise CurvatureError(f"{name} must be one of {', '.join(map(repr, options))}; got {value!r}.")
    return value


def generator_or_none(generator) -> torch.Generator | None:
    """``generator`` if it is ``None`` or a ``torch.Generator``."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise CurvatureTypeError(
            f"generator must be a torch.Generator or None; got {type(generator).__name__}."
        )
    return generator


def linear_map_or_none(value, name: str):
    """``value`` if it is ``None`` or supports ``value @ X``."""
    if value is not None and not hasattr(value, "__matmul__"):
        raise CurvatureTypeError(f"{name} must support `{name} @ X` (or be None); got {type(value).__name__}.")
    return value


def right_hand_side(b, A, size: int) -> tuple[Tensor, bool]:
    """``b`` as a block ``[P, K]`` on ``A``'s dtype and device, and whether it was ``[P]``."""
    if not isinstance(b, Tensor):
        raise CurvatureTypeError(f"b must be a torch.Tensor of shape [P] or [P, K]; got {type(b).__name__}.")
    if b.dim() not in (1, 2) or b.shape[0] != size:
        raise CurvatureError(f"b must have shape [P] or [P, K] with P = {size} (A's size); got {tuple(b.shape)}.")
    if b.dtype != A.dtype or b.device != torch.device(A.device):
        raise CurvatureTypeError(
            f"b must have A's dtype and device ({A.dtype}, {A.device}); got ({b.dtype}, {b.device})."
        )
    return (b.unsqueeze(1) if b.dim() == 1 else b), b.dim() == 1


def apply(A, X: Tensor, name: str = "A") -> Tensor:
    """``A @ X`` for a block ``X [P, K]``, checked to come back as ``[P, K]``."""
    result = A @ X
    if not isinstance(result, Tensor) or result.shape != X.shape:
        shape = tuple(result.shape) if isinstance(result, Tensor) else type(result).__name__
        raise CurvatureError(f"{name} @ X must return X's shape {tuple(X.shape)}; got {shape}.")
    return result


def draw(distribution: str, shape: tuple[int, ...], generator, dtype, device) -> Tensor:
    """Test vectors with i.i.d. Rademacher (±1) or standard normal entries.

    Drawn on the generator's device (torch refuses a generator of another device),
    then moved to ``device``.
    """
    where = generator.device if generator is not None else torch.device(device)
    if distribution == "rademacher":
        bits = torch.randint(0, 2, shape, generator=generator, device=where)
        vectors = (2 * bits - 1).to(dtype)
    else:
        vectors = torch.randn(shape, generator=generator, dtype=dtype, device=where)
    return vectors.to(device)


def breakdown_threshold(scale: Tensor | float, dtype: torch.dtype) -> Tensor | float:
    """Below this norm a new Krylov direction is rounding noise of a vector of norm ``scale``.

    Full reorthogonalisation leaves noise of order ``ε ‖A v‖ √m``; ``10³ ε`` covers
    Krylov dimensions far beyond the ones used here.
    """
    return 1e3 * torch.finfo(dtype).eps * scale


def default_tolerance(dtype: torch.dtype) -> float:
    """``√ε`` of ``dtype``: 1.5e-8 for float64, 3.5e-4 for float32."""
    return torch.finfo(dtype).eps ** 0.5
