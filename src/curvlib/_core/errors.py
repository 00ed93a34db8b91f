"""The one exception family curvlib raises for bad input."""

from __future__ import annotations


class CurvatureError(ValueError):
    """Bad input to ``curvlib.curvature`` or to a function it returned.

    Every message names the offending module, parameter, tensor or argument,
    shows the bad value and says what is supported. A ``ValueError``.

    Examples::

        >>> from torch import nn
        >>> from curvlib import CurvatureError, curvature
        >>> from curvlib.extensions import BatchGrad
        >>> try:
        ...     curvature(nn.Linear(3, 2), nn.MSELoss(reduction="none"), [BatchGrad()])
        ... except CurvatureError as err:
        ...     print(type(err).__name__, isinstance(err, ValueError))
        CurvatureError True
    """


class CurvatureTypeError(CurvatureError, TypeError):
    """A ``CurvatureError`` about the *type* of an argument; also a ``TypeError``.

    Examples::

        >>> from torch import nn
        >>> from curvlib import CurvatureError, CurvatureTypeError, curvature
        >>> from curvlib.extensions import BatchGrad
        >>> try:
        ...     curvature(nn.Linear(3, 2), "mse", [BatchGrad()])
        ... except CurvatureTypeError as err:
        ...     print(isinstance(err, CurvatureError), isinstance(err, TypeError))
        True True
    """


# shown as the public names they are imported by (``curvlib.CurvatureError`` in tracebacks)
CurvatureError.__module__ = CurvatureTypeError.__module__ = "curvlib"


def missing_forward_mode(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's "no forward-mode derivative": a kernel without one
    ("forward AD"), or a custom ``autograd.Function`` without ``jvp`` ("forward mode AD")."""
    return isinstance(exc, NotImplementedError) and ("forward AD" in str(exc) or "forward mode AD" in str(exc))
