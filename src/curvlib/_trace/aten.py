"""The front end for real model code: an ATen-level trace when torch.fx cannot follow it.

torch.fx traces *symbolically*: Python that reads values (``if mask is None``,
``ModelOutput`` dataclasses, ``x.shape[0]`` passed to ``expand``, tuple-returning
submodules) breaks it. When the fx trace fails, leaves a submodule opaque, or the model's
keyword inputs need it, curvlib instead runs the model once on the call's input under
:func:`torch.fx.experimental.proxy_tensor.make_fx` (pre-dispatch ATen ops, real
tensors): all of the model's Python has run and every branch is taken as it is for
inputs of this signature. The ATen graph is then *replayed* through curvlib's own fx
tracer (:class:`curvlib._trace.tracer.Tracer`), so that the rest of the pipeline sees the
vocabulary of a symbolically traced model:

* a parameter use whose op *is* its owner module's forward (``aten.linear`` on an
  ``nn.Linear``'s weight and bias, ``aten.conv2d`` with the module's stride, padding,
  dilation and groups, ``aten.embedding``, ``aten.layer_norm``, ``aten.group_norm``,
  ``aten.batch_norm``) becomes a ``call_module`` node, run by the module's hand-written
  rule (individual gradients by einsum, Kronecker factors, ...);
* GPT-2's ``Conv1D`` (``addmm(b, x.view(-1, k), W)``) becomes ``F.linear(x, Wᵀ, b)`` on the
  unflattened input (per-sample rows stay per sample): a transposed Linear site; a ``matmul``
  with a 2-D parameter (``x @ W.T``, ``x @ W``, ``W @ x``) becomes the ``F.linear`` it is; an
  ``aten.linear`` on a parameter weight with a bias computed in ``forward`` becomes
  ``F.linear(x, W) + b``;
* every other op maps to its torch-level function (``F.gelu``, ``torch.softmax``,
  ``Tensor.view``, ...) where one takes the same arguments, so curvature rules classify it,
  else it stays the ATen op; ``scaled_dot_product_attention`` becomes its math
  (:mod:`curvlib.rules.attention`: forward-mode AD and batching rules exist);
* ops on constants only (a causal mask from ``arange``) are evaluated once: constants;
* a custom ``autograd.Function`` is one node (:mod:`curvlib._trace.functions`): ``Fn.apply``,
  differentiated by its own ``backward``.

Parameter uses left (a ``weight * x`` RMSNorm, a layer-scale ``gamma``, a class token
concatenated) are functional sites (:mod:`curvlib.rules.functional`), exact per sample.
Shapes are baked into the graph (``view(x, [N, T, H, D])``), so a trace serves one input
signature (shapes, dtypes, devices): :mod:`curvlib._transform.entry` keys it so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, fx, nn
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, get_proxy_mode, get_proxy_slot, make_fx
from torch.utils import _pytree as pytree

from .._core import outputs as _outputs
from .._core.errors import CurvatureError
from .aten_ops import (INPUT_ARG, conv1d_linear, linear_computed_bias, matmul_linear, owner_call, owners, torch_level,
                       view_of)
from .branches import input_branch, without_hooks
from .._core.inputs import as_pytree, batch_size, keyword_inputs, trace_structure, with_batch
from .functions import forget, recorded_functions, replay
from .module_calls import forget as forget_modules, kept_whole, module_spans, modules_to_keep_whole, replay_module
from .modes import inference_as_no_grad
from .tracer import Tracer, captured
from .program import Program, assemble
from .._core.sync import LOCK
from .._core.tensors import has_proxy, is_wrapped
from ..rules.generic import restored

__all__ = ["trace_aten_program", "trace_aten_pair", "trace_graph"]

aten = torch.ops.aten
APPLIED_OP = torch.ops.curvlib.autograd_function.default
MODULE_CALL_OP = torch.ops.curvlib.module_call.default
torch.fx.wrap("input_branch")  # the replay's guards stay calls (fx.wrap patches this module's globals)


def _aten_graph(model: nn.Module, X, output, whole: Optional[Dict[str, str]] = None
                ) -> Tuple[fx.GraphModule, List[str], List[str], List[int], str]:
    """Run the model once under ``make_fx``; returns the ATen graph, the parameter and buffer
    names of its leading placeholders, the positions of the tensor leaves of ``X`` and where
    the loss's tensor was found in the output. ``whole``: the paths of modules recorded as one
    node each (:mod:`curvlib._trace.module_calls`)."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    # (clones: a BatchNorm in train mode updates running statistics in place; the model's stay as they are)
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    leaves, spec = pytree.tree_flatten(as_pytree(X))
    tensor_at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
    keywords = keyword_inputs(model, X)
    chosen: List[str] = []

    def run(p, b, *tensors):
        full = list(leaves)
        for i, t in zip(tensor_at, tensors):
            full[i] = t
        x = pytree.tree_unflatten(full, spec)
        args, kwargs = ((), dict(x)) if keywords else ((x,), {})
        out = torch.func.functional_call(model, (p, b), args, kwargs, strict=False)
        tensor, where = _outputs.select(out, output)
        chosen.append(_outputs.describe_choice(out, where) if where else "")
        return tensor

    inputs = (params, buffers, *[leaves[i] for i in tensor_at])
    # (a value the Python reads from a tensor, ``if mask.all()``, is taken as it is for this input
    # and becomes a guard of the graph: see :func:`input_branch`)
    with recorded_functions() as keys, LOCK, restored(model), without_hooks(model), inference_as_no_grad(), \
            kept_whole(model, whole or {}) as module_keys, module_spans(model, batch_size(X)) as spans, \
            constant_vmaps(), torch.enable_grad(), tracing(TracingContext(FakeTensorMode(allow_fallback_kernels=True))):
        # (the model's own no_grad regions are recorded, not the caller's. The tracing context
        # lends make_fx one fake mode for every node's metadata: without one it builds a new
        # mode per node, each capturing the Python stack, most of a large model's trace time)
        gm = make_fx(run, pre_dispatch=True, _error_on_data_dependent_ops=False)(*inputs)
    _refuse_escaped_transforms(gm, model)
    gm.curvlib_functions, gm.curvlib_modules, gm.curvlib_spans = keys, module_keys, spans
    gm.curvlib_reads = _read_values(gm, pytree.tree_leaves(inputs))
    return gm, list(params), list(buffers), tensor_at, chosen[0]


