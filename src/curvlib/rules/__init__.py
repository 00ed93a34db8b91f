"""Per-layer rules: one module per layer family, and the table that registers them.

Each family module defines one :class:`~curvlib._core.family.Family` record, ``FAMILY``: its module
classes, its functional ``forward`` (run the layer on given parameter tensors and record its
sites), its ``check`` (refuse unsupported configurations before any work), its Kronecker pieces,
and one or more :class:`~curvlib._core.site.Rule` tables with the per-sample math.

A module whose type a family in :data:`FAMILIES` covers (and whose ``forward`` is the class's
own, so subclasses that change ``forward`` are not trusted) gets that family; any other
parametrized module gets :mod:`~curvlib.rules.generic`.
"""

from __future__ import annotations

import collections.abc
from typing import Callable, Dict, Optional, Tuple

from torch import nn
from torch.nn.utils import parametrize

from . import batchnorm, conv, conv_transpose, embedding, generic, groupnorm, layernorm, linear, rnn
from .._core.family import Family
from .._core.sync import LOCK
from .generic import math_hooks, restored

#: Every hand-written family, in the order modules are matched (it matters only for subclasses).
FAMILIES: Tuple[Family, ...] = (
    linear.FAMILY, conv.FAMILY, conv_transpose.FAMILY, batchnorm.FAMILY, embedding.FAMILY, rnn.FAMILY,
    layernorm.FAMILY, groupnorm.FAMILY,
)
#: A family's record by its name (a rule's ``kind``); ``"generic"`` included.
FAMILY_OF: Dict[str, Family] = {f.kind: f for f in FAMILIES + (generic.FAMILY,)}


def _family(module: nn.Module) -> Optional[Family]:
    for family in FAMILIES:
        for t in family.types:
            if isinstance(module, t) and type(module).forward is t.forward:
                return family
    return None


def plain(module: nn.Module) -> bool:
    """The family's functional forward is exact: no parametrization and no reparametrizing
    hook (the old-style ``weight_norm``/``spectral_norm`` compute the weight in a pre-hook).
    Any other hook (a user's, or one left by another library) is not part of the math:
    the module's own class decides."""
    return not (parametrize.is_parametrized(module) or math_hooks(module))


def call_without_hooks(module: nn.Module, args, kwargs):
    """``module(*args, **kwargs)`` without its hooks (user hooks are not part of the math;
    a full backward hook cannot even run under torch.func), unless a hook computes its
    parameters (:func:`math_hooks`), in which case the module is called as usual."""
    if math_hooks(module):
        with LOCK, restored(module):  # (the hook sets module.weight: not left behind)
            return module(*args, **kwargs)
    return module.forward(*args, **kwargs)


def subclassed(module: nn.Module) -> bool:
    """A subclass of a Linear, Conv, Embedding, norm or BatchNorm class with its own ``forward``
    (timm's ``LayerNorm2d``): no hand-written rule here; the ATen front end matches its ops."""
    return _family(module) is None and any(
        isinstance(module, t) for family in FAMILIES if family.kind not in ("rnn", "conv_transpose")
        for t in family.types)


def has_family(module: nn.Module) -> bool:
    """Whether the module has a hand-written rule family."""
    return _family(module) is not None


def forward_for(module: nn.Module) -> Tuple[Callable, str]:
    """The functional forward for a parametrized leaf module, and its family name.

    Modules with parametrizations (or old-style reparametrizing hooks) run through
    the generic rule, which calls the module itself.
    """
    family = _family(module)
    if family is None or not plain(module):
        return generic.forward, "generic"
    return family.forward, family.kind


def kron_factors(site, role: str, m, approx=None, max_dim=None):
    """Kronecker factors (BackPACK's order) of ``role`` at ``site`` from the pulled-back root ``m``;
    ``approx``: ``None`` (BackPACK's), ``"expand"`` or ``"reduce"`` (see ``rules.linear.kron``);
    ``max_dim``: a side larger than it gets a diagonal factor (:mod:`curvlib.rules._gram`)."""
    return FAMILY_OF[site.rule.kind].kron(site, role, m, approx, max_dim)


def kron_layout(site) -> str:
    """``"split"``, ``"own"`` or ``""``: how the family of ``site``'s rule lays out its Kronecker
    factors (:attr:`~curvlib._core.family.Family.kron_layout`)."""
    family = FAMILY_OF.get(site.rule.kind)
    return family.kron_layout if family is not None else ""


def kron_weight_output(site, B):
    """The weight's output-side factor from the full ``B`` (per-group blocks of grouped convolutions)."""
    weight_output = FAMILY_OF[site.rule.kind].weight_output_factor
    return B if weight_output is None else weight_output(site, B)


def kron_input_factor(site, approx=None, max_dim=None):
    """The input-side Kronecker factor ``A`` of ``site``'s weight (independent of the root)."""
    return FAMILY_OF[site.rule.kind].kron_input(site, approx, max_dim)


def kron_from_matrix(site, role: str, G):
    """KFRA factors of ``role`` at ``site`` from the batch-averaged output matrix ``G``."""
    return FAMILY_OF[site.rule.kind].kron_from_output_matrix(site, role, G)


def checker_for(module: nn.Module) -> "Callable[[nn.Module, str], None] | None":
    """The family's ``check(module, where)`` for this module, or ``None``."""
    family = _family(module)
    return family.check if family is not None else None


class FamilyKinds(collections.abc.Sequence):
    """The names of the registered layer families (:data:`FAMILY_OF`) whose record
    satisfies ``holds``, read at each use: a family registered later
    (:func:`register`) is among them by its record alone."""

    def __init__(self, holds: Callable[[object], bool]):
        self.holds = holds

    def now(self) -> Tuple[str, ...]:
        return tuple(kind for kind, f in FAMILY_OF.items() if self.holds(f))

    def __iter__(self):
        return iter(self.now())

    def __len__(self) -> int:
        return len(self.now())

    def __getitem__(self, i):
        return self.now()[i]

    def __contains__(self, kind) -> bool:
        return kind in self.now()

    def __eq__(self, other) -> bool:
        return tuple(self) == tuple(other) if isinstance(other, collections.abc.Sequence) else NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return repr(self.now())


def check_module(module: nn.Module, where: str) -> None:
    """Refuse a configuration the module's rule cannot handle (before any work)."""
    check = checker_for(module)
    if check is not None:
        check(module, where)


def register(family: Family) -> Callable[[], None]:
    """Add ``family`` to :data:`FAMILIES` (matched after the built-in ones) and
    :data:`FAMILY_OF`, as if its module were listed in :data:`FAMILIES`; every stage reads it
    from there. Returns a function that removes it again (tests)."""
    global FAMILIES
    if family.kind in FAMILY_OF:
        raise ValueError(f"a layer family named {family.kind!r} is registered already")
    FAMILIES = FAMILIES + (family,)
    FAMILY_OF[family.kind] = family

    def remove() -> None:
        global FAMILIES
        FAMILIES = tuple(f for f in FAMILIES if f is not family)
        FAMILY_OF.pop(family.kind, None)

    return remove
