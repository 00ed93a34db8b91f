"""Run a model that :mod:`torch.fx` cannot trace: eagerly, through its own ``forward``.

A model whose ``forward`` has data-dependent Python control flow (``if
x.sum() > 0:``, a loop whose length comes from ``.item()``, a branch on a
shape) has no graph (``program.graph is None``). First-order quantities do
not need the graph: they need every application of a parametrized layer (a
*site*) with its saved inputs and a probe on its output. :func:`run_eager`
gets exactly that by running the model's real ``forward`` on the real input
with every *layer* (a module owning parameters directly, not inside another
one; see :func:`curvlib._trace.program.trace_program`) redirected to the layer's
functional family forward, which records the site and adds its probe, as
:func:`curvlib._interpret.graph.run_graph` does for a ``call_module`` node.

How the redirect works, and why the model is left as it was:

* for the duration of one run, each layer instance gets an instance
  attribute ``forward`` (``Module.__call__`` looks ``self.forward`` up on the
  instance first), removed again in a ``finally`` (the slot is restored
  exactly, also when the model raises); no hook is registered on any module
  of the model and no parameter slot is touched by the redirect;
* the layer's parameters are never read from the model: the family forward
  gets the tensors of ``params`` (so the run is a pure function of
  ``(params, X)`` and works inside :func:`torch.func.vjp` / ``vmap``: no
  ``requires_grad_``, no ``autograd.grad``);
* dropout draws its masks from the call's seed (:mod:`curvlib._core.dropout`), as
  in a traced model;
* the run holds :data:`curvlib._core.sync.LOCK` (another thread calling the model
  would go through the redirects, and see the global pre-hook);
* a global forward pre-hook (removed in the same ``finally``) runs
  :func:`curvlib.rules.check_module` on every module of the model as it is
  called (e.g. refuses a BatchNorm in training mode before it runs);
* a :class:`~torch.overrides.TorchFunctionMode` refuses any use of a model
  parameter outside its layer (``F.linear(h, self.enc.weight)`` in the
  model's ``forward``, a layer handed another layer's weight): such a use
  would bypass the sites, so its contribution would be missing, and nothing
  may be returned silently wrong. Reading metadata (``.shape``, ``.dtype``,
  ...) or a detached value (``.detach()``, ``.item()``) is allowed.

Only first-order quantities can be computed this way: second order needs
the graph (element-wise nonlinearities, Kronecker chains), and curvlib
refuses it for such models with the line at which tracing stopped.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from typing import Dict, List, Mapping, Optional

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .._core import dropout as _dropout
from .._core.errors import CurvatureError
from .._core.outputs import select
from .._core.inputs import keyword_inputs
from .program import Layer, Program
from .._core.sync import LOCK
from ..rules import check_module
from .._core.site import Recorder

__all__ = ["run_eager"]

_MISSING = object()

# Torch functions that read only metadata or a value without a gradient path.
_READ_ONLY = frozenset(
    [
        Tensor.size, Tensor.dim, Tensor.ndimension, Tensor.numel, Tensor.nelement,
        Tensor.stride, Tensor.storage_offset, Tensor.is_floating_point, Tensor.is_complex,
        Tensor.element_size, Tensor.is_contiguous, Tensor.get_device, Tensor.data_ptr,
        Tensor.__len__, Tensor.__repr__, Tensor.__format__, Tensor.detach, Tensor.item,
        Tensor.tolist,
    ]
    + [
        getattr(Tensor, attr).__get__
        for attr in (
            "shape", "ndim", "dtype", "device", "layout", "requires_grad", "is_leaf",
            "is_cuda", "is_sparse", "is_quantized", "is_meta", "names", "grad_fn",
            "itemsize", "nbytes",
        )
        if hasattr(Tensor, attr) and hasattr(getattr(Tensor, attr), "__get__")
    ]
)


# "Inside a library" is decided by the packages' own folders, not by a name in the path: a
# user's clone named ``curvlib/`` (what ``git clone .../curvlib`` makes) holds user code too.
_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(path)) + os.sep for path in (torch.__file__, __file__))


def _user_line() -> str:
    """The innermost frame of the current stack outside torch and curvlib."""
    for frame in reversed(traceback.extract_stack()):
        if os.path.abspath(frame.filename).startswith(_LIBRARY_DIRS):
            continue
        return f"{frame.filename}:{frame.lineno}: {frame.line}"
    return ""


def _path_changed(rec: Recorder, where: Optional[str] = None, shape=None) -> str:
    got = [list(s) for s in rec.out_shapes] + ([list(shape)] if shape is not None else [])
    return (
        "The model called its parametrized layers differently than in curvlib's planning "
        "pass for this input signature"
        + (f" (layer '{where}' is call {len(got)}, with output shape {list(shape)})" if where is not None else "")
        + f": output shapes {got}, planned {[list(p.shape) for p in rec.probes]}. Its "
        "forward takes another path (data-dependent control flow, randomness or state) "
        "than when the plan was made; curvlib cannot follow that for a model that "
        "torch.fx cannot trace. Plan again for this input."
    )


def _model_name(program: Program) -> str:
    model = program.root.get_submodule(program.prefix[:-1]) if program.prefix else program.root
    return type(model).__name__


def _where(layer: Layer) -> str:
    return f"'{layer.path}' ({type(layer.module).__name__})" if layer.path else f"the model ({type(layer.module).__name__})"


class _Run:
    """State of one eager run: which layer is running, and what it may read."""

    def __init__(self, program: Program, params: Mapping[str, Tensor], trainable, rec: Recorder):
        self.program, self.params, self.trainable, self.rec = program, params, trainable, rec
        self.checked = _CheckedRecorder(rec)
        self.stack: List[Layer] = []  # layers whose family forward is running
        self.allowed_names: List[frozenset] = []
        self.allowed_modules: List[frozenset] = []

    # -- parameter uses -------------------------------------------------------
    def check_tensors(self, values, what: str) -> None:
        """Refuse a model parameter among ``values`` that the running layer does not own."""
        for value in values:
            if isinstance(value, (list, tuple)):
                self.check_tensors(value, what)
                continue
            if isinstance(value, dict):
                self.check_tensors(value.values(), what)
                continue
            if not isinstance(value, nn.Parameter):
                continue
            name = self.program.param_names.get(id(value))
            if name is None or (self.stack and name in self.allowed_names[-1]):
                continue
            line = _user_line()
            owner = f"inside layer {_where(self.stack[-1])}, which does not own it" if self.stack else "outside its module"
            raise CurvatureError(
                f"Model {_model_name(self.program)} uses parameter '{name}' {owner} "
                f"({what}); the model could not be traced with torch.fx, so curvlib runs it "
                "eagerly and sees a parameter only through the module that owns it, whose "
                "call it redirects to its rule: this use would be missing from every "
                "quantity. Call the owning module instead, read only .detach()/.shape of "
                "the parameter, or make the model traceable."
                + (f"\n  at {line}" if line else "")
            )

    # -- layer calls ----------------------------------------------------------
    def call_layer(self, layer: Layer, original, args, kwargs):
        if self.stack:
            if id(layer.module) in self.allowed_modules[-1]:
                return original(*args, **kwargs)  # inside its own (generic) layer
            line = _user_line()
            raise CurvatureError(
                f"Layer {_where(self.stack[-1])} calls layer {_where(layer)}, which is not one "
                "of its submodules; curvlib cannot attribute that call's parameters. "
                "Register the called module as a submodule, or call it from the model's "
                "forward instead." + (f"\n  at {line}" if line else "")
            )
        self.check_tensors((args, kwargs), f"passed to layer {_where(layer)}")
        names = {r: n for r, n in layer.names.items() if n in self.trainable}
        tensors = {r: self.params[n] for r, n in layer.names.items()}
        self.stack.append(layer)
        self.allowed_names.append(frozenset(layer.names.values()))
        self.allowed_modules.append(frozenset(id(m) for m in layer.module.modules()))
        try:
            return layer.forward(layer.module, layer.path, names, tensors, args, kwargs, self.checked)
        finally:
            self.stack.pop()
            self.allowed_names.pop()
            self.allowed_modules.pop()


class _CheckedRecorder:
    """The recorder, refusing a site whose planned probe does not fit.

    The plan was made by earlier passes of the model; with data-dependent
    control flow, a later run may call other layers. A site is only accepted
    when the probe planned for its index has its output's shape.
    """

    def __init__(self, rec: Recorder):
        self._rec = rec

    def __getattr__(self, name):
        return getattr(self._rec, name)

    def _check(self, site, shape) -> None:
        rec = self._rec
        if rec.probes is None or not site.params:
            return
        k = len(rec.sites)
        if k >= len(rec.probes) or tuple(rec.probes[k].shape) != rec.probe_shape(site, k, shape):
            raise CurvatureError(_path_changed(rec, site.where, shape))

    def add(self, site, out):
        self._check(site, out.shape)
        return self._rec.add(site, out)

    def open(self, site, out_shape, dtype):
        self._check(site, out_shape)
        return self._rec.open(site, out_shape, dtype)


class _ParameterGuard(TorchFunctionMode):
    """Refuses a torch operation on a model parameter outside the parameter's layer."""

    def __init__(self, run: _Run):
        super().__init__()
        self.run = run

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _READ_ONLY:
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
            self.run.check_tensors((args, kwargs), f"in {name}")
        return func(*args, **kwargs)