@contextlib.contextmanager
def constant_vmaps():
    """``torch.vmap`` replaced for the block (an ATen-level trace, under
    :data:`curvlib._core.sync.LOCK`): a function it builds that computes from neither the model's
    inputs nor its parameters and buffers (transformers' attention masks, vmapped over
    ``arange`` index ranges) runs outside the trace, and its value is a constant of the graph,
    as the same mask built without vmap is; one that does runs as it is (refused below)."""
    original = torch.vmap

    def vmap(func, *args, **kwargs):
        built = original(func, *args, **kwargs)

        @functools.wraps(built)
        def call(*inputs, **named):
            mode = get_proxy_mode()
            values = pytree.tree_leaves((inputs, named)) + captured(func)
            if mode is None or any(_from_inputs(v, mode.tracer) for v in values if isinstance(v, Tensor)):
                return built(*inputs, **named)
            with disable_proxy_modes_tracing():
                return built(*inputs, **named)

        return call

    torch.vmap = torch.func.vmap = vmap
    try:
        yield
    finally:
        torch.vmap = torch.func.vmap = original


def _from_inputs(t: Tensor, tracer) -> bool:
    """Whether the traced tensor ``t`` is computed from a placeholder of the trace (an input,
    parameter or buffer)."""
    slot = get_proxy_slot(t, tracer, None)
    if slot is None:
        return False  # a tensor made outside the trace: a constant
    stack, seen = [slot.proxy.node], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            return True
        stack.extend(node.all_input_nodes)
    return False


def _refuse_escaped_transforms(gm: fx.GraphModule, model: nn.Module) -> None:
    """Fail on a graph holding a functorch-wrapped constant: the model calls ``torch.vmap`` in
    ``forward`` (transformers builds attention masks with ``torch.vmap`` when a model combines
    mask functions), and ``make_fx(pre_dispatch=True)`` records the ops inside it on the
    transform's batched tensors, which exist only while it runs: the graph cannot be replayed."""
    for node in gm.graph.nodes:
        value = getattr(gm, node.target, None) if node.op == "get_attr" else None
        if isinstance(value, Tensor) and is_wrapped(value):
            users = ", ".join(f"'{u.name}' ({u.target})" for u in list(node.users)[:2])
            # (not a CurvatureError: the ATen trace failed, the caller keeps fx's trace, and first-order
            # extensions run the model eagerly)
            raise RuntimeError(
                f"Model {type(model).__name__} calls torch.vmap (or another torch.func transform) inside "
                f"its forward, at graph node {users}: curvlib's ATen-level trace cannot record the ops "
                "inside it (they run on the transform's batched tensors). transformers does so to build "
                "attention masks from combined mask functions.")


