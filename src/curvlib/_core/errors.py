"""The one exception family curvlib raises for bad input."""

from __future__ import annotations


class CurvatureError(ValueError):
    """Bad input to :func:`curvlib.curvature` or to a function it returned.

    Every message names the offending module, parameter, tensor or argument,
    shows the bad value and says what is supported.
    """


class CurvatureTypeError(CurvatureError, TypeError):
    """A :class:`CurvatureError` about the *type* of an argument."""


def missing_forward_mode(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's "no forward-mode derivative": a kernel without one
    ("forward AD"), or a custom ``autograd.Function`` without ``jvp`` ("forward mode AD")."""
    return isinstance(exc, NotImplementedError) and ("forward AD" in str(exc) or "forward mode AD" in str(exc))
