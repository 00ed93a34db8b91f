"""The whole network's curvature matrices as operators, over all trainable parameters (or
``params``' entries) and a batch or a loader (:mod:`curvlib.operators.data`).

For the loss ``L(θ) = c·Σ_n ℓ(f(x_n; θ), y_n)`` with Jacobian ``J = ∂f/∂θ`` (all samples' outputs):

* :class:`GGN`: ``G = Jᵀ (c∇²ℓ) J``, the loss Hessian per sample in closed form (softmax:
  ``diag(p) − p pᵀ``), so ``G v`` is one Jacobian-vector product, the loss Hessian, and one
  vector-Jacobian product — no Jacobian and no ``[N, T, V]`` columns are formed;
* :class:`FisherMC`: ``F̂ = Σ_n Σ_m s_nm s_nmᵀ`` with ``s_nm = √(c/M)·Jₙᵀ∇ℓ(f_n, ŷ_nm)``,
  ``ŷ_nm`` drawn from the model's predictive distribution (``E[F̂] = G`` for these losses);
* :class:`EmpiricalFisher`: ``E = Σ_n g_n g_nᵀ``, ``g_n = ∂(c·ℓ_n)/∂θ`` (its diagonal is
  ``SumGradSquared``);
* :class:`Hessian`: ``H = ∇²_θ L``, by forward-over-reverse autodiff;
* :class:`Jacobian`: ``J`` itself, ``[N·C, P]`` (rows: the outputs of each batch, flattened per
  sample, batches in order); ``J.T`` its transpose.

Each is pure: the parameters are those of ``params`` (else the model's), the model is never
changed, and ``A @ v`` is differentiable and ``vmap``-able in ``v``.
"""

from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional

import torch
from torch import Tensor, nn

from .._core.errors import CurvatureError
from .._evaluate.products import guarded
from .._transform.network import Batch, Network, translated
from .base import CurvatureOperator, ParameterSpace
from .data import BatchSeeds, Data

__all__ = ["GGN", "FisherMC", "EmpiricalFisher", "Hessian", "Jacobian"]

Directions = Dict[str, Tensor]  # parameter name -> [K, *p.shape]


class NetworkOperator(CurvatureOperator):
    """A curvature matrix of ``model`` and ``lossfn`` on ``data`` (module doc).

    Args:
        model: any module ``curvature`` takes (wrapped or not, container outputs).
        lossfn: as for ``curvature``.
        data: ``(X, y)``, or a re-iterable loader of such pairs (the same batches every pass).
        params: parameter name -> tensor: these values, and the operator acts on exactly these
            parameters; default: the model's, acting on every ``requires_grad`` one.
        buffers: buffer name -> tensor, replacing the model's (as for ``curvature``).
        output: the tensor of a container output the loss takes (as for ``curvature``).
        generator: draws the dropout masks of a model in training mode (one per batch, fixed
            for the operator's lifetime) and Monte-Carlo samples.
        chunk_size: vectors multiplied at once by ``A @ M`` (memory grows with it).
    """

    def __init__(self, model: nn.Module, lossfn, data, params: Optional[Mapping[str, Tensor]] = None,
                 buffers: Optional[Mapping[str, Tensor]] = None, output=None,
                 generator: Optional[torch.Generator] = None, chunk_size: int = 16):
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise CurvatureError(f"chunk_size must be a positive int, got {chunk_size!r}.")
        self.network = Network(model, lossfn, output)
        self.data = translated(model, lambda: Data(self.network, data, params, buffers, generator))
        first = self.data.first
        if not first.trainable:
            raise CurvatureError(f"{type(self).__name__}: the model has no parameter with requires_grad=True "
                                 "and no params were given: the operator would act on nothing.")
        space = ParameterSpace.of({n: first.values[n] for n in first.trainable})
        super().__init__(*self._shape(space), space.dtype, space.device, domain=space, codomain=space)
        self.chunk_size = chunk_size
        self._guarded = guarded(self._product, type(self).__name__)
        if not self.network.spec.structural:  # a generic loss: refuse one that couples samples, once
            translated(model, lambda: first.loss_hessian(first.output({}).detach(), check=True))

    def _shape(self, space: ParameterSpace):
        return space.dim, space.dim

    def matmat(self, M: Tensor) -> Tensor:
        return self._guarded(M)

    def _product(self, M: Tensor) -> Tensor:
        if M.shape[1] == 0:
            return M.new_zeros(self.shape[0], 0)
        parts = [self._chunk(M[:, k:k + self.chunk_size]) for k in range(0, M.shape[1], self.chunk_size)]
        # one chunk: no copy (a [P, K] cat of transposed chunks copies element by element)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def _chunk(self, M: Tensor) -> Tensor:
        V = self.domain.unflatten(M)
        total: Optional[Directions] = None
        for weight, seeds, batch in self.data:
            part = translated(self.network.model, lambda: self.batch_product(batch, seeds, V))
            scale = self.batch_weight(weight)
            if total is None:  # the first batch: no zeros added, no copy when its weight is 1
                total = part if scale == 1 else {n: scale * p for n, p in part.items()}
            else:
                total = {n: total[n] + scale * p for n, p in part.items()}
        return self.codomain.flatten(total)

    def batch_weight(self, weight: float) -> float:
        """How batch ``b``'s matrix enters the data's (:mod:`curvlib.operators.data`): ``w_b``."""
        return weight

    def batch_product(self, batch: Batch, seeds: BatchSeeds, V: Directions) -> Directions:
        """One batch's matrix times ``V`` (``{name: [K, *p]}``)."""
        raise NotImplementedError

    def parameters(self) -> Dict[str, Tensor]:
        """The values the operator is evaluated at, parameter name -> tensor."""
        return {n: self.data.first.values[n] for n in self.domain.names}


