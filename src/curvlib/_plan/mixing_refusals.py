"""Refusing a call whose model mixes samples, with the message that says what still works.

The verdicts are :mod:`curvlib._plan.independence`'s (structural, cached with the plan;
per call for indexing by the input's values; numeric on first use); these functions ask
for them only when an extension needs independent samples (``independent_samples``) or
``batch_chunk_size`` splits the batch.
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from .._core.errors import CurvatureError


def refuse_mixing(plan, extensions: Sequence, program, X: Tensor, params, trainable, runner=None,
                  chunked: bool = False) -> None:
    """Raise :class:`CurvatureError` if the model mixes samples and an extension (or
    ``batch_chunk_size``, which splits the batch) needs them independent.

    Called before any work; the structural verdict is cached with the plan, the
    numeric one is computed on first use.
    """
    found, wanted = _wanted(plan, extensions, chunked)
    if found is None:
        return
    problem = (found.problem or found.per_call(program, X, params, trainable)
               or found.numeric(program, plan, X, params, trainable, runner))
    if problem:
        raise CurvatureError(_message(problem, wanted, chunked))


def refuse_mixing_per_call(plan, extensions: Sequence, program, X: Tensor, params, trainable,
                           chunked: bool = False) -> None:
    """:func:`refuse_mixing` for a plan already checked: only indexing by the input's values,
    whose verdict is this call's (:mod:`curvlib._plan.mixing_index`)."""
    found, wanted = _wanted(plan, extensions, chunked)
    problem = found.per_call(program, X, params, trainable) if found is not None else None
    if problem:
        raise CurvatureError(_message(problem, wanted, chunked))


def _wanted(plan, extensions: Sequence, chunked: bool):
    """``(found, wanted)``: the plan's verdicts (``None``: nothing to check) and the extensions
    that need independent samples."""
    found = getattr(plan, "independence", None)
    wanted = [e for e in extensions if type(e).independent_samples]
    return (found if found is not None and (wanted or chunked) else None), wanted


def _message(problem: str, wanted: Sequence, chunked: bool) -> str:
    names = ", ".join(type(e).__name__ for e in wanted)
    refused = f"curvlib refuses {names}" + (" and batch_chunk_size" if chunked and names else "")
    if chunked and not names:
        refused = "curvlib refuses batch_chunk_size (slices of the batch would give other results than the whole batch)"
    return (
        f"Samples are mixed inside the model: {problem}. One sample's output then depends on "
        "other samples' values that depend on trainable parameters, so per-sample quantities "
        "(individual gradients, their norms, variance, per-sample and GGN/Hessian curvature read "
        "off per sample) are not defined: they would depend on which samples share the batch. "
        f"{refused}. Still exact on this model: loss, grad, and the products HMP and GGNMP "
        "(whole-batch autodiff). For per-sample quantities make each sample's computation its "
        "own: running or per-sample statistics instead of batch statistics (model.eval(), "
        "LayerNorm/GroupNorm), the batch in its own dim (e.g. batch_first=True), and no "
        "reduction, sort, softmax, indexing or attention across the batch dim."
    )