def _refuse_unredirectable(layer: Layer) -> None:
    """Layers whose redirect would not be exact (hooks, an instance ``forward``)."""
    m = layer.module
    if m._forward_hooks or m._forward_pre_hooks:
        raise CurvatureError(
            f"Layer {_where(layer)} has forward hooks or pre-hooks; the model could not be "
            "traced with torch.fx, and curvlib cannot run a hooked layer of an untraced "
            "model exactly (its hooks would run twice). Remove the hooks, or make the "
            "model traceable."
        )
    if "forward" in vars(m):
        raise CurvatureError(
            f"Layer {_where(layer)} has an instance attribute 'forward' that replaces its "
            "class's forward; curvlib cannot run such a layer of an untraced model. "
            "Subclass the module instead."
        )


def run_eager(
    program: Program,
    X: Tensor,
    params: Mapping[str, Tensor],
    trainable: frozenset,
    rec: Recorder,
    fake_tensor=None,
    env: Optional[Dict] = None,
) -> Tensor:
    """Run the model's own ``forward`` with its layers redirected to their rules.

    A drop-in for :func:`curvlib._interpret.graph.run_graph` when ``program.graph is
    None`` (``fake_tensor`` and ``env`` are accepted and ignored: there is no
    graph; buffers are read by the model as they are).

    Args:
        program: the model (``graph`` may be ``None``; ``layers`` is used).
        X: input ``[N, *]``.
        params: canonical name -> tensor for *every* parameter of the model.
        trainable: names whose quantities are wanted (their sites get probes).
        rec: collects the sites.

    Returns:
        The model output.

    Raises:
        CurvatureError: a parameter used outside its layer, a layer with hooks,
            a module its rule refuses, or an output that is not one tensor.
    """
    with LOCK:  # the redirects and the global pre-hook are visible to every thread
        return _run_eager(program, X, params, trainable, rec)