_READS = (aten.item.default, aten._local_scalar_dense.default, aten.is_nonzero.default)


def _read_values(gm: fx.GraphModule, inputs) -> Dict[str, object]:
    """Node name -> the value the model's Python read from a tensor (``.item()``, ``bool(t)``)."""
    reads = {n for n in gm.graph.nodes if n.target in _READS}
    values: Dict[str, object] = {}
    if not reads:
        return values

    class _Reader(fx.Interpreter):
        def run_node(self, n):
            value = super().run_node(n)
            if n in reads:
                values[n.name] = value
            return value

    with torch.no_grad():
        _Reader(gm).run(*inputs)
    return values


class _Replay(nn.Module):
    """Holds the user's model (``model.``) and an ATen graph; its ``forward`` replays the
    graph on fx proxies (see the module doc). Never run on data."""

    def __init__(self, model: nn.Module, gm: fx.GraphModule, params: List[str], buffers: List[str],
                 tensor_at: List[int], container: bool):
        super().__init__()
        self.model = model
        object.__setattr__(self, "_gm", gm)  # (not a submodule: its graph is read, not traced)
        self._param_order, self._buffer_order, self._tensor_at, self._container = params, buffers, tensor_at, container
        self._owners, self._canonical = owners(model)
        # views of subclassed family modules (curvlib._trace.aten_ops.view_of), registered before the
        # trace (fx's tracer knows the submodules it starts with): id(owner) -> view
        self._views: Dict[int, nn.Module] = {}
        self.view_paths: Dict[str, str] = {}  # view target -> the owner's path in the model
        paths = {id(m): p for p, m in model.named_modules()}
        for m in {id(m): m for ms in self._owners.values() for _, m in ms}.values():
            view = view_of(m)
            if view is not None:
                name = "view__" + paths[id(m)].replace(".", "__")
                self.add_module(name, view)
                self._views[id(m)], self.view_paths[name] = view, paths[id(m)]

    def forward(self, X):
        leaves = pytree.tree_leaves(as_pytree(X)) if self._container else [X]
        values = [_attribute(self.model, n) for n in self._param_order]  # (fx's tracer: get_attr proxies)
        values += [_attribute(self.model, n) for n in self._buffer_order]
        values += [leaves[i] for i in self._tensor_at]
        env: Dict[fx.Node, object] = {}
        placeholders = iter(values)
        names = {}  # placeholder node -> parameter name
        for node in self._gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(placeholders)
                if len(names) < len(self._param_order):
                    names[node] = self._param_order[len(names)]
            elif node.op == "get_attr":
                env[node] = getattr(self._gm, node.target)
            elif node.op == "call_function":
                load = lambda a: fx.node.map_arg(a, lambda n: env[n])  # noqa: E731
                try:
                    env[node] = self._replay(node, load(node.args), load(node.kwargs), names, env)
                except CurvatureError:
                    raise
                except Exception as exc:  # (the fallback says why the ATen trace failed: name the node)
                    raise RuntimeError(f"replaying ATen graph node '{node.name}' ({node.target}): "
                                       f"{type(exc).__name__}: {exc}") from exc
            elif node.op == "output":
                out = fx.node.map_arg(node.args[0], lambda n: env[n])
                return out[0] if isinstance(out, (list, tuple)) else out
            else:  # pragma: no cover - make_fx graphs hold no other ops
                raise CurvatureError(f"unexpected node {node.op} in the ATen graph")

    def _replay(self, node: fx.Node, args, kwargs, names, env):
        target = node.target
        if not has_proxy((args, kwargs)):
            return target(*args, **kwargs)  # constants only (a causal mask): evaluated once
        if target is APPLIED_OP:
            return replay(*args, **kwargs)  # a custom autograd.Function: one node, run by Fn.apply
        if target is MODULE_CALL_OP:
            return replay_module(*args, **kwargs)  # a module kept whole: one call_module node
        if target in _READS:
            return input_branch(args[0], self._gm.curvlib_reads[node.name], node.name)
        if _same_dtype_copy(node):
            return args[0]  # (``x.to(x.dtype)``: no node, so ``x + wpe(arange(T))`` stays affine)
        module = owner_call(node, names, self._owners, self._canonical)
        module = self._views.get(id(module), module)
        if module is not None:
            return module(args[INPUT_ARG[target]])
        for rewrite in (conv1d_linear, matmul_linear, linear_computed_bias):
            linear = rewrite(node, names, env)
            if linear is not None:
                return linear
        return torch_level(target, args, kwargs)


