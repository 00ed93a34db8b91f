"""Dropout in training mode: random masks, drawn explicitly and reproducibly.

A model in training mode (every new module starts in it) with dropout has a
random forward pass, so its gradient and curvature are random too (a
legitimate "random GGN"). curvlib keeps that, but makes it explicit:

* ``f`` warns once per :func:`curvlib.curvature` object when the model holds
  active dropout;
* each call draws **one** seed, from ``f(..., generator=g)`` or the global
  random state (so ``torch.manual_seed`` reproduces a call), and every dropout
  node draws its mask from a private generator seeded with it. Every forward
  run of the call (the main pass, KFRA's, the block products' re-runs, also
  when they are evaluated later) therefore uses the very same masks, and
  concurrent calls in other threads do not disturb them.

Masks follow PyTorch's distributions exactly (``bernoulli(1 − p)`` noise,
``/ (1 − p)``; channel-wise noise for ``dropout1d/2d/3d`` and
``feature_alpha_dropout``; the SELU-preserving affine map for alpha dropout),
not its random streams. A layer without a hand-written rule (the generic
rule) recomputes its forward per sample, so active dropout *inside* such a
layer is refused: those masks could not be the same.
"""

from __future__ import annotations

import inspect
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch.overrides import TorchFunctionMode

from .calls import argument
from .errors import CurvatureError
from .tensors import is_wrapped

__all__ = ["active", "draw_seed", "new_generator", "DropoutSeed", "warning", "run_node", "use_noise", "DropoutMode", "generic_dropout", "NOISES"]

# function -> (kind, default of `training`)
_FUNCTIONS: Dict[object, Tuple[str, bool]] = {
    F.dropout: ("plain", True), F.dropout1d: ("1d", True), F.dropout2d: ("2d", True),
    F.dropout3d: ("3d", True), F.alpha_dropout: ("alpha", False),
    F.feature_alpha_dropout: ("feature_alpha", False),
}
_MODULES = (
    (nn.Dropout, "plain"), (nn.Dropout1d, "1d"), (nn.Dropout2d, "2d"), (nn.Dropout3d, "3d"),
    (nn.AlphaDropout, "alpha"), (nn.FeatureAlphaDropout, "feature_alpha"),
)
_ALPHA = 1.7580993408473766  # -SELU scale · alpha: the value a dropped SELU unit takes


def _module_kind(module: nn.Module) -> Optional[str]:
    for cls, kind in _MODULES:
        if type(module) is cls:
            return kind
    return None


def _function_args(fn, args, kwargs) -> Tuple[Tensor, float, bool, bool]:
    """``(input, p, training, inplace)`` of a functional dropout call."""
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    return a["input"], float(a["p"]), bool(a["training"]), bool(a["inplace"])


def node_dropout(program, node: fx.Node) -> Optional[str]:
    """The dropout kind of a graph node (module or function), or ``None``."""
    if node.op == "call_module" and node.target not in program.layers:
        return _module_kind(program.root.get_submodule(node.target))
    if node.op == "call_function" and node.target in _FUNCTIONS:
        return _FUNCTIONS[node.target][0]
    return None


def active(program) -> List[str]:
    """Descriptions of the dropout that is active in the model's current modes."""
    found = []
    if program.graph is not None:
        for node in program.graph.nodes:
            kind = node_dropout(program, node)
            if kind is None:
                continue
            if node.op == "call_module":
                module = program.root.get_submodule(node.target)
                if module.training and module.p > 0:
                    found.append(f"'{node.target[len(program.prefix):]}' ({module})")
            else:
                p, training = _static_args(node)
                if training and (p is None or p > 0):
                    found.append(f"graph node '{node.name}' ({node.target.__name__})")
    else:
        found += [f"'{path}' ({m})" for path, m in program.root.named_modules()
                  if _module_kind(m) and m.training and m.p > 0]
    return found + [f"{where} (inside layer '{layer}')" for layer, where in generic_dropout(program)]


def _static_args(node: fx.Node) -> Tuple[Optional[float], bool]:
    """``(p, training)`` of a functional dropout node where they are constants (``None``: traced)."""
    fn = node.target
    try:
        bound = inspect.signature(fn).bind(*node.args, **node.kwargs)
    except TypeError:
        return None, True
    bound.apply_defaults()
    p, training = bound.arguments["p"], bound.arguments["training"]
    return (float(p) if isinstance(p, (int, float)) else None), (training if isinstance(training, bool) else True)


def generic_dropout(program) -> List[Tuple[str, str]]:
    """``(layer path, description)`` of active dropout inside layers run by the generic rule
    (whose family runs the module's own code, :attr:`curvlib._core.family.Family.runs_own_code`)."""
    found = []
    for layer in program.layers.values():
        if not layer.family.runs_own_code:
            continue
        for path, m in layer.module.named_modules():
            where = f"{layer.path}.{path}".strip(".") or layer.path
            if _module_kind(m) and m.training and m.p > 0:
                found.append((layer.path, f"'{where}' ({m})"))
            elif isinstance(m, nn.MultiheadAttention) and m.training and m.dropout > 0:
                found.append((layer.path, f"'{where}' (MultiheadAttention(dropout={m.dropout}))"))
    return found


def refuse_in_generic(program, sites) -> None:
    """Refuse active dropout inside a layer the generic rule recomputes per sample (module doc)."""
    found = dict(generic_dropout(program))
    for site in sites:
        if site.where in found:
            raise CurvatureError(
                f"Layer '{site.where}' has no hand-written curvlib rule and holds dropout in training "
                f"mode ({found[site.where]}): curvlib's generic rule recomputes such a layer per sample, "
                "which cannot reuse the forward's random mask. Call model.eval() (or set its dropout "
                "to 0), or freeze the layer's parameters."
            )