def _run_eager(program: Program, X: Tensor, params: Mapping[str, Tensor], trainable: frozenset, rec: Recorder) -> Tensor:
    run = _Run(program, params, trainable, rec)
    layers: Dict[int, Layer] = {}
    for layer in program.layers.values():
        layers.setdefault(id(layer.module), layer)
    for layer in layers.values():
        _refuse_unredirectable(layer)
    paths = {}
    for path, m in program.root.named_modules():
        path = path[len(program.prefix):] if path.startswith(program.prefix) else path
        paths.setdefault(id(m), path or type(m).__name__)

    def check(module, args):
        where = paths.get(id(module))
        if where is not None:
            check_module(module, where)

    def redirect(layer: Layer):
        original = type(layer.module).forward.__get__(layer.module, type(layer.module))
        return lambda *args, **kwargs: run.call_layer(layer, original, args, kwargs)

    installed = []
    handle = None
    try:
        for layer in layers.values():
            slots = vars(layer.module)
            installed.append((slots, slots.get("forward", _MISSING)))
            slots["forward"] = redirect(layer)
        handle = nn.modules.module.register_module_forward_pre_hook(check)
        masks = _dropout.new_generator(rec.dropout_seed)  # this call's dropout masks (None without dropout)
        with _ParameterGuard(run), (_dropout.DropoutMode(masks) if masks is not None else contextlib.nullcontext()):
            model = program.root.get_submodule(program.prefix[:-1]) if program.prefix else program.root
            out = model(**X) if keyword_inputs(model, X) else program.root(X)  # (keyword inputs as keywords)
    finally:
        if handle is not None:
            handle.remove()
        for slots, old in reversed(installed):
            if old is _MISSING:
                slots.pop("forward", None)
            else:  # pragma: no cover - refused above
                slots["forward"] = old
    if rec.probes is not None and [tuple(p.shape) for p in rec.probes] != [
            rec.probe_shape(site, k, shape) for k, (site, shape) in enumerate(zip(rec.sites, rec.out_shapes))]:
        raise CurvatureError(_path_changed(rec))
    if not isinstance(out, Tensor):  # a ModelOutput, tuple, dict: the tensor curvature(..., output=) names
        out = select(out, program.selector)[0]
    return out