def _output_curvature(batch: Batch, V: Directions, apply: Callable[[Tensor, Tensor], Tensor]) -> Directions:
    """``Jᵀ D J V`` for an output-space matrix ``D``: ``apply(out, JV)`` with ``JV [K, N, *out]``.
    ``K`` Jacobian-vector products first, then one forward kept for the vector-Jacobian products
    (in this order the forward-mode pass's values are gone before the kept forward's are made)."""
    theta = {n: batch.values[n] for n in V}
    jv = _over_vectors(lambda v: torch.func.jvp(batch.output, (theta,), (v,))[1], V)
    out, pull = torch.func.vjp(batch.output, theta)
    djv = apply(out.detach(), jv)
    del jv
    return _over_vectors(lambda c: pull(c)[0], djv)


def _over_vectors(fn: Callable, stacked):
    """``fn`` on each of ``K`` stacked inputs (a tensor or a dict of tensors ``[K, ...]``), the
    results stacked the same way: ``vmap`` for ``K > 1``; one vector is called directly (``vmap``
    over one turns every matmul into a batched one, slower on CPU)."""
    first = next(iter(stacked.values())) if isinstance(stacked, Mapping) else stacked
    if first.shape[0] != 1:
        return torch.func.vmap(fn, randomness="same")(stacked)
    return _each(fn(_each(stacked, lambda t: t[0])), lambda t: t.unsqueeze(0))


def _each(x, fn: Callable):
    """``fn`` on a tensor, or on every value of a dict of tensors."""
    return {n: fn(t) for n, t in x.items()} if isinstance(x, Mapping) else fn(x)


def _per_sample_inner(a: Tensor, b: Tensor) -> Tensor:
    """``⟨a_n, b_n⟩`` for ``a [..., N, *out]``, ``b [N, *out]`` broadcast: ``[..., N]`` kept broadcastable."""
    n_dims = b.dim() - 1
    prod = a * b
    return prod.sum(dim=tuple(range(prod.dim() - n_dims, prod.dim())), keepdim=True)


class GGN(NetworkOperator):
    """The generalised Gauss-Newton ``G = Jᵀ (c∇²ℓ) J`` (module doc); its diagonal is ``DiagGGNExact``."""

    def batch_product(self, batch, seeds, V):
        return _output_curvature(batch, V, lambda out, jv: batch.loss_hessian(out).matvec(jv))


class FisherMC(NetworkOperator):
    """The Monte-Carlo Fisher ``Σ_n Σ_m s_nm s_nmᵀ`` (module doc) with ``mc_samples`` draws per
    sample, fixed by ``generator`` for the operator's lifetime; ``E[F̂] = GGN``, and its diagonal
    is ``DiagGGNMC``'s with the same draws."""

    def __init__(self, model, lossfn, data, params=None, buffers=None, output=None, generator=None,
                 chunk_size: int = 16, mc_samples: int = 1):
        if not isinstance(mc_samples, int) or isinstance(mc_samples, bool) or mc_samples < 1:
            raise CurvatureError(f"mc_samples must be a positive int, got {mc_samples!r}.")
        self.mc_samples = mc_samples
        super().__init__(model, lossfn, data, params, buffers, output, generator, chunk_size)

    def batch_product(self, batch, seeds, V):
        def apply(out: Tensor, jv: Tensor) -> Tensor:
            total = torch.zeros_like(jv)
            for sign, S in batch.loss_hessian(out).sampled_roots(self.mc_samples, seeds.generator("samples")):
                # Σ_m s_m ⟨s_m, Jv⟩ per sample: S [M, N, *out], jv [K, N, *out]
                inner = _per_sample_inner(jv.unsqueeze(1), S)  # [K, M, N, 1...]
                total = total + sign * (inner * S.unsqueeze(0)).sum(1)
            return total
        return _output_curvature(batch, V, apply)


class EmpiricalFisher(NetworkOperator):
    """The empirical Fisher ``E = Σ_n g_n g_nᵀ`` of the individual gradients (module doc); its
    diagonal is ``SumGradSquared``. Batches enter with ``w_b²`` (:mod:`curvlib.operators.data`)."""

    def batch_weight(self, weight: float) -> float:
        return weight * weight

    def batch_product(self, batch, seeds, V):
        def apply(out: Tensor, jv: Tensor) -> Tensor:
            u = torch.func.grad(batch.loss)(out)  # row n: c∇ℓ_n, sample n's own output gradient
            return u * _per_sample_inner(jv, u)
        return _output_curvature(batch, V, apply)


class Hessian(NetworkOperator):
    """The Hessian ``∇²_θ L`` (module doc), by forward-over-reverse autodiff; its diagonal is
    ``DiagHessian``."""

    def batch_product(self, batch, seeds, V):
        theta = {n: batch.values[n] for n in V}
        gradient = torch.func.grad(lambda th: batch.loss(batch.output(th)))
        return _over_vectors(lambda v: torch.func.jvp(gradient, (theta,), (v,))[1], V)