def _same_dtype_copy(node: fx.Node) -> bool:
    """An ``aten.to`` / ``_to_copy`` whose output has its input's dtype and device (make_fx's
    ``val`` metadata): the identity for every derivative."""
    if getattr(node.target, "__name__", "").split(".")[0] not in ("to", "_to_copy") or not node.args:
        return False
    out, x = node.meta.get("val"), getattr(node.args[0], "meta", {}).get("val")
    return (isinstance(out, Tensor) and isinstance(x, Tensor) and out.dtype == x.dtype
            and out.device == x.device and out.shape == x.shape)


def _attribute(model: nn.Module, dotted: str):
    obj = model
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


# ----------------------------------------------------------------------------- entry


def trace_aten_program(model: nn.Module, X, output=None) -> Program:
    """Trace ``model`` at the ATen level on the input ``X`` (:mod:`curvlib._trace.aten`): the program
    serves inputs of ``X``'s signature only. Runs the model once on ``X``; never changes it."""
    param_names: Dict[int, str] = {}
    for name, p in model.named_parameters():
        param_names.setdefault(id(p), name)
    root, graph, chosen, whole = trace_graph(model, X, output)
    opaque = {f"model.{path}": why for path, why in whole.items()}
    program = assemble(root, "model.", graph, None, opaque, param_names, leaf_inputs=not isinstance(X, torch.Tensor))
    for target, path in root.view_paths.items():  # (a view's layer is named as its owner)
        if target in program.layers:
            program.layers[target].path = path
    return dataclasses.replace(program, aten=True, output_choice=chosen, selector=output)


def trace_aten_pair(model: nn.Module, X, output=None) -> Program:
    """:func:`trace_aten_program` on ``X``, with the same model traced on a batch of N + 1 samples
    as its ``sibling`` (planning compares the two batch sizes, :mod:`curvlib._plan.plan`; an
    ATen-level trace has the batch size baked in)."""
    sibling = trace_aten_program(model, with_batch(X, batch_size(X) + 1, real=True), output)
    return dataclasses.replace(trace_aten_program(model, X, output), sibling=sibling)


def trace_graph(model: nn.Module, X, output) -> Tuple[nn.Module, fx.Graph, str, Dict[str, str]]:
    """``(root, graph, where the loss's tensor was found, modules kept whole)``: the model traced
    on ``X`` at the ATen level and replayed by curvlib's fx tracer over a root holding the
    model at ``model.``. A module that reorders rows across the batch is kept whole
    (:mod:`curvlib._trace.module_calls`): the model is then traced a second time."""
    gm, params, buffers, tensor_at, chosen = _aten_graph(model, X, output)
    whole = modules_to_keep_whole(gm, gm.curvlib_spans, model, batch_size(X))
    if whole:
        forget(gm.curvlib_functions)
        forget_modules(gm.curvlib_modules)
        gm, params, buffers, tensor_at, chosen = _aten_graph(model, X, output, whole)
    container = not isinstance(X, Tensor)
    root = _Replay(model, gm, params, buffers, tensor_at, container)
    concrete = {"X": trace_structure(X)} if container else None
    try:
        graph = Tracer({id(model.get_submodule(p)): why for p, why in whole.items()}).trace(root, concrete_args=concrete)
    finally:
        forget(gm.curvlib_functions)
        forget_modules(gm.curvlib_modules)
    graph.curvlib_guarded = bool(gm.curvlib_reads)
    return root, graph, chosen, whole