def warning(found: List[str]) -> str:
    return (
        f"The model has dropout in training mode ({', '.join(found[:3])}{', ...' if len(found) > 3 else ''}): "
        "every call of curvlib's f draws new masks, so its results are random (a random GGN). curvlib "
        "draws one seed per call from f(..., generator=...) or the global random state, and uses the same "
        "masks for every pass of that call. Call model.eval() for deterministic results."
    )


def draw_seed(generator: Optional[torch.Generator]) -> int:
    """One seed for the call's masks (a host read). Under ``vmap(randomness="different")``
    the draw is batched, one per member, which a host int cannot hold: refused."""
    device = generator.device if generator is not None else "cpu"
    seed = torch.randint(0, 2**62, (1,), generator=generator, device=device)
    if is_wrapped(seed):
        raise CurvatureError(
            "Dropout in training mode under torch.func.vmap(randomness='different'): curvlib draws "
            "one seed per call for the masks of all its passes, not one per member. Use "
            "randomness='same' (every member the same masks, each equal to its own call with the "
            "same random state), loop over members, or call model.eval()."
        )
    return int(seed.item())


#: A call's dropout seed and the device its masks are drawn on (``None``: no active dropout),
#: carried by the :class:`~curvlib._core.site.Recorder` of every forward run of that call.
DropoutSeed = Optional[Tuple[int, torch.device]]


def new_generator(seed: DropoutSeed) -> Optional[torch.Generator]:
    """A fresh generator for one forward run of a call (``None`` without active dropout): every
    run of the same call draws the same masks."""
    if seed is None:
        return None
    value, device = seed
    return torch.Generator(device=device).manual_seed(value)


#: env key under which :func:`curvlib._interpret.graph.run_graph` keeps each dropout node's noise
#: (KFRA's recursion needs the very mask of the forward it reuses).
NOISES = object()


def run_node(program, node: fx.Node, kind: str, args, kwargs, generator: torch.Generator, noises: dict) -> Tensor:
    """A dropout node's value with its noise drawn from ``generator`` (kept in ``noises[node]``)."""
    if node.op == "call_module":
        module = program.root.get_submodule(node.target)
        x = argument(args, kwargs, 0, "input")
        p, training, inplace = module.p, module.training, getattr(module, "inplace", False)
    else:
        x, p, training, inplace = _function_args(node.target, args, kwargs)
    if not training or p == 0 or isinstance(x, torch._subclasses.FakeTensor):  # (shape passes: no draws)
        return x
    noises[node] = (kind, p, draw_noise(kind, x, p, generator))
    return use_noise(kind, x, p, noises[node][2], inplace)


def apply(kind: str, x: Tensor, p: float, training: bool, inplace: bool, generator: torch.Generator) -> Tensor:
    """PyTorch's dropout of ``kind`` (module doc) with noise drawn from ``generator``."""
    if not training or p == 0 or isinstance(x, torch._subclasses.FakeTensor):
        return x
    return use_noise(kind, x, p, draw_noise(kind, x, p, generator), inplace)


def draw_noise(kind: str, x: Tensor, p: float, generator: torch.Generator) -> Tensor:
    """``bernoulli(1 − p)`` noise of the kind's shape (see :func:`_noise_shape`)."""
    shape = _noise_shape(kind, x)
    return torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p, generator=generator)


def use_noise(kind: str, x: Tensor, p: float, noise: Tensor, inplace: bool = False) -> Tensor:
    """``x ⊙ noise / (1 − p)``; alpha dropout: ``a (x ⊙ noise) + (noise − 1) α a + α a p``
    with ``a = ((α² p + 1)(1 − p))^(−1/2)`` (PyTorch's ``_dropout_impl``)."""
    if p == 1:
        return x.mul_(0) if inplace else x * 0
    if kind in ("alpha", "feature_alpha"):
        a = 1.0 / ((_ALPHA**2 * p + 1) * (1 - p)) ** 0.5
        shift = (noise - 1) * (_ALPHA * a) + _ALPHA * a * p
        return x.mul_(noise * a).add_(shift) if inplace else x * (noise * a) + shift
    scaled = noise / (1 - p)
    return x.mul_(scaled) if inplace else x * scaled


def _noise_shape(kind: str, x: Tensor) -> Tuple[int, ...]:
    """Element-wise noise, or one draw per sample and channel (PyTorch's ``make_feature_noise``);
    ``dropout1d``/``dropout3d`` treat an input without a batch dim as one sample."""
    if kind in ("plain", "alpha"):
        return tuple(x.shape)
    batched = {"1d": x.dim() == 3, "3d": x.dim() == 5}.get(kind, True)
    if not batched:
        return (x.shape[0],) + (1,) * (x.dim() - 1)
    return tuple(x.shape[:2]) + (1,) * (x.dim() - 2)


class DropoutMode(TorchFunctionMode):
    """Routes functional dropout calls to :func:`apply` (for models run eagerly, without a graph)."""

    def __init__(self, generator: torch.Generator):
        super().__init__()
        self.generator = generator

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        spec = _FUNCTIONS.get(func)
        if spec is None:
            return func(*args, **kwargs)
        x, p, training, inplace = _function_args(func, args, kwargs)
        return apply(spec[0], x, p, training, inplace, self.generator)
