"""An internal failure as a :class:`CurvatureError` naming where in the model it happened.

A ``KeyError``, ``AssertionError``, ``AttributeError``, ``IndexError``, ``TypeError``... raised by
curvlib's own code (the innermost frame of its traceback is in the package) is a curvlib bug,
not bad input; the
user still gets a :class:`CurvatureError` saying which module and graph node (or site)
curvlib was working on, read off the frames' locals (``node``: an fx node, ``site``: a
recorded site, ``layer``/``module``: a layer), with the original exception chained. Errors
raised inside torch or the model's own code pass through as they are.
"""

from __future__ import annotations

import os
import traceback
from typing import List, Optional

from torch import fx, nn

from .._core.errors import CurvatureError

__all__ = ["internal_failure"]

# Exceptions that are programming errors when curvlib's own line raises them. A RuntimeError
# (torch's errors: vmap's randomness mode the caller chose) and a warning turned into an
# error by the caller's filters are the caller's to see as they are.
_BUGS = (AssertionError, KeyError, AttributeError, IndexError, NameError, TypeError, ZeroDivisionError)

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def internal_failure(exc: BaseException, model: nn.Module) -> Optional[CurvatureError]:
    """The :class:`CurvatureError` to raise for ``exc`` when curvlib's own code raised it, else ``None``."""
    if isinstance(exc, CurvatureError) or not isinstance(exc, _BUGS):
        return None
    frames = list(traceback.walk_tb(exc.__traceback__))
    if not frames or not os.path.abspath(frames[-1][0].f_code.co_filename).startswith(_PACKAGE):
        return None
    where = _where(frames)
    last = traceback.extract_tb(exc.__traceback__)[-1]
    return CurvatureError(
        f"curvlib failed internally on model {type(model).__name__}"
        + (f" at {'; '.join(where)}" if where else "")
        + f": {type(exc).__name__}: {exc} (at {os.path.relpath(last.filename, _PACKAGE)}:{last.lineno}). "
        "This is a bug in curvlib, not in your input: please report it with the model's class."
    )


def _where(frames) -> List[str]:
    """The innermost graph node, site and layer the failing frames were working on."""
    found = {}
    for frame, _ in reversed(frames):
        if not os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
            continue
        local = frame.f_locals
        node = local.get("node")
        if "node" not in found and isinstance(node, fx.Node):
            found["node"] = f"graph node '{node.name}' ({node.op} {getattr(node.target, '__name__', node.target)})"
        site = local.get("site")
        if "site" not in found and isinstance(getattr(site, "where", None), str):
            found["site"] = f"site {site.where}"
        layer = local.get("layer")
        if "layer" not in found and isinstance(getattr(layer, "path", None), str):
            found["layer"] = f"module '{layer.path}' ({type(layer.module).__name__})"
    return [found[k] for k in ("layer", "site", "node") if k in found]
