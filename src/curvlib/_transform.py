"""``curvature(model, lossfn, extensions)``: the transform.

It checks its arguments, traces the model once, and returns a pure function
``f(X, y, params=None) -> dict``. Nothing is stored on the model or the loss.
"""

from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from . import losses
from ._engine import FIRST_ORDER, Plan, first_order, has_inplace, module_checks, forward_with_probes, make_plan
from ._independence import refuse_mixing
from ._kfra import chain_nodes, kfra
from ._products import products, replay_rng, rng_state
from ._secondorder import check_second_order, second_order
from ._untraced import run_eager
from .extensions.secondorder import SecondOrder
from . import _residuals
from ._errors import CurvatureError, CurvatureTypeError
from ._program import Program, trace_program
from .extensions._base import Extension

__all__ = ["curvature"]


def _check_extensions(extensions) -> tuple:
    if isinstance(extensions, Extension):
        extensions = [extensions]
    if not isinstance(extensions, (list, tuple)):
        raise CurvatureTypeError(
            "extensions must be a list or tuple of curvlib.extensions instances, got "
            f"{type(extensions).__name__}."
        )
    seen: Dict[str, Extension] = {}
    for ext in extensions:
        if isinstance(ext, type) and issubclass(ext, Extension):
            raise CurvatureTypeError(
                f"extensions holds the class {ext.__name__}, not an instance; pass "
                f"{ext.__name__}() instead."
            )
        if not isinstance(ext, Extension):
            raise CurvatureTypeError(
                f"extensions holds {ext!r} of type {type(ext).__name__}, which is not a "
                "curvlib extension; use instances from curvlib.extensions, e.g. BatchGrad()."
            )
        if not ext.name:
            raise CurvatureTypeError(
                f"{type(ext).__name__} is a base class, not an extension; pass e.g. BatchGrad()."
            )
        if ext.name in ("loss", "grad"):
            raise CurvatureError(f"Extension name {ext.name!r} is reserved for curvlib's own results.")
        if ext.name in seen:
            raise CurvatureError(
                f"Two extensions have the same name {ext.name!r} ({seen[ext.name]!r} and "
                f"{ext!r}); their results would overwrite each other. Pass each once."
            )
        seen[ext.name] = ext
    return tuple(extensions)


def _check_params(model: nn.Module, params: object, all_params: Dict[str, Tensor]) -> Dict[str, Tensor]:
    if not isinstance(params, Mapping):
        raise CurvatureTypeError(
            f"params must be a dict mapping parameter names to tensors, got {type(params).__name__}."
        )
    for name, value in params.items():
        if name not in all_params:
            close = [n for n in all_params if n.split(".")[-1] == str(name).split(".")[-1]][:5]
            raise CurvatureError(
                f"params has an entry {name!r} that is not a parameter of the model "
                f"({type(model).__name__}); valid names are those of model.named_parameters()"
                + (f", e.g. {close}" if close else f": {list(all_params)[:10]}") + "."
            )
        if not isinstance(value, Tensor):
            raise CurvatureTypeError(
                f"params[{name!r}] must be a tensor, got {type(value).__name__}."
            )
        expected = tuple(all_params[name].shape)
        if tuple(value.shape) != expected:
            raise CurvatureError(
                f"params[{name!r}] has shape {tuple(value.shape)}, but the model's parameter "
                f"has shape {expected}."
            )
    return dict(params)


