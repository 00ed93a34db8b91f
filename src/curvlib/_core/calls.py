"""One argument of a call as it was made, by position or by keyword (``forward(input)``
called as ``m(x)`` or ``m(input=x)``; a graph node's ``args``/``kwargs``). No curvlib imports."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

__all__ = ["argument"]

_REQUIRED = object()


def argument(args: Sequence, kwargs: Mapping[str, Any], index: int, name: str, default: Any = _REQUIRED):
    """The argument at position ``index`` named ``name``: ``args[index]`` if that many were
    passed by position, else ``kwargs[name]``; ``default`` where given and ``name`` was not
    passed (a ``KeyError`` without one)."""
    if len(args) > index:
        return args[index]
    if default is _REQUIRED:
        return kwargs[name]
    return kwargs.get(name, default)
