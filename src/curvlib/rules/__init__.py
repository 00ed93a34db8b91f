"""Per-layer rules, one module per layer family, and the table that picks them.

Each family module exposes

* ``forward(module, where, names, tensors, args, kwargs, recorder)``: run the
  layer functionally with the given parameter tensors and record its sites;
* optionally ``check(module, where)``: refuse unsupported configurations
  (called before any work, on every call);
* one or more :class:`~curvlib._core.site.Rule` tables with the math.

A module whose type is in :data:`FAMILIES` (and whose ``forward`` is the
family's own, so subclasses that change ``forward`` are not trusted) gets the
family's rule; any other parametrized module gets :mod:`~curvlib.rules.generic`.
"""

from __future__ import annotations

from typing import Callable, Tuple

from torch import nn
from torch.nn.utils import parametrize

from . import batchnorm, conv, conv_transpose, embedding, generic, groupnorm, layernorm, linear, rnn
from .._core.sync import LOCK
from .generic import math_hooks, restored

# (module types, family module name). Order matters only for subclasses.
FAMILIES: Tuple[Tuple[Tuple[type, ...], str], ...] = (
    ((nn.Linear,), "linear"),
    ((nn.Conv1d, nn.Conv2d, nn.Conv3d), "conv"),
    ((nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d), "conv_transpose"),
    ((nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d), "batchnorm"),
    ((nn.Embedding,), "embedding"),
    ((nn.RNN, nn.LSTM, nn.GRU), "rnn"),
    ((nn.LayerNorm,), "layernorm"),
    ((nn.GroupNorm,), "groupnorm"),
)

# Parameter-free (or parametrized) modules whose configuration must be checked
# on every call: module type -> family module name providing ``check``.
CHECKED: Tuple[Tuple[Tuple[type, ...], str], ...] = (
    ((nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d), "batchnorm"),
)


#: Family name (a rule's ``kind``) -> its module: forward, checks, Kronecker pieces.
FAMILY_MODULES = {"linear": linear, "conv": conv, "conv_transpose": conv_transpose, "batchnorm": batchnorm,
                  "embedding": embedding, "rnn": rnn, "layernorm": layernorm, "groupnorm": groupnorm}


def _family(module: nn.Module, table) -> "str | None":
    for types, family in table:
        for t in types:
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
    return _family(module, FAMILIES) is None and any(
        isinstance(module, t) for types, family in FAMILIES if family not in ("rnn", "conv_transpose") for t in types)


def has_family(module: nn.Module) -> bool:
    """Whether the module has a hand-written rule family."""
    return _family(module, FAMILIES) is not None


def forward_for(module: nn.Module) -> Tuple[Callable, str]:
    """The functional forward for a parametrized leaf module, and its family name.

    Modules with parametrizations (or old-style reparametrizing hooks) run through
    the generic rule, which calls the module itself.
    """
    family = _family(module, FAMILIES)
    if family is None or not plain(module):
        return generic.forward, "generic"
    return FAMILY_MODULES[family].forward, family


def kron_factors(site, role: str, m, approx=None, max_dim=None):
    """Kronecker factors (BackPACK's order) of ``role`` at ``site`` from the pulled-back root ``m``;
    ``approx``: ``None`` (BackPACK's), ``"expand"`` or ``"reduce"`` (see ``rules.linear.kron``);
    ``max_dim``: a side larger than it gets a diagonal factor (:mod:`curvlib.rules._gram`)."""
    family = FAMILY_MODULES[site.rule.kind]
    return family.kron(site, role, m, approx, max_dim)


#: Rule kinds with Kronecker factors ``[B, A]`` of their own (``kron``, ``kron_input``).
SPLIT_KRON_KINDS = ("linear", "conv", "conv_transpose")
#: Rule kinds with their own factors in another layout (``kron`` only; see :mod:`curvlib._core.kronlayout`).
OWN_KRON_KINDS = ("embedding",)


def kron_weight_output(site, B):
    """The weight's output-side factor from the full ``B`` (per-group blocks of grouped convolutions)."""
    family = FAMILY_MODULES[site.rule.kind]
    weight_output = getattr(family, "weight_output_factor", None)
    return B if weight_output is None else weight_output(site, B)


def kron_input_factor(site, approx=None, max_dim=None):
    """The input-side Kronecker factor ``A`` of ``site``'s weight (independent of the root)."""
    family = FAMILY_MODULES[site.rule.kind]
    return family.kron_input(site, approx, max_dim)


def kron_from_matrix(site, role: str, G):
    """KFRA factors of ``role`` at ``site`` from the batch-averaged output matrix ``G``."""
    family = FAMILY_MODULES[site.rule.kind]
    return family.kron_from_output_matrix(site, role, G)


def checker_for(module: nn.Module) -> "Callable[[nn.Module, str], None] | None":
    """The family's ``check(module, where)`` for this module, or ``None``."""
    family = _family(module, FAMILIES) or _family(module, CHECKED)
    if family is None:
        return None
    return getattr(FAMILY_MODULES[family], "check", None)


def check_module(module: nn.Module, where: str) -> None:
    """Refuse a configuration the module's rule cannot handle (before any work)."""
    check = checker_for(module)
    if check is not None:
        check(module, where)
