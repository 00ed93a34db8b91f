"""Monte-Carlo draws that a ``curvature(..., compile=True)`` program takes as inputs.

Eagerly these are ``torch.randn`` / ``torch.rand`` (Bernoulli draws: ``rand < p``) with the
extension's generator. While a program is traced (:mod:`curvlib._transform.compiled`) a
:class:`Tape` records each draw's recipe (kind, shape, generator, dtype, device) and
hands out a tensor given to the program instead; every call then draws those tensors
eagerly, before the compiled program runs, in the same order and from the same
generators as the eager call does — so ``randn``/``rand`` draws are identical to
eager's. (Binary cross-entropy's Bernoulli draws are ``rand < p`` in both.)
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import List, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["Tape", "randn", "rand", "bernoulli", "recording", "replay"]

_STATE = threading.local()


class Tape:
    """The draws of one traced program: recipes, and the tensors standing in for them."""

    def __init__(self, given: Optional[Sequence[Tensor]] = None):
        self.recipes: List[tuple] = []
        self.given = given

    def draw(self, kind: str, shape, generator, dtype, device) -> Tensor:
        self.recipes.append((kind, tuple(shape), generator, dtype, device))
        if self.given is None:  # first trace: learn the recipes (values are fake anyway)
            return getattr(torch, kind)(tuple(shape), dtype=dtype, device=device)
        return self.given[len(self.recipes) - 1]


@contextmanager
def recording(tape: Tape):
    """Within the block (this thread), draws go through ``tape``."""
    previous = getattr(_STATE, "tape", None)
    _STATE.tape = tape
    try:
        yield tape
    finally:
        _STATE.tape = previous


def replay(recipes: Sequence[tuple]) -> List[Tensor]:
    """The draws of one call, eagerly, in the recipes' order."""
    return [getattr(torch, kind)(shape, generator=g, dtype=dtype, device=device)
            for kind, shape, g, dtype, device in recipes]


def _tape() -> Optional[Tape]:
    return getattr(_STATE, "tape", None)


def randn(shape, generator, dtype, device) -> Tensor:
    """``torch.randn`` (an input of a traced program)."""
    tape = _tape()
    if tape is None:
        return torch.randn(shape, generator=generator, dtype=dtype, device=device)
    return tape.draw("randn", shape, generator, dtype, device)


def rand(shape, generator, dtype, device) -> Tensor:
    """``torch.rand`` (an input of a traced program)."""
    tape = _tape()
    if tape is None:
        return torch.rand(shape, generator=generator, dtype=dtype, device=device)
    return tape.draw("rand", shape, generator, dtype, device)


def bernoulli(p: Tensor, generator) -> Tensor:
    """Bernoulli draws with probabilities ``p``, as ``rand < p`` (eager, traced and under
    ``vmap`` alike: ``vmap`` has no rule for ``torch.bernoulli`` of a batched ``p`` with
    ``randomness="same"``; on CPU ``torch.bernoulli`` draws exactly these)."""
    return (rand(p.shape, generator, p.dtype, p.device) < p).to(p.dtype)
