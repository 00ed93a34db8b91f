"""The model's output as users have it: a tensor, or a ``ModelOutput``, dataclass, tuple or dict.

Hugging Face models return a ``ModelOutput`` (an ordered dict that is also a dataclass),
timm and torchvision models a tensor, user models sometimes ``(logits, aux)``. The loss
takes one tensor, chosen by ``curvature(..., output=...)``:

* ``None`` (default): the output itself when it is a tensor; else the entry named
  ``logits`` (a mapping key, dataclass field or attribute); else the first tensor in the
  output's order (pytree order: mapping insertion order, dataclass field order, tuple order);
* a string: that key / field / attribute;
* an int: that position of a tuple or list (or of a mapping's values);
* a callable: ``output(model_output) -> Tensor``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Callable, Optional, Tuple, Union

from torch import Tensor

from .errors import CurvatureError, CurvatureTypeError

__all__ = ["Selector", "check_selector", "select", "describe_choice", "say_choice"]

Selector = Union[None, str, int, Callable]


def check_selector(output: Selector) -> Selector:
    """Refuse, at ``curvature(...)``, a selector of another type."""
    if output is None or isinstance(output, (str, int)) or callable(output):
        return output
    raise CurvatureTypeError(
        f"output must be None, a name (str), a position (int) or a callable model_output -> Tensor; "
        f"got {type(output).__name__}."
    )


def _entries(out) -> list:
    """``(name, value)`` pairs of a container output, in its order (names ``None`` for sequences)."""
    if isinstance(out, Mapping):
        return list(out.items())
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [(f.name, getattr(out, f.name)) for f in dataclasses.fields(out)]
    if isinstance(out, (tuple, list)):
        return [(None, v) for v in out]
    return []


def _first_tensor(out) -> Optional[Tuple[str, Tensor]]:
    """The first tensor leaf of a (nested) output, with its path."""
    if isinstance(out, Tensor):
        return "", out
    for i, (name, value) in enumerate(_entries(out)):
        found = _first_tensor(value)
        if found is not None:
            key = f"[{name!r}]" if name is not None else f"[{i}]"
            return key + found[0], found[1]
    return None


def select(out, output: Selector = None) -> Tuple[Tensor, str]:
    """``(tensor for the loss, where it was found)``; ``where`` is ``""`` for a tensor output."""
    if callable(output) and not isinstance(output, (str, int)):
        chosen = output(out)
        if not isinstance(chosen, Tensor):
            raise CurvatureError(f"output={getattr(output, '__name__', output)!r} returned "
                                 f"{type(chosen).__name__}, not a tensor.")
        return chosen, f"output={getattr(output, '__name__', 'callable')}(...)"
    if output is None and isinstance(out, Tensor):
        return out, ""
    if isinstance(output, str) or output is None:
        name = output or "logits"
        for key, value in _entries(out):
            if key == name and isinstance(value, Tensor):
                return value, f"[{name!r}]"
        if isinstance(getattr(out, name, None), Tensor) and not isinstance(out, (tuple, list)):
            return getattr(out, name), f".{name}"
        if output is not None:
            raise _missing(out, f"no tensor entry named {name!r}")
        found = _first_tensor(out)
        if found is None:
            raise _missing(out, "no tensor in it")
        return found[1], found[0]
    values = [v for _, v in _entries(out)]
    if not -len(values) <= output < len(values) or not isinstance(values[output], Tensor):
        raise _missing(out, f"no tensor at position {output}")
    return values[output], f"[{output}]"


def _type_name(out) -> str:
    """The type the user wrote (torch.fx hands a traced dict or list back as its ``immutable_*``)."""
    kind = type(out)
    if kind.__module__.startswith("torch.fx"):
        kind = dict if isinstance(out, dict) else list if isinstance(out, list) else kind
    return kind.__name__


def describe_choice(out, where: str) -> str:
    return f"{_type_name(out)}{where}"


def say_choice(choice: str) -> None:
    """Say which tensor of a container output the loss takes (the default rule chose it)."""
    warnings.warn(
        f"The model returns a container; curvlib passes {choice} to the loss (the entry named "
        "'logits', else the first tensor). Choose another with curvature(..., output=NAME | POSITION "
        "| callable).", UserWarning, stacklevel=2)


def _missing(out, why: str) -> CurvatureError:
    names = [k if k is not None else f"[{i}]" for i, (k, _) in enumerate(_entries(out))]
    listing = f" (entries: {', '.join(map(str, names))})" if names else ""
    return CurvatureError(
        f"The model returned {_type_name(out)}{listing}: {why}. Choose the tensor the loss takes "
        "with curvature(..., output=NAME), output=POSITION or output=callable."
    )