def curvature(
    model: nn.Module,
    lossfn: nn.Module,
    extensions: Sequence[Extension] = (),
    process_group: object = None,
    chunk_size: Union[int, str, None] = "auto",
    batch_chunk_size: Optional[int] = None,
) -> Callable[..., Dict[str, object]]:
    """Turn a model and a loss into a function returning gradients and curvature.

    !!! Example
        ```python
        f = curvature(model, nn.CrossEntropyLoss(), [BatchGrad(), BatchL2Grad()])
        qs = f(X, y)
        qs["loss"], qs["grad"]["0.weight"], qs["grad_batch"]["0.weight"]  # [N, *p.shape]
        ```

    Args:
        model: any ``nn.Module`` whose forward treats samples independently
            (the batch in dim 0 of its input and output). It is traced once
            with torch.fx and never changed.
        lossfn: ``nn.MSELoss``, ``nn.CrossEntropyLoss`` or ``nn.BCEWithLogitsLoss``
            with ``reduction="mean"`` or ``"sum"``.
        extensions: instances from :mod:`curvlib.extensions`.
        chunk_size: at most this many columns (classes, Monte-Carlo samples,
            residual columns) are pulled back through the model at once, which
            bounds the memory of the exact second-order quantities; the results
            do not depend on it. ``"auto"`` (default): as many as fit in
            :data:`AUTO_CHUNK_BYTES` of pulled-back site outputs
            (:data:`AUTO_CHUNK_BYTES_CPU` on a CPU unless a batch diagonal is
            requested): all columns for small models, a few for convolutional
            ones, where that is also faster. ``None``: all at once.
        batch_chunk_size: at most this many samples are processed at once: the
            batch is cut into slices whose results are combined into those of
            the whole batch (see :mod:`curvlib._chunking`), so memory follows
            the slice size. Results equal the unchunked ones up to float
            rounding (Monte-Carlo ones have the same distribution). Not for
            KFRA and the block products (refused). ``None``: the whole batch.
        process_group: a ``torch.distributed`` process group: every rank calls
            ``f`` on its local batch and gets the quantities of the global batch
            (see :mod:`curvlib.distributed`). ``None``: one process.

    Returns:
        ``f(X, y, params=None)`` returning a plain dict with ``"loss"`` (0-dim),
        ``"grad"`` (name -> gradient) and, per extension, ``ext.name`` (name ->
        quantity). ``params`` (name -> tensor) replaces the model's parameters;
        quantities are then returned for exactly its entries. ``f`` is a pure
        function of ``(X, y, params)`` and composes with ``torch.func.vmap``.

    Raises:
        CurvatureTypeError: an argument has the wrong type.
        CurvatureError: anything else curvlib cannot handle, named in the message.
    """
    if not isinstance(model, nn.Module):
        raise CurvatureTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    spec = losses.loss_spec(lossfn)
    exts = _check_extensions(extensions)
    computed = exts
    if batch_chunk_size is not None and any(e.name == "variance" for e in exts) and not any(
        e.name == "sum_grad_squared" for e in exts
    ):
        # slices combine Σ g² exactly; the variance is formed once from the totals
        from .extensions import SumGradSquared

        computed = tuple(exts) + (SumGradSquared(),)
    first_exts = [e for e in computed if not isinstance(e, SecondOrder)]
    second_exts = [e for e in computed if isinstance(e, SecondOrder)]
    unknown = [e for e in first_exts if e.name not in FIRST_ORDER]
    if unknown:
        raise CurvatureError(
            f"Extension {unknown[0]!r} is not a curvlib extension this version computes."
        )
    if chunk_size is not None and chunk_size != "auto" and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise CurvatureError(f"chunk_size must be a positive int, 'auto' or None, got {chunk_size!r}.")
    chunk_kinds = None
    if batch_chunk_size is not None:
        from ._chunking import check_batch_chunk_size

        chunk_kinds = check_batch_chunk_size(batch_chunk_size, computed)
    program = trace_program(model)
    # Models fx cannot trace run eagerly, with their layers redirected to curvlib's rules
    # (first order only: second order needs the graph and is refused below).
    runner = run_eager if program.graph is None else None
    if second_exts and program.graph is None:
        raise CurvatureError(
            f"{type(second_exts[0]).__name__} needs the model's computation graph, but model "
            f"{type(model).__name__} could not be traced with torch.fx:\n  {program.trace_error}\n"
            "First-order extensions do not need the graph."
        )
    needs_kfra = any(e.quantity == "kfra" for e in second_exts)
    if needs_kfra:
        chain_nodes(program)  # refuse branching graphs before any work
    hessian_needed = any(e.quantity in ("hessian_diag", "hessian_batch_diag", "pchmp") for e in second_exts)
    residual_nodes = (
        _residuals.residual_plan(program, _shared_linear_layers(program)) if hessian_needed else {}
    )
    plans: Dict[tuple, Plan] = {}
    checks = module_checks(program) if program.graph is not None else []
    direct = not has_inplace(program)  # differentiate w.r.t. site outputs, not zero probes

    def f(X: Tensor, y: Tensor, params: Optional[Mapping[str, Tensor]] = None) -> Dict[str, object]:
        if not isinstance(X, Tensor):
            raise CurvatureTypeError(f"X must be a torch.Tensor, got {type(X).__name__}.")
        if X.dim() == 0:
            raise CurvatureError("X is a scalar; it needs the batch in dim 0.")
        if not isinstance(y, Tensor):
            raise CurvatureTypeError(f"y must be a torch.Tensor, got {type(y).__name__}.")
        if y.dim() == 0 or y.shape[0] != X.shape[0]:
            raise CurvatureError(
                f"y has shape {tuple(y.shape)} but X has batch size {X.shape[0]}; y needs "
                "the same batch size in dim 0."
            )
        all_params = {name: p for name, p in model.named_parameters()}
        if params is None:
            trainable = [n for n, p in all_params.items() if p.requires_grad]
            values = {n: p.detach() for n, p in all_params.items()}
        else:
            given = _check_params(model, params, all_params)
            trainable = [n for n in all_params if n in given]
            values = {n: (given[n] if n in given else p.detach()) for n, p in all_params.items()}
        for check in checks:  # (the eager runner checks modules as they are called)
            check()
        key = (
            tuple(X.shape), X.dtype, X.device.type,
            tuple((n, tuple(v.shape), v.dtype) for n, v in values.items()),
            frozenset(trainable),
        )
        plan = plans.get(key)
        if plan is None or runner is not None:  # an untraced model's path may change per call
            plan = plans[key] = make_plan(
                program, X, values, frozenset(trainable), residual_nodes, runner=runner
            )
        # Targets and extensions are checked against the plan: before any work.
        losses.check_targets(spec, torch.empty(plan.out_shape, dtype=plan.out_dtype, device="meta"), y)
        if second_exts:
            check_second_order(
                second_exts, plan.sites, trainable, [],
                {layer.path: layer.kind for layer in program.layers.values()},
            )
        # Samples mixed inside the model: refuse what needs them independent (curvlib._independence).
        refuse_mixing(plan, computed, program, X, values, frozenset(trainable), runner, batch_chunk_size is not None)
        rng = rng_state(X.device)

        lin = forward_with_probes(
            program, plan, X, values, frozenset(trainable), residual_nodes, runner=runner, direct=direct,
            keep_values=needs_kfra,
        )
        if lin.pull_loss is not None:  # plain autograd: one backward from the loss
            loss, (gs, residual_grads) = lin.pull_loss(
                lambda out: losses.loss_value(spec, out, y), retain=bool(second_exts)
            )
        else:
            loss, g_out = _loss_and_output_gradient(spec, lin.out, y)
            gs, residual_grads = lin.pull(g_out)
        quantities = first_order(
            lin.sites, gs, trainable, values, [e.name for e in first_exts], X.shape[0]
        )
        result: Dict[str, object] = {"loss": loss.detach() if losses._is_concrete(loss) else loss}
        result.update(quantities)
        if second_exts:
            product = products(
                program, spec, X, y, values, residual_nodes, lin, residual_grads, rng, frozenset(trainable)
            )

            def kfra_factors():
                reduce = None
                if process_group is not None:
                    from .distributed import kfra_reducer

                    m_local = y.numel() if spec.reduction == "mean" else 1
                    reduce = kfra_reducer(spec, process_group, X.shape[0], m_local)
                if lin.values is not None:  # reuse the forward just run
                    return kfra(program, spec, X, y, trainable, values, lin.sites, reduce=reduce,
                                forward=(lin.out, lin.values))
                with replay_rng(rng, X.device):
                    return kfra(program, spec, X, y, trainable, values, lin.sites, reduce=reduce)

            result.update(
                second_order(
                    lin, spec, y, second_exts, trainable, values, X.shape[0],
                    residual_grads, product, kfra_factors,
                    chunk_size=_auto_chunk_size(plan, second_exts, X.device.type) if chunk_size == "auto" else chunk_size,
                )
            )
        return result

    if chunk_kinds is not None:
        from ._chunking import over_samples

        f = over_samples(f, spec, chunk_kinds, batch_chunk_size, drop=computed[len(exts):])
    if process_group is not None:
        from .distributed import aggregated

        return aggregated(f, spec, exts, process_group)
    return f


