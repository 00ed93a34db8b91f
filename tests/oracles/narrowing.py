"""Build any vision network at a fraction of its width, whatever its builder fixes.

torchvision's builders (and some timm models) hard-code their channel counts (ResNet's
64-512, VGG's 4096-wide classifier), so no argument makes them small. ``narrowed(k)`` divides
every *width* by ``k`` while the network is built: the channel/feature sizes given to the
constructors of the standard layers (``Conv*``, ``Linear``, ``BatchNorm*``, ``LayerNorm``,
``GroupNorm``, ``MultiheadAttention``) and the sizes of parameters that a model creates
itself (a class token ``[1, 1, D]``, a layer scale ``[D, 1, 1]``).

A width is any size ``c`` with ``c % k == 0`` and ``c >= 2k``: the same rule for every layer,
so sizes that must agree still agree (``f(a) = a / k`` is linear, hence concatenations
``f(a + b) = f(a) + f(b)`` and flattened maps ``f(C·H·W) = f(C)·H·W`` stay consistent); sizes
that are not widths (3 input channels, 3 classes, 7x7 kernels, sequence lengths) are kept.
Depthwise convolutions keep ``groups == in_channels``; other group counts become a common
divisor. A network where the rule breaks (a width not divisible by ``k`` split in halves)
fails its first forward, and the caller tries another ``k``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import re
from typing import Callable, Dict, Iterator, Tuple

from torch import nn


def _width(c, k: int):
    return c // k if isinstance(c, int) and c % k == 0 and c >= 2 * k else c


def _conv(a: Dict, k: int) -> None:
    cin = a["in_channels"]
    a["in_channels"], a["out_channels"] = _width(cin, k), _width(a["out_channels"], k)
    groups = a.get("groups", 1)
    if groups > 1:
        a["groups"] = a["in_channels"] if groups == cin else math.gcd(groups, math.gcd(a["in_channels"],
                                                                                       a["out_channels"]))


def _linear(a: Dict, k: int) -> None:
    a["in_features"], a["out_features"] = _width(a["in_features"], k), _width(a["out_features"], k)


def _batch_norm(a: Dict, k: int) -> None:
    a["num_features"] = _width(a["num_features"], k)


def _layer_norm(a: Dict, k: int) -> None:
    s = a["normalized_shape"]
    a["normalized_shape"] = _width(s, k) if isinstance(s, int) else (*tuple(s)[:-1], _width(tuple(s)[-1], k))


def _group_norm(a: Dict, k: int) -> None:
    a["num_channels"] = _width(a["num_channels"], k)
    a["num_groups"] = math.gcd(a["num_groups"], a["num_channels"])


def _attention(a: Dict, k: int) -> None:
    a["embed_dim"] = _width(a["embed_dim"], k)


_WIDTH_NAME = re.compile(r"(^|_)(dim|channels|width|features)s?$")


def _named_widths(a: Dict, k: int) -> None:
    """A model class's own size arguments (``hidden_dim``, ``mlp_dim``, ``stem_channels``)."""
    for name, v in a.items():
        if _WIDTH_NAME.search(name) and isinstance(v, int) and not isinstance(v, bool):
            a[name] = _width(v, k)


LAYERS: Dict[type, Callable[[Dict, int], None]] = {
    nn.Conv1d: _conv, nn.Conv2d: _conv, nn.Conv3d: _conv, nn.ConvTranspose1d: _conv, nn.ConvTranspose2d: _conv,
    nn.Linear: _linear, nn.BatchNorm1d: _batch_norm, nn.BatchNorm2d: _batch_norm, nn.BatchNorm3d: _batch_norm,
    nn.LayerNorm: _layer_norm, nn.GroupNorm: _group_norm, nn.MultiheadAttention: _attention,
}


class _State:
    inside_layer = 0  # > 0 while a narrowed layer builds its own (already narrow) parameters
    inside_model = 0  # > 0 while a model class narrowed by its arguments builds (its layers follow them)


def _narrow_init(cls: type, fix: Callable[[Dict, int], None], k: int, model: bool) -> Callable:
    init = cls.__init__
    sig = inspect.signature(init)

    @functools.wraps(init)  # its signature stays the class's own, for a wrapper around it
    def __init__(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        if model or not _State.inside_model:
            fix(bound.arguments, k)
        counter = "inside_model" if model else "inside_layer"
        setattr(_State, counter, getattr(_State, counter) + 1)
        try:
            init(*bound.args, **bound.kwargs)
        finally:
            setattr(_State, counter, getattr(_State, counter) - 1)

    return __init__


def _narrow_parameter(new: Callable, k: int) -> Callable:
    def __new__(cls, data=None, requires_grad=True):
        if data is not None and not (_State.inside_layer or _State.inside_model) and data.dim() > 0:
            data = data[tuple(slice(0, _width(s, k)) for s in data.shape)].clone()
        return new(cls, data, requires_grad)

    return __new__


@contextlib.contextmanager
def narrowed(k: int, models: Tuple[type, ...] = ()) -> Iterator[None]:
    """Within the block, networks are built with every width divided by ``k`` (module docstring);
    ``k = 1`` changes nothing. With ``models``, those classes are narrowed by their arguments
    instead: the integers named like widths (``*_dim``, ``*_channels``, ``*_width``,
    ``*_features``), which they also keep as attributes (``reshape(n, self.hidden_dim, -1)``);
    the layers and parameters they build follow from those and are not narrowed again."""
    if k == 1:
        yield
        return
    layers = {**LAYERS, **{cls: _named_widths for cls in models if cls not in LAYERS}}
    own = {cls: cls.__dict__.get("__init__") for cls in layers}  # None: inherited, deleted again after
    saved_new = nn.Parameter.__dict__["__new__"]  # the staticmethod itself, restored as it was
    try:
        for cls, fix in layers.items():
            cls.__init__ = _narrow_init(cls, fix, k, model=cls in models)
        nn.Parameter.__new__ = staticmethod(_narrow_parameter(saved_new.__func__, k))
        yield
    finally:
        for cls, init in own.items():
            if init is None:
                del cls.__init__
            else:
                cls.__init__ = init
        nn.Parameter.__new__ = saved_new


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())

