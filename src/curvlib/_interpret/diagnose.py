"""Why the model's forward fails on ``X``: a :class:`CurvatureError` naming the node and a cause.

The planning passes run the model on a batch shaped like ``X`` (and one with an
extra sample) before any real work. When the model raises there, torch's own
message (``mat1 and mat2 shapes cannot be multiplied (6x3 and 4x5)``) says what
broke but not where or why; this module adds the graph node, its input shapes
and the likely cause: ``X``'s dtype or device against the parameters', an
integer ``X`` fed to a layer that needs floats, or an unbatched ``X``.
"""

from __future__ import annotations

from typing import Dict, Optional

from torch import Tensor, fx

from .._core import inputs as _inputs
from .._core.errors import CurvatureError, missing_forward_mode
from .graph import NodeFailure

__all__ = ["forward_failure", "forward_mode_failure"]


def forward_failure(program, X, params: Dict[str, Tensor], exc: BaseException, batch: int) -> CurvatureError:
    """The error to raise for ``exc``, raised by the model on a batch of ``batch`` samples like ``X``."""
    node = exc.node if isinstance(exc, NodeFailure) else None
    cause = exc.exc if isinstance(exc, NodeFailure) else exc
    n = _inputs.batch_size(X)
    what = f"{type(cause).__name__}: {cause}"
    where = f" at {_describe_node(program, node)}" if node is not None else ""
    if batch != n:
        return CurvatureError(
            f"The model runs on X ({_inputs.describe(X)}) but fails on a batch with one more sample "
            f"in dim 0{where} ({what}). X looks like a single sample without a batch dimension: "
            "curvlib needs the batch in dim 0 of X (e.g. X.unsqueeze(0) for one sample)."
        )
    hint = _likely_cause(program, X, params, node)
    return CurvatureError(
        f"The model's forward fails on X ({_inputs.describe(X)}){where}: {what}."
        + (f"\n{hint}" if hint else "\nCheck that X has the shape, dtype and device the model expects.")
    )


def _describe_node(program, node: fx.Node) -> str:
    """``graph node 'linear' (module 'fc1': Linear(in_features=4, ...))``."""
    if node.op == "call_module":
        module = program.root.get_submodule(node.target)
        path = node.target[len(program.prefix):] if node.target.startswith(program.prefix) else node.target
        return f"graph node '{node.name}' (module '{path or type(module).__name__}': {module})"
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"graph node '{node.name}' ({node.op} {target})"


def _likely_cause(program, X, params: Dict[str, Tensor], node: Optional[fx.Node]) -> str:
    floats = [(name, p) for name, p in params.items() if p.is_floating_point()]
    x_leaves = _inputs.tensors(X)
    for name, p in params.items():
        for x in x_leaves:
            if x.device != p.device:
                return (
                    f"X is on {x.device} but parameter '{name}' is on {p.device}: move X (X.to(device)) "
                    "or the model (model.to(device)) so that they are on the same device."
                )
    if not floats:
        return ""
    name, p = floats[0]
    layer = _describe_node(program, node) if node is not None else "the model"
    for x in x_leaves:
        if x.is_floating_point() and x.dtype != p.dtype:
            return (
                f"X has dtype {x.dtype} but the model's parameters have dtype {p.dtype} (e.g. '{name}'): "
                f"convert X (X.to({p.dtype})) or the model (model.to({x.dtype}))."
            )
    if all(not x.is_floating_point() for x in x_leaves) and node is not None and node.op == "call_module":
        x = x_leaves[0]
        return (
            f"X has dtype {x.dtype}, but {layer} needs floating-point input of the parameters' dtype "
            f"{p.dtype}: convert X (X.to({p.dtype})), or feed integer inputs to an nn.Embedding first."
        )
    return ""


def forward_mode_failure(exc: BaseException, what: str) -> Optional[CurvatureError]:
    """A clear error if ``exc`` is torch's "no forward-mode derivative" for an operation of
    the model (e.g. ``_weight_norm_interface``), raised where ``what`` (extension names)
    runs forward-mode AD; ``None`` for any other error."""
    node = exc.node if isinstance(exc, NodeFailure) else None
    cause = exc.exc if isinstance(exc, NodeFailure) else exc
    if not missing_forward_mode(cause):
        return None
    where = f" (graph node '{node.name}')" if node is not None else ""
    return CurvatureError(
        f"{what}: forward-mode derivatives (torch.func.jvp) of the model's operations are needed, but "
        f"torch has none for one of them{where}: {str(cause).splitlines()[0]} (Reverse-mode second "
        "derivatives of such kernels are not reliable: weight_norm's is wrong in torch 2.13.) Use the GGN "
        "diagonals, square roots and Kronecker factors for this model, or write the operation without it "
        "(e.g. weight normalisation as w = g * v / v.norm(...) in a parametrization)."
    )
