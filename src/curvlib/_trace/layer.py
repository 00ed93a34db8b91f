"""A layer of a traced :class:`~curvlib._trace.program.Program`: a parametrized leaf module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Tuple

from torch import nn

from .._core.family import Family
from ..rules import FAMILY_OF, forward_for

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

    @property
    def kron_inside(self) -> Tuple[str, ...]:
        """The canonical names of the parameters owned, inside this layer's module, by modules
        whose family forms Kronecker factors from its input and output (a ``Linear``, a
        convolution, an embedding or RNN inside an opaque module; every family without an
        exact block): the parameters whose factors need the inside that an opaque layer's
        generic rule does not see."""
        owned = []
        for prefix, sub in self.module.named_modules(remove_duplicate=False):
            if FAMILY_OF[forward_for(sub)[1]].exact_block:
                continue
            for role, _ in sub.named_parameters(prefix=prefix, recurse=False):
                if role in self.names and self.names[role] not in owned:
                    owned.append(self.names[role])
        return tuple(owned)

    @property
    def kron_inside_rows(self) -> Tuple[str, ...]:
        """Those of :attr:`kron_inside` owned by a layer whose family takes its factors from its
        rows (:attr:`~curvlib._core.family.Family.factors_from_rows`, a ``Linear``): KFAC, KFLR and
        the empirical KFAC form them sample by sample; KFRA, which pulls a matrix back layer by
        layer, cannot pass it through the module."""
        rows = []
        for prefix, sub in self.module.named_modules(remove_duplicate=False):
            if prefix and FAMILY_OF[forward_for(sub)[1]].factors_from_rows:
                rows += [self.names[role] for role, _ in sub.named_parameters(prefix=prefix, recurse=False)
                         if role in self.names]
        return tuple(n for n in self.kron_inside if n in rows)
