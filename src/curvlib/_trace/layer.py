"""A layer of a traced :class:`~curvlib._trace.program.Program`: a parametrized leaf module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict

from torch import nn

from .._core.family import Family
from ..rules import FAMILY_OF

__all__ = ["Layer"]


@dataclass
class Layer:
    """A parametrized leaf module of the trace.

    Attributes:
        path: the module's path in the user's model (``""`` for the model itself).
        module: the module object (read, never changed).
        names: role -> canonical parameter name, for every parameter in the
            module's subtree (role: the name relative to the module).
        forward: the rule's functional forward ``(module, where, names, tensors,
            args, kwargs, recorder) -> output``.
        kind: the rule family (``"linear"``, ``"conv"``, ..., ``"generic"``).
        opaque: why torch.fx could not trace the module's ``forward`` (``""`` if it
            is a leaf for another reason).
    """

    path: str
    module: nn.Module
    names: Dict[str, str]
    forward: Callable
    kind: str
    opaque: str = ""

    @property
    def family(self) -> Family:
        """The layer's family record: the facts the stages read of it."""
        return FAMILY_OF[self.kind]
