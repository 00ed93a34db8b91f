"""A model and its loss as pure functions of the parameters, one batch at a time: what the
whole-network operators (:mod:`curvlib.operators`) multiply with.

:class:`Network` runs stage 1 of :mod:`curvlib._transform.entry` (the trace) once; its
:meth:`Network.batch` runs stages 2-3 (inputs, plan, every refusal) for one ``(X, y)`` and
returns a :class:`Batch`: the forward ``θ ↦ f(X; θ)`` through the traced program (code under
``no_grad`` inside the model constant, as in its own backward; dropout masks fixed by the
batch's draw), the loss ``L(θ) = c·Σ_n ℓ(f(x_n; θ), y_n)`` and its Hessian with respect to the
output, ``c·∇²ℓ`` per sample in closed form (:func:`curvlib.losses.curvature_at`). The same
front end as ``curvature``: every model it takes, wrapped or not, with the same conventions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Mapping, Optional, Tuple

import torch
from torch import Tensor, nn

from .. import losses
from .._core import buffers as _buffers, inputs as _inputs
from .._core.errors import CurvatureError, missing_forward_mode
from .._core.tensors import inside_transform
from .._core.site import Recorder
from .._evaluate.products import replay_rng, rng_state
from .._interpret.graph import NodeFailure, run_graph
from .._plan.checks import CallContext
from .entry import CurvatureCall, Setup
from .failures import internal_failure

__all__ = ["Network", "Batch", "translated", "lacks_forward_mode"]


class Network:
    """``model`` and ``lossfn`` traced once; ``output`` selects the tensor of a container output
    (as ``curvature``'s). Nothing on the model changes."""

    def __init__(self, model: nn.Module, lossfn, output=None):
        self.setup = Setup(model, lossfn, (), None, None, None, output)
        self.runner = CurvatureCall(self.setup)

    @property
    def spec(self) -> losses.LossSpec:
        return self.setup.spec

    @property
    def model(self) -> nn.Module:
        return self.setup.model

    def batch(self, X, y, params: Optional[Mapping[str, Tensor]] = None,
              buffers: Optional[Mapping[str, Tensor]] = None,
              generator: Optional[torch.Generator] = None) -> "Batch":
        """Stages 2-3 for ``(X, y)``; ``generator`` draws the batch's dropout masks."""
        call = translated(self.model, lambda: self.runner.context(X, y, params, generator, buffers))
        return Batch(self, call, rng_state(call.device))


@dataclass(frozen=True)
class Batch:
    """One batch of a :class:`Network`: its checked inputs and plan (``call``) and the random
    state its forward replays (``rng``), so every evaluation is the same function."""

    network: Network
    call: CallContext
    rng: tuple

    @property
    def trainable(self) -> Tuple[str, ...]:
        """The parameters whose curvature is wanted (every ``requires_grad`` one, or ``params``' entries)."""
        return self.call.trainable

    @property
    def values(self) -> Mapping[str, Tensor]:
        return self.call.values

    @property
    def size(self) -> int:
        return _inputs.batch_size(self.call.X)

    def normaliser(self) -> Optional[float]:
        """``M`` with ``c = 1/M`` (``"mean"``), 1 (``"sum"``), ``None`` for a loss curvlib cannot
        count (:func:`curvlib.losses.normaliser`)."""
        return losses.normaliser(self.network.spec, self.call.y)

    def output(self, values: Mapping[str, Tensor]) -> Tensor:
        """``f(X; θ)`` with ``values`` replacing those parameters (any subset)."""
        merged = dict(self.call.values)
        merged.update(values)
        rec = Recorder(None, dropout_seed=self.call.dropout_seed)  # the batch's masks
        model, call = self.network.model, self.call
        with _buffers.using(model, call.buffers), replay_rng(self.rng, call.device):
            try:
                return run_graph(call.program, call.X, merged, frozenset(), rec)
            except (NodeFailure, NotImplementedError) as exc:
                raise self.network.runner.failure(call, exc) from exc

    def loss(self, out: Tensor) -> Tensor:
        """``L = c·Σ_n ℓ(out_n, y_n)``, by the user's loss."""
        value = losses.loss_value(self.network.spec, out, self.call.y)
        if not isinstance(value, Tensor) or value.dim() != 0:
            raise CurvatureError(
                f"lossfn {self.network.spec.name} returned {getattr(value, 'shape', type(value).__name__)}, "
                "not a scalar: curvlib needs the sum or mean over samples of per-sample terms.")
        return value

    def loss_hessian(self, out: Tensor, check: bool = False):
        """``c·∇²ℓ`` at ``out``, per sample (``matvec``, ``sampled_roots``); ``check``: refuse a
        generic loss that couples samples."""
        return losses.curvature_at(self.network.spec, out, self.call.y, check=check, negative=self.call.negative)

    def loss_derivative(self, out: Tensor, along: Optional[Tensor] = None) -> Tensor:
        r"""The loss's gradient $\nabla_f L$ at ``out`` (``along`` None), or its Hessian's product
        $\nabla^2_f L \cdot u$ with ``along = u`` (``out``'s shape), a few samples at a time where
        the loss is a cross-entropy or a squared error: so the temporaries of the softmax and of
        the loss's backward are a chunk's size, not the output's. ``L = (1/M) Σ_n ℓ_n`` and a
        chunk ``s`` of samples has its own loss ``L_s = (1/M_s) Σ_{n∈s} ℓ_n`` (``M`` the
        normaliser, 1 for ``"sum"``), so ``∂L/∂f_s = (M_s/M) ∂L_s/∂f_s``, the same for the
        Hessian. The whole output at once for one sample, another loss, or a chunk that counts
        nothing (``M_s = 0``)."""
        spec, y = self.network.spec, self.call.y
        per_sample = spec.splits_by_sample and out.dim() > 1 and y.shape[:1] == out.shape[:1]
        chunks = _sample_chunks(out.shape[0], out.numel()) if per_sample else []
        whole = losses.normaliser(spec, y) if len(chunks) > 1 else None
        counts = [losses.normaliser(spec, y[s]) for s in chunks] if whole else []
        if not whole or not all(counts):
            if along is None:
                return _gradient(self.loss, out)
            return self.loss_hessian(out).matvec(along.unsqueeze(0))[0]
        result = torch.empty_like(out)
        for s, count in zip(chunks, counts):
            if along is None:
                part = _gradient(lambda o: losses.loss_value(spec, o, y[s]), out[s])
            else:
                hessian = losses.curvature_at(spec, out[s], y[s], check=False, negative=self.call.negative)
                part = hessian.matvec(along[s].unsqueeze(0))[0]
            torch.mul(part, count / whole, out=result[s])
            del part
        return result


def _gradient(loss_of: Callable[[Tensor], Tensor], out: Tensor) -> Tensor:
    """``∇_f loss_of(f)`` at ``out``, by torch.func inside a transform, else by one plain backward
    (torch.func's ``grad`` sets up a transform level and wraps every tensor, which costs several
    times a small loss's backward)."""
    if inside_transform(out):
        return torch.func.grad(loss_of)(out)
    with torch.enable_grad():
        leaf = out.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(loss_of(leaf), leaf, allow_unused=True)
    return torch.zeros_like(out) if g is None else g


#: Output entries per chunk of samples in ``Batch.loss_derivative``: an output up to this size
#: is taken whole (on a small model a chunk's calls cost more than its temporaries save).
LOSS_CHUNK_ENTRIES = 1 << 22


def _sample_chunks(n: int, entries: int, most: int = 8) -> List[slice]:
    """``n`` samples of ``entries`` output entries in all, in consecutive slices of equal size (the
    last smaller) of about ``LOSS_CHUNK_ENTRIES`` entries each, at most ``most`` of them."""
    count = max(1, min(most, n, -(-entries // LOSS_CHUNK_ENTRIES)))
    size = -(-n // count)
    return [slice(k, min(k + size, n)) for k in range(0, n, size)]


def translated(model: nn.Module, work: Callable[[], object]):
    """``work()``, with curvlib's internal failures turned into a :class:`CurvatureError` naming the model."""
    try:
        return work()
    except Exception as exc:
        failure = internal_failure(exc, model)
        if failure is None:
            raise
        raise failure from exc


def lacks_forward_mode(exc: Optional[BaseException]) -> bool:
    """Whether ``exc``, or an error it was raised from, is torch's "no forward-mode derivative"
    for one of the model's operations (e.g. ``_weight_norm_interface``, fused attention on CPU)."""
    while exc is not None:
        cause = exc.exc if isinstance(exc, NodeFailure) else exc
        if missing_forward_mode(cause):
            return True
        exc = exc.__cause__
    return False
