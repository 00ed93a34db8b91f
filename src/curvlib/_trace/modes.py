"""What the model's Python switches while it is traced, recorded on the graph's nodes.

* **grad mode**: a node the model runs under its own ``torch.no_grad()``,
  ``torch.set_grad_enabled(False)`` or ``torch.inference_mode()`` gets ``meta["no_grad"]``;
  each value that leaves such a region passes through :func:`stop_gradient`, so it is
  constant for every derivative, as for the model's own backward;
* **autocast**: a node run under ``torch.autocast`` gets ``meta["autocast"]`` and the model is
  refused (curvlib computes in the inputs' dtypes, not autocast's);
* **tensors it creates** (``torch.tensor([...])``): held by their node (:class:`TensorConstant`),
  not stored on the traced module (the user's model) as fx would;
* **augmented assignments**: ``h += p`` is recorded as ``operator.iadd`` (fx's own proxy
  rebinds it to ``h = h + p``).

The caller's grad mode and autocast are switched off while tracing (:class:`~curvlib._trace.tracer.Tracer`),
so that only the model's own are recorded.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Callable

import torch
from torch import fx, nn

from .._core.errors import CurvatureError

__all__ = ["record_modes", "no_autocast", "refuse_autocast", "stop_gradient", "cut_no_grad_regions",
           "InPlaceProxy", "TensorConstant", "inference_as_no_grad"]


def record_modes(node: fx.Node) -> fx.Node:
    """``node``, stamped with the grad mode and autocast state it is created in."""
    if not torch.is_grad_enabled():  # (inference mode disables grad mode too)
        node.meta["no_grad"] = True  # the model runs this node without autograd
    autocast = [d for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d)]
    if autocast:
        node.meta["autocast"] = autocast[0]
    return node


_AUTOCAST_DEVICES = ("cpu", "cuda")


def no_autocast() -> contextlib.ExitStack:
    """The caller's ``torch.autocast`` switched off, so that a node records the model's own."""
    stack = contextlib.ExitStack()
    for device in _AUTOCAST_DEVICES:
        if torch.is_autocast_enabled(device):
            stack.enter_context(torch.autocast(device, enabled=False))
    return stack


def refuse_autocast(graph: fx.Graph, root: nn.Module, prefix: str = "") -> None:
    """Refuse a model whose ``forward`` opens ``torch.autocast``: curvlib runs every node in its
    inputs' dtypes, not in autocast's, so its results would differ from the model's."""
    for node in graph.nodes:
        if node.meta.get("autocast"):
            what = (f"module '{node.target[len(prefix):] if node.target.startswith(prefix) else node.target}' "
                    f"({type(root.get_submodule(node.target)).__name__})"
                    if node.op == "call_module" else f"'{getattr(node.target, '__name__', node.target)}'")
            raise CurvatureError(
                f"The model's forward runs graph node '{node.name}' ({what}) under "
                f"torch.autocast('{node.meta['autocast']}'): curvlib computes every node in its inputs' "
                "dtypes, not in autocast's, so its results would differ from the model's. Cast the "
                "model instead (model.to(torch.bfloat16), explicit .to() calls inside forward), or "
                "call it without autocast."
            )


def stop_gradient(value):
    """``value`` with every tensor in it detached: where a ``torch.no_grad()`` region of the
    model's ``forward`` hands a value to code that runs with autograd."""
    return fx.node.map_aggregate(value, lambda v: v.detach() if isinstance(v, torch.Tensor) else v)


stop_gradient.curvlib_linear = True  # the identity on values: no second derivative (curvlib.rules.elementwise)
stop_gradient.curvlib_cut = True  # no gradient flows through it (curvlib._plan.mixing_ops)


def cut_no_grad_regions(graph: fx.Graph) -> None:
    """Make the model's ``torch.no_grad()`` / ``torch.inference_mode()`` regions constant for
    every derivative, as they are for the model's own backward: each value computed inside one
    (a node with ``meta["no_grad"]``) and read outside it passes through :func:`stop_gradient`.
    Without the cut, curvlib would differentiate through the region, which the model's
    autograd does not (the region's parameters have no gradient there)."""
    for node in list(graph.nodes):
        if not node.meta.get("no_grad") or node.op in ("placeholder", "get_attr", "output"):
            continue
        readers = [u for u in node.users if not u.meta.get("no_grad")]
        if not readers:
            continue
        with graph.inserting_after(node):
            cut = graph.call_function(stop_gradient, (node,))
        for user in readers:
            user.replace_input_with(node, cut)


def _augmented(op: Callable) -> Callable:
    def method(self, other):
        return self.tracer.create_proxy("call_function", op, (self, other), {})

    return method


class InPlaceProxy(fx.Proxy):
    """fx's proxy with the augmented assignments recorded as such (``h += p`` as
    ``operator.iadd(h, p)``): fx's own proxy falls back to ``h = h + p``, and a later read of the
    overwritten tensor under another name would see its old value, not eager PyTorch's."""

    __iadd__ = _augmented(operator.iadd)
    __isub__ = _augmented(operator.isub)
    __imul__ = _augmented(operator.imul)
    __itruediv__ = _augmented(operator.itruediv)


@contextlib.contextmanager
def inference_as_no_grad():
    """``torch.inference_mode()`` inside code ``make_fx`` traces switches grad mode off like
    ``torch.no_grad()`` (make_fx records grad-mode changes as graph nodes, not inference mode),
    so that the region is cut as the model's own backward cuts it (:func:`cut_no_grad_regions`)."""
    cls = torch.autograd.grad_mode.inference_mode
    enter, exit_ = cls.__enter__, cls.__exit__

    def enter_as_no_grad(self):
        self._curvlib_prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(self._curvlib_prev and not self.mode)

    def exit_as_no_grad(self, *exc):
        torch._C._set_grad_enabled(self._curvlib_prev)

    cls.__enter__, cls.__exit__ = enter_as_no_grad, exit_as_no_grad
    try:
        yield
    finally:
        cls.__enter__, cls.__exit__ = enter, exit_


class TensorConstant:
    """The graph target of a tensor the traced code creates (``torch.tensor([1., 2.])``, a
    causal mask the ATen replay evaluated once): called with no arguments, returns it."""

    __name__ = "tensor_constant"

    def __init__(self, value: torch.Tensor):
        self.value = value

    def __call__(self) -> torch.Tensor:
        return self.value
