"""The torch.fx tracer of :func:`curvlib._trace.program.trace_program`: which modules are leaves
(layers, torch.nn built-ins, opaque modules), attention traced as its math, and custom
``autograd.Function`` calls recorded as one node each.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import fx, nn

from .. import rules
from .._core.sync import LOCK
from .._core.tensors import has_proxy
from ..rules import attention
from .modes import InPlaceProxy, TensorConstant, cut_no_grad_regions, no_autocast, record_modes

__all__ = ["Tracer", "function_apply", "function_call", "owns_parameters", "vmap_calls", "VmapCall", "finfo", "iinfo",
           "captured"]


def owns_parameters(module: nn.Module) -> bool:
    """Whether ``module`` owns parameters itself (not only in its submodules)."""
    return any(True for _ in module.parameters(recurse=False))


def _holds_attention(module: nn.Module) -> bool:
    """Whether a submodule is an attention module or transformer block traced as its math."""
    return any(attention.traced_forward(m) is not None for m in module.modules())


def _holds_layers(module: nn.Module) -> bool:
    """Whether a submodule below ``module`` owns parameters."""
    return any(owns_parameters(m) for m in module.modules() if m is not module)


class Tracer(fx.Tracer):
    """fx tracer whose leaves are parametrized modules, torch.nn built-ins and custom
    ``autograd.Function`` calls.

    fx would trace *into* ``Fn.apply`` (it calls ``forward`` on the proxies), and the
    graph would then differentiate ``forward``'s ops instead of ``Fn.backward``: wrong
    for a straight-through estimator or any custom gradient. While tracing (as fx
    itself does with ``nn.Module.__call__``), ``Function.apply`` is patched to record
    one ``call_function`` node whose target calls the real ``Fn.apply``; the patch is
    undone when tracing ends, under :data:`curvlib._core.sync.LOCK`.
    """

    def __init__(self, opaque: Optional[Dict[int, str]] = None, through: Optional[nn.Module] = None):
        super().__init__()
        self.opaque = opaque or {}  # id(module) -> why: modules traced as leaves
        self.through = through  # the model inside a holder root: traced through unless it is one layer
        self.failed: Optional[nn.Module] = None  # the deepest module whose forward raised
        self.installed: set = set()  # ids of the root's submodules (set by trace)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if attention.traced_forward(m) is not None:
            return False  # traced as its math (curvlib.rules.attention)
        if id(m) in self.opaque:
            return True
        if m is self.through:
            # (a bare nn.Linear called with keywords: one layer, as the bare-layer holder has it)
            return owns_parameters(m) and rules.has_family(m)
        if owns_parameters(m):
            # A user module that owns parameters and holds parametrized submodules or attention
            # (a ConvNeXt block's layer-scale gamma around its Linear layers): traced through, its
            # direct parameter uses become functional sites (as the root's) and the layers inside
            # keep their rules (Kronecker factors); as one generic leaf they would lose them.
            return rules.has_family(m) or not (_holds_attention(m) or _holds_layers(m))
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward, args, kwargs):
        if id(m) not in self.installed:
            return forward(*args, **kwargs)  # built inside forward (``ACT2FN[name](x)``): no path to call it by; its ops are traced
        math = attention.traced_forward(m)
        try:
            return super().call_module(m, math if math is not None else forward, args, kwargs)
        except Exception:
            if self.failed is None and id(m) in self.installed:  # the first to see the error is the innermost module
                self.failed = m
            raise

    def create_arg(self, a):
        if isinstance(a, torch.Tensor) and not isinstance(a, nn.Parameter) and self.tensor_attrs.get(a) is None \
                and not any(a is b for _, b in self.root.named_buffers()):  # (not stored on the model)
            return self.create_node("call_function", TensorConstant(a), (), {})
        return super().create_arg(a)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return InPlaceProxy(node, self)

    def create_node(self, *args, **kwargs):
        return record_modes(super().create_node(*args, **kwargs))

    def create_proxy(self, kind, target, args, kwargs, *rest, **more):
        if kind == "call_function" and target is F.scaled_dot_product_attention:
            return attention.scaled_dot_product_attention(*args, **kwargs)  # inlined as its math
        return super().create_proxy(kind, target, args, kwargs, *rest, **more)

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        return super().create_args_for_root(with_inner_signature(root_fn), is_module, concrete_args)

    def trace(self, root, concrete_args=None):
        tracer = self
        self.installed = {id(m) for m in root.modules()}
        original = torch.autograd.Function.__dict__["apply"]

        def apply(cls, *args, **kwargs):
            if has_proxy((args, kwargs)):
                return tracer.create_proxy("call_function", function_call(cls), args, kwargs)
            return original.__func__(cls, *args, **kwargs)

        # (traced with grad mode on, so that a node records the model's own ``no_grad`` regions
        # and not the caller's; a trace that fails inside one leaves the mode as it found it)
        with function_apply(apply), vmap_calls(self), torch.enable_grad(), no_autocast():
            graph = super().trace(root, concrete_args)
        cut_no_grad_regions(graph)
        return graph


def with_inner_signature(fn: Callable) -> Callable:
    """``fn``, or where it wraps another function (``functools.wraps``), a function with the
    inner one's signature that calls ``fn`` with its arguments.

    torch.fx reads the signature of the innermost function but, where that takes ``*args`` or
    ``**kwargs``, rewrites the code of ``fn`` itself to take one argument per placeholder: the
    code of a wrapper ``(self, *args, **kwargs)`` (transformers' ``can_return_tuple``) holds too few
    variable names for a forward with many inputs ("co_varnames is too small"). This function's
    own code has the inner signature's named arguments and keeps the wrapper's behaviour; the
    inner ``*args``/``**kwargs`` are left out (fx would make each one proxy, which cannot be
    unpacked into the call), as curvlib calls the model with named inputs."""
    inner = inspect.unwrap(fn)
    if inner is fn:
        return fn
    namespace: Dict[str, object] = {"_curvlib_wrapper": fn}
    head, call, star = [], [], False
    for i, p in enumerate(inspect.signature(inner).parameters.values()):
        default = ""
        if p.default is not p.empty:
            namespace[f"_curvlib_default_{i}"] = p.default
            default = f"=_curvlib_default_{i}"
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            head.append(p.name + default)
            call.append(p.name)
        elif p.kind is p.KEYWORD_ONLY:
            if not star:
                head.append("*")
                star = True
            head.append(p.name + default)
            call.append(f"{p.name}={p.name}")
    source = f"def forward({', '.join(head)}):\n    return _curvlib_wrapper({', '.join(call)})\n"
    exec(compile(source, f"<curvlib: {inner.__qualname__} as traced>", "exec"), namespace)  # noqa: S102
    return namespace["forward"]


@contextlib.contextmanager
def function_apply(apply: Callable):
    """``torch.autograd.Function.apply`` replaced by ``apply(cls, *args, **kwargs)`` for the block,
    under :data:`curvlib._core.sync.LOCK` (other threads must not see it), and put back."""
    original = torch.autograd.Function.__dict__["apply"]
    with LOCK:
        torch.autograd.Function.apply = classmethod(apply)
        try:
            yield
        finally:
            torch.autograd.Function.apply = original


_FUNCTION_CALLS: Dict[type, Callable] = {}


def function_call(cls: type) -> Callable:
    """The graph target for ``cls.apply`` (one per class; ``.function`` is the class)."""
    if cls not in _FUNCTION_CALLS:
        apply = torch.autograd.Function.__dict__["apply"].__func__

        def call(*args, **kwargs):
            return apply(cls, *args, **kwargs)

        call.__name__ = call.__qualname__ = f"{cls.__name__}.apply"
        call.function = cls
        _FUNCTION_CALLS[cls] = call
    return _FUNCTION_CALLS[cls]


class VmapCall:
    """The graph target of a ``torch.vmap``-built function called on traced values (transformers'
    attention masks, vmapped over index ranges): calls it under the torch function modes that
    were active where the model called it (transformers' ``TransformGetItemToIndex``)."""

    __name__ = "vmap"

    def __init__(self, fn: Callable, modes: List[object]):
        self.fn, self.modes = fn, modes

    def __call__(self, *args, **kwargs):
        with contextlib.ExitStack() as stack:
            for mode in self.modes:
                stack.enter_context(mode)
            return self.fn(*args, **kwargs)


@contextlib.contextmanager
def vmap_calls(tracer: fx.Tracer):
    """``torch.vmap`` (and ``torch.func.vmap``), ``torch.finfo`` and ``torch.iinfo`` replaced for
    the block, under :data:`curvlib._core.sync.LOCK`: the function vmap builds, called on
    proxies, records one :class:`VmapCall` node (torch.fx cannot run a transform on proxies);
    ``torch.finfo(x.dtype).min`` of a traced ``x`` records a :func:`finfo` node (the dtype is
    not known while tracing); on other values each runs as it is. A function that reads a traced
    value other than its arguments (a proxy in its closure) cannot be called later: it is
    refused with a ``TypeError``, as fx fails on it."""
    original = torch.vmap

    def vmap(func, *args, **kwargs):
        built = original(func, *args, **kwargs)

        @functools.wraps(built)
        def call(*inputs, **named):
            if not has_proxy((inputs, named)):
                return built(*inputs, **named)
            if any(isinstance(v, fx.Proxy) for v in captured(func)):
                raise TypeError(f"torch.vmap of {getattr(func, '__qualname__', func)!r} reads a traced value "
                                "that is not one of its arguments; torch.fx cannot record it as one call")
            modes = list(torch.overrides._get_current_function_mode_stack())
            return tracer.create_proxy("call_function", VmapCall(built, modes), inputs, named)

        return call

    def info(kind):
        def make(dtype=None):
            if isinstance(dtype, fx.Proxy):
                return _TracedInfo(tracer, kind, dtype)
            return kind() if dtype is None else kind(dtype)
        return make

    with LOCK:
        torch.vmap = torch.func.vmap = vmap
        torch.finfo, torch.iinfo = info(_FINFO), info(_IINFO)
        try:
            yield
        finally:
            torch.vmap = torch.func.vmap = original
            torch.finfo, torch.iinfo = _FINFO, _IINFO


_FINFO, _IINFO = torch.finfo, torch.iinfo


def finfo(dtype: torch.dtype, name: str):
    """``torch.finfo(dtype).name`` (``.min``): the graph target of such a read on a traced dtype."""
    return getattr(_FINFO(dtype), name)


def iinfo(dtype: torch.dtype, name: str):
    """``torch.iinfo(dtype).name``: the graph target of such a read on a traced dtype."""
    return getattr(_IINFO(dtype), name)


class _TracedInfo:
    """``torch.finfo(x.dtype)`` of a traced ``x``: each attribute read records a :func:`finfo` node."""

    def __init__(self, tracer: fx.Tracer, kind: type, dtype: fx.Proxy):
        self._tracer, self._kind, self._dtype = tracer, kind, dtype

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        target = finfo if self._kind is _FINFO else iinfo
        return self._tracer.create_proxy("call_function", target, (self._dtype, name), {})


def captured(obj, seen=None) -> list:
    """The values a function reads besides its arguments (its closure, defaults and wrapped
    function's, through ``functools.partial`` and containers), as leaves: what a
    ``torch.vmap``-built function computes from."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, (tuple, list, set, frozenset)):
        return [v for o in obj for v in captured(o, seen)]
    if isinstance(obj, dict):
        return [v for o in obj.values() for v in captured(o, seen)]
    if isinstance(obj, functools.partial):
        return captured((obj.func, obj.args, obj.keywords), seen)
    if inspect.isfunction(obj):
        cells = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
        return captured((cells, obj.__defaults__ or (), obj.__kwdefaults__ or {},
                         getattr(obj, "__wrapped__", None)), seen)
    return [obj]


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True
