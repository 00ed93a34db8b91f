"""Kronecker-factored blocks over a data set: the factors of every batch combined into the data's,
and one block's product, inverse and dense form by mode products on the reshaped parameter.

**Combining batches.** ``curvature``'s factors of batch ``b`` (``N_b`` samples, normaliser
``M_b``: ``c_b = 1/M_b`` for ``"mean"``) are per parameter a list with exactly one root
factor ``R_b`` (the one built from backpropagated columns, carrying ``c_b``;
:mod:`curvlib._core.kronlayout`) and input factors ``I_b`` (batch means of the layer's inputs,
no ``c``). The data's factors are

* ``I = Σ_b N_b I_b / Σ_b N_b``: the mean over all samples;
* ``R = Σ_b w_b R_b`` for the GGN and the Monte-Carlo Fisher, ``R = Σ_b w_b² R_b`` for the
  empirical Fisher (quadratic in the individual gradients), with the batch weights of
  :mod:`curvlib.operators.data`: ``w_b = M_b / Σ_b' M_b'`` for ``"mean"``, ``1`` for ``"sum"``,

so that ``R`` is the root factor of all samples at once (``c = 1/Σ_b M_b``), and for one batch
the data's factors are ``curvature``'s. For the GGN and the MC Fisher this is curvlinops'
``KFACLinearOperator`` convention; its empirical ``B`` carries ``c`` where curvlib's carries
``c²`` (as the diagonal ``SumGradSquared`` and the :class:`~curvlib.operators.EmpiricalFisher`).
EKFAC's corrected eigenvalues are summed over batches with the root factor's weights.

**One block.** :mod:`curvlib.precondition._kronbasis` maps every layout to a core
``C [G, o, a]`` on which the block acts as ``C[g] ↦ R[g] C[g] I[g]ᵀ`` (a 1-D factor: a
diagonal), and its inverse ``(R ⊗ I + λ)⁻¹`` as ``Q_R [(Q_Rᵀ C Q_I) / (λ_R λ_Iᵀ + λ)] Q_Iᵀ``.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._core import kronlayout
from .._core.errors import CurvatureError
from ..precondition import _kronbasis
from .data import parameter_groups

__all__ = ["Accumulator", "root_sides", "multiply", "spectral", "damped_spectrum", "dense_block", "projected_squares", "add_projected",
           "grouped_params", "grouped_roots"]

def root_sides(factors: Dict[str, List[Tensor]], root_last: Mapping[str, bool]) -> Dict[str, int]:
    """Parameter name -> the index of its root factor, from ``root_last`` (parameter name -> whether
    its root factor is the last, read off the sites of the model's plan by ``curvature``:
    Embedding's ``[A [V], B]``, a weight stored transposed as transformers' ``Conv1D``'s ``[A, B]``);
    a parameter no site reads (a zero block) by its shapes (:func:`curvlib._core.kronlayout.root_index`).
    Shapes alone cannot tell ``[B [O], A]`` (a Linear's, ``max_factor_dim``) from ``[A [V], B]``
    nor ``[B, A]`` from ``[A, B]``."""
    return {name: kronlayout.root_index(f, root_last.get(name)) for name, f in factors.items()}


class Accumulator:
    """Sums of ``N_b I_b`` and ``μ_b R_b`` over batches (module doc); ``μ_b = M_b`` (or ``M_b²``,
    ``squared``) for ``"mean"``, 1 for ``"sum"``; :meth:`factors` and :meth:`root_scale` divide."""

    def __init__(self, reduction: Optional[str], squared: bool, describe: str):
        self.reduction, self.squared, self.describe = reduction, squared, describe
        self.samples, self.mass, self.batches = 0, 0.0, 0

    def root_weight(self, normaliser: Optional[float]) -> float:
        """Count one batch; its root-side weight ``μ_b`` before the final division."""
        self.batches += 1
        if normaliser is None:
            if self.batches > 1:
                raise CurvatureError(
                    f"data with several batches and lossfn {self.describe}: curvlib sums batches by the "
                    "reduction of nn.MSELoss, nn.CrossEntropyLoss and nn.BCEWithLogitsLoss, which it cannot "
                    "know for another loss. Use one of those, or one batch.")
            return 1.0
        mu = 1.0 if self.reduction == "sum" else float(normaliser)
        self.mass += mu
        return mu * mu if self.squared else mu

    def root_scale(self) -> float:
        """``1 / Σ_b μ_b`` (squared for the empirical Fisher) for ``"mean"``; 1 for ``"sum"`` or
        a loss of unknown normalisation (one batch); 1 for batches without a counted target."""
        if self.reduction != "mean" or self.mass == 0:
            return 1.0
        return 1.0 / (self.mass * self.mass if self.squared else self.mass)

    def add_factors(self, total: Optional[Dict[str, List[Tensor]]], part: Dict[str, Sequence[Tensor]],
                    sides: Dict[str, int], samples: int, root_weight: float) -> Dict[str, List[Tensor]]:
        """``total`` plus one batch's factors ``part`` (``samples`` = ``N_b``); ``part``'s entries are
        removed as they are summed, so each of the batch's factors is freed once summed. A factor
        ``curvature`` returns for several parameters (a weight's and its bias's output side) is
        summed once, into one tensor those parameters share."""
        self.samples += samples
        out: Dict[str, List[Tensor]] = {}
        shared: Dict[tuple, Tensor] = {}  # the batch's factor (by its view) -> its sum
        for name in list(part):
            sums = []
            for i, t in enumerate(part.pop(name)):
                weight = root_weight if i == sides[name] else samples
                key = (t.data_ptr(), tuple(t.shape), t.stride(), weight)
                if key not in shared:
                    # the sums are this accumulator's own tensors (made here, one per factor): added in place
                    t = t.detach()
                    shared[key] = t * weight if total is None else total[name][i].add_(t, alpha=weight)
                sums.append(shared[key])
            out[name] = sums
        return out

    def factors(self, total: Dict[str, List[Tensor]], sides: Dict[str, int]) -> Dict[str, List[Tensor]]:
        """The data's factors from the sums (module doc), divided in place (``total`` is consumed;
        a sum shared by parameters is divided once)."""
        scale = self.root_scale()
        done = set()
        for name, f in total.items():
            for i, t in enumerate(f):
                if id(t) not in done:
                    done.add(id(t))
                    t.mul_(scale if i == sides[name] else 1.0 / self.samples)
        return total


def _side(factor: Tensor, groups: int) -> Tuple[Tensor, bool]:
    """A factor as ``[G, n, n]`` (dense) or ``[G, n]`` (diagonal, ``True``)."""
    if factor.dim() == 1:
        return factor.reshape(groups, -1), True
    n = factor.shape[-1]
    return factor.reshape(groups, n, n), False


def _core_factors(layout: _kronbasis.Layout, factors: Sequence[Tensor]):
    """The factors acting on the core's ``o`` side and ``a`` side (``None``: identity)."""
    if layout.single:
        return _side(factors[0], 1), None
    r = 1 if layout.kind == "rows" else 0
    return _side(factors[r], layout.groups), _side(factors[1 - r], layout.groups)


def multiply(layout: _kronbasis.Layout, factors: Sequence[Tensor], v: Tensor) -> Tensor:
    """``(F₁ ⊗ F₂) v`` for ``v [K, *p]``: ``C ↦ R C Iᵀ`` per group on the core (module doc)."""
    core = layout.to_core(v)  # [K, G, o, a]
    out_side, in_side = _core_factors(layout, factors)
    matrix, diagonal = out_side
    core = core * matrix[:, :, None] if diagonal else torch.einsum("gpo,kgoa->kgpa", matrix, core)
    if in_side is not None:
        matrix, diagonal = in_side
        core = core * matrix[:, None, :] if diagonal else torch.einsum("kgoa,gba->kgob", core, matrix)
    return layout.from_core(core)


def damped_spectrum(eigen: _kronbasis.Eigen, layout: _kronbasis.Layout, damping: float, heuristic: bool) -> Tensor:
    """``[G, o, a]``: the eigenvalues of ``R ⊗ I + λ`` (exact), or of
    ``(R + √λ/π)(I + π√λ)`` (``heuristic``, Martens & Grosse's π-damping,
    ``π = √((tr I / dim I) / (tr R / dim R))``, 1 where a trace is 0; a single factor: exact)."""
    lo, li = eigen.lam_out, eigen.lam_in
    if not heuristic or layout.single:
        return lo[:, :, None] * li[:, None, :] + damping
    root = math.sqrt(damping)
    mean_o, mean_i = lo.mean(-1, keepdim=True), li.mean(-1, keepdim=True)
    ok = (mean_o > 0) & (mean_i > 0)
    pi = torch.where(ok, (mean_i / torch.where(ok, mean_o, torch.ones_like(mean_o))).sqrt(), torch.ones_like(mean_o))
    return (lo + root / pi)[:, :, None] * (li + root * pi)[:, None, :]


def spectral(layout: _kronbasis.Layout, eigen: _kronbasis.Eigen, multiplier: Tensor, v: Tensor) -> Tensor:
    """``Q diag(multiplier) Qᵀ v`` for ``v [K, *p]``, ``Q`` the eigenbasis and ``multiplier
    [G, o, a]`` in the core's layout (module doc)."""
    return layout.from_core(eigen.unrotate(eigen.rotate(layout.to_core(v)) * multiplier))


def dense_block(apply: Callable[[Tensor], Tensor], shape: Tuple[int, ...], dtype: torch.dtype,
                device: torch.device) -> Tensor:
    """The ``[P, P]`` matrix of ``apply`` (``[K, *p] -> [K, *p]``), from the identity's columns."""
    size = math.prod(shape)
    eye = torch.eye(size, dtype=dtype, device=device).reshape(size, *shape)
    return apply(eye).reshape(size, size).T


def projected_squares(layout: _kronbasis.Layout, eigen: _kronbasis.Eigen, rows: Tensor) -> Tensor:
    """``Σ_s ((Qᵀ s)_i)²`` over the rows ``s`` of ``rows [S, *p]``, in the core's layout ``[G, o, a]``."""
    return eigen.rotate(layout.to_core(rows)).square().sum(0)


def add_projected(total: Dict[str, Tensor], roots: Dict[str, Tensor], layouts: Mapping[str, _kronbasis.Layout],
                  eigen: Mapping[str, _kronbasis.Eigen], weight: float) -> None:
    """``total[p] += weight · Σ_s ((Qᵀ s)_i)²`` for every parameter ``p`` of ``roots`` (name -> ``[C, N_b, *p]``
    or ``[N_b, *p]``), each root popped: freed once rotated, the rotation squared in place (one
    temporary of a root's size at a time)."""
    for name in list(roots):
        layout = layouts[name]
        core = layout.to_core(roots.pop(name).reshape(-1, *layout.shape))  # [S, G, o, a]
        rotated = eigen[name].rotate(core)
        squares = rotated.square() if rotated is core else rotated.square_()
        del core, rotated
        # Σ_s over S rows; one row is the sum itself (the same numbers as summing it)
        part = (squares[0] if squares.shape[0] == 1 else squares.sum(0)).mul_(weight)
        del squares
        total[name] = part if name not in total else total[name].add_(part)


def grouped_params(model, params: Optional[Mapping[str, Tensor]], space, columns: Optional[int]) -> List:
    """``curvature``'s ``params`` for each call of a pass over parameter groups
    (:func:`curvlib.operators.data.parameter_groups` of ``space``'s parameters, ``columns`` rows
    besides the gradient): ``[params]`` for one group, else each group's values, ``params``' or the
    model's, detached (values that require grad would take ``curvature``'s differentiable route)."""
    groups = parameter_groups(dict(zip(space.names, map(math.prod, space.shapes))), columns)
    if len(groups) == 1:
        return [params]
    named = dict(model.named_parameters()) if params is None else params
    return [{n: named[n].detach() for n in group} for group in groups]


def grouped_roots(call: Callable, groups: List, generator: Optional[torch.Generator], name: str) -> Iterator[Dict]:
    """``call(params=group)[name]`` for each group of :func:`grouped_params`, ``generator`` restarted
    for each: every group's roots are those of the same draws (sampled labels). The call's other
    results (its gradient) are freed before the roots are yielded."""
    state = None if generator is None else generator.get_state()
    for params in groups:
        if state is not None:
            generator.set_state(state)
        yield call(params=params).pop(name)