#: ``chunk_size="auto"``: the pulled-back site outputs of one chunk of columns
#: (``[chunk, *site output]`` for every site) take at most this many bytes ...
AUTO_CHUNK_BYTES = 256 * 2**20
#: ... or this many on a CPU when no batch diagonal is requested: there, chunks of
#: a few columns stay in cache and are faster as well as smaller (3c3d, C = 10:
#: DiagGGNExact 9.2x -> 8.0x a backward, 530 -> 194 MiB; KFLR 6.7x -> 5.2x).
#: Batch diagonals sum ``Σ_v m_v²`` over all columns of a chunk before one outer
#: product per sample, so they keep the larger chunks.
AUTO_CHUNK_BYTES_CPU = 32 * 2**20


def _auto_chunk_size(plan: Plan, exts: Sequence = (), device: str = "cuda") -> int:
    """Columns per chunk so that their site gradients fit in the byte budget."""
    budget = AUTO_CHUNK_BYTES
    batch_diagonal = any(getattr(e, "quantity", None) in ("batch_diag", "hessian_batch_diag") for e in exts)
    if device == "cpu" and not batch_diagonal:
        budget = min(budget, AUTO_CHUNK_BYTES_CPU)
    per_column = 0
    for shape, dtype in zip(plan.site_shapes, plan.site_dtypes):
        numel = 1
        for size in shape:
            numel *= size
        per_column += numel * torch.empty((), dtype=dtype).element_size()
    return max(1, budget // max(per_column, 1))


def _loss_and_output_gradient(spec, out: Tensor, y: Tensor):
    """``L`` and ``∂L/∂out``: plain autograd outside torch.func transforms, ``vjp`` inside."""
    if torch._C._functorch.maybe_current_level() is None:
        leaf = out.detach().requires_grad_(True)
        with torch.enable_grad():
            loss = losses.loss_value(spec, leaf, y)
        (g_out,) = torch.autograd.grad(loss, leaf)
        return loss.detach(), g_out
    loss, pullback = torch.func.vjp(lambda o: losses.loss_value(spec, o, y), out)
    return loss, pullback(torch.ones_like(loss))[0]


def _shared_linear_layers(program: Program) -> frozenset:
    """Linear layers whose weight is used by more than one site (calls or direct reads)."""
    counts: Dict[str, int] = {}
    for node in program.graph.nodes:
        layer = program.layers.get(node.target) if node.op == "call_module" else None
        if layer is not None:
            for name in set(layer.names.values()):
                counts[name] = counts.get(name, 0) + 1
    for use in program.functional.values():
        for name in use.params:
            counts[name] = counts.get(name, 0) + 1
    return frozenset(
        target for target, layer in program.layers.items()
        if layer.kind == "linear" and counts.get(layer.names.get("weight"), 0) > 1
    )
