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
* :class:`~curvlib.operators.Hessian`: ``H = ∇²_θ L``, by forward-over-reverse autodiff;
* :class:`~curvlib.operators.Jacobian`: ``J`` itself, ``[N·C, P]`` (rows: the outputs of each batch, flattened per
  sample, batches in order); ``J.T`` its transpose.

Each is pure: the parameters are those of ``params`` (else the model's), the model is never
changed, and ``A @ v`` is differentiable and ``vmap``-able in ``v``.
"""

from __future__ import annotations

import copy
from typing import Callable, Dict, Mapping, Optional, Sequence, TypeVar

import torch
from torch import Tensor, nn

from .._core.errors import CurvatureError
from .._evaluate.products import guarded
from .._transform.network import Batch, Network, lacks_forward_mode, translated
from .base import CurvatureOperator, ParameterSpace
from . import plain
from .data import BatchSeeds, Data

__all__ = ["NetworkOperator", "GGN", "FisherMC", "EmpiricalFisher", "over_vectors"]

Directions = Dict[str, Tensor]  # parameter name -> [K, *p.shape]
T = TypeVar("T")


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

    Raises:
        CurvatureTypeError: an argument of the wrong type (``data`` a one-pass iterator).
        CurvatureError: anything ``curvature`` refuses for this model and loss, no parameter to act
            on, a loader whose batches change between passes, a bad ``chunk_size``.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib.operators import GGN
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> G = GGN(model, nn.CrossEntropyLoss(), (X, y))
        >>> G.shape, G.domain.names
        ((26, 26), ('0.weight', '0.bias', '2.weight', '2.bias'))
        >>> G.block(["2.weight"]).shape, sorted(G.blocks())
        ((8, 8), ['0', '2'])
    """

    # Jacobian-vector products in forward mode (off once torch lacks one for the model); plain
    # autograd instead of torch.func (on once torch.func refuses the model)
    forward_mode, plain = True, False

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
            part = None  # (``total`` holds the products alone)
        return self.codomain.flatten_emptying(total)  # (the batches' products freed as the result fills)

    def batch_weight(self, weight: float) -> float:
        """How batch ``b``'s matrix enters the data's (:mod:`curvlib.operators.data`): ``w_b``.

        :meta private:
        """
        return weight

    def batch_product(self, batch: Batch, seeds: BatchSeeds, V: Directions) -> Directions:
        """One batch's matrix times ``V`` (``{name: [K, *p]}``).

        :meta private:
        """
        raise NotImplementedError

    def block(self, names: Sequence[str]) -> "NetworkOperator":
        """The diagonal block of the parameters ``names`` (in that order): the same curvature as a
        function of those parameters alone, the others held at their values. Shares this
        operator's trace and data (a layer's top eigenvalue, a block's trace).

        Args:
            names: parameter names of the operator (a name alone: that parameter).

        Returns:
            NetworkOperator: the block, of the same class, on those parameters.

        Raises:
            CurvatureError: no name, an unknown or repeated name.
        """
        names = (names,) if isinstance(names, str) else tuple(names)
        unknown = [n for n in names if n not in self.domain.names]
        if not names or unknown or len(set(names)) != len(names):
            raise CurvatureError(
                f"{type(self).__name__}.block(names): names must be distinct parameters of the operator "
                f"({list(self.domain.names)[:6]}{', ...' if len(self.domain.names) > 6 else ''}), got {list(names)[:6]}.")
        where = {n: k for k, n in enumerate(self.domain.names)}
        space = ParameterSpace(names, tuple(self.domain.shapes[where[n]] for n in names), self.dtype, self.device)
        sub = copy.copy(self)
        sub.domain = space
        sub.codomain = space if self.codomain is not None else None
        sub.shape = sub.block_shape(space)
        sub._guarded = guarded(sub._product, type(self).__name__)
        return sub

    def block_shape(self, space: ParameterSpace):
        """The shape of the block on ``space``.

        :meta private:
        """
        return space.dim, space.dim

    def blocks(self, by: str = "module") -> Dict[str, "NetworkOperator"]:
        """The diagonal blocks: one per module owning parameters (``by="module"``, keyed by its
        path, ``""`` for the model's own) or one per parameter (``by="parameter"``).

        Args:
            by: ``"module"`` or ``"parameter"``.

        Returns:
            dict: module path (or parameter name) -> its block, in the parameters' order.

        Raises:
            CurvatureError: another ``by``.
        """
        if by not in ("module", "parameter"):
            raise CurvatureError(f"blocks(by=...) must be 'module' or 'parameter', got {by!r}.")
        groups: Dict[str, list] = {}
        for name in self.domain.names:
            key = name if by == "parameter" else (name.rsplit(".", 1)[0] if "." in name else "")
            groups.setdefault(key, []).append(name)
        return {key: self.block(names) for key, names in groups.items()}

    def with_fallback(self, functorch: Callable[[], T], plain_autograd: Callable[[], T]) -> T:
        """``functorch()``, or ``plain_autograd()`` from the first model ``torch.func`` cannot
        differentiate on (a custom ``autograd.Function`` without ``setup_context``, :mod:`~curvlib.operators.plain`).

        :meta private:
        """
        if not self.plain:
            try:
                return functorch()
            except Exception as exc:  # noqa: BLE001 - re-raised unless it is torch.func's refusal
                if not plain.needs_plain_autograd(exc):
                    raise
                self.plain = True
        return plain_autograd()

    def output_curvature(self, batch: Batch, V: Directions, apply: Callable[[Tensor, Tensor], Tensor]) -> Directions:
        """``Jᵀ D J V`` for an output-space matrix ``D``: ``apply(out, JV)`` with ``JV [K, N, *out]``.
        The Jacobian-vector products first (forward mode holds one layer at a time), then one
        forward kept for the vector-Jacobian products: the peak is a backward's and ``JV``.

        :meta private:
        """
        return self.with_fallback(lambda: self._output_curvature(batch, V, apply),
                                  lambda: plain.output_curvature(batch, V, apply))

    def _output_curvature(self, batch: Batch, V: Directions, apply) -> Directions:
        theta = {n: batch.values[n] for n in V}
        jv = self.forward_jacobian_products(batch, theta, V)
        out, pull = torch.func.vjp(batch.output, theta)
        if jv is None:
            jv = reverse_jacobian_products(pull, out, V)
        djv = apply(out.detach(), jv)
        del jv
        return over_vectors(lambda c: pull(c)[0], djv)

    def forward_jacobian_products(self, batch: Batch, theta, V: Directions) -> Optional[Tensor]:
        """``J V`` (``[K, N, *out]``) in forward mode; ``None`` where torch has no forward-mode
        derivative of some operation of the model (then :func:`reverse_jacobian_products`).

        :meta private:
        """
        if self.forward_mode:
            try:
                return over_vectors(lambda v: torch.func.jvp(batch.output, (theta,), (v,))[1], V)
            except CurvatureError as exc:
                if not lacks_forward_mode(exc):
                    raise
                self.forward_mode = False
        return None

    def jacobian_products(self, batch: Batch, theta, V: Directions) -> Tensor:
        """``J V`` (``[K, N, *out]``), in forward mode where torch has it.

        :meta private:
        """
        def functorch() -> Tensor:
            jv = self.forward_jacobian_products(batch, theta, V)
            if jv is None:
                out, pull = torch.func.vjp(batch.output, theta)
                jv = reverse_jacobian_products(pull, out, V)
            return jv

        return self.with_fallback(functorch, lambda: plain.jacobian_products(batch, V))

    def parameters(self) -> Dict[str, Tensor]:
        """The values the operator is evaluated at, parameter name -> tensor.

        Returns:
            dict: parameter name -> tensor, in the operator's order.
        """
        return {n: self.data.first.values[n] for n in self.domain.names}


def reverse_jacobian_products(pull, out: Tensor, V: Directions) -> Tensor:
    """``J V`` as the vector-Jacobian product of the linear map ``u ↦ Jᵀu`` (``pull``, the
    model's at ``out``): reverse over reverse, ``(Jᵀ)ᵀ v = J v``."""
    _, transposed = torch.func.vjp(lambda u: pull(u)[0], torch.zeros_like(out))
    return over_vectors(lambda v: transposed(v)[0], V)


def over_vectors(fn: Callable, stacked):
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
    r"""The generalised Gauss-Newton $G = J^\top (c \nabla^2 \ell) J$ of all the parameters: one Jacobian-vector
    product, the loss Hessian per sample in closed form (softmax: $\operatorname{diag}(p) - p p^\top$) and one
    vector-Jacobian product per multiplication. Its diagonal is ``DiagGGNExact``'s.

    Args:
        model: any module ``curvature`` takes (wrapped or not, container outputs).
        lossfn: the loss, as for ``curvature``.
        data: ``(X, y)``, or a re-iterable loader of such pairs (the same batches every pass).
        params: parameter name -> tensor: these values, and the operator acts on exactly these
            parameters; default (None): the model's, acting on every ``requires_grad`` one.
        buffers: buffer name -> tensor, replacing the model's (as for ``curvature``).
        output: the tensor of a container output the loss takes (as for ``curvature``).
        generator: draws the dropout masks of a model in training mode (one per batch, fixed
            for the operator's lifetime).
        chunk_size: vectors multiplied at once by ``A @ M`` (memory grows with it).

    Raises:
        CurvatureTypeError: an argument of the wrong type (``data`` a one-pass iterator).
        CurvatureError: anything ``curvature`` refuses for this model and loss, no parameter to act
            on, a loader whose batches change between passes, a bad ``chunk_size``.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib.operators import GGN
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> G = GGN(model, nn.CrossEntropyLoss(), [(X[:4], y[:4]), (X[4:], y[4:])])   # a loader
        >>> v = torch.randn(G.shape[1])
        >>> bool((v @ (G @ v)) >= 0)                                  # positive semi-definite
        True
        >>> {name: t.shape for name, t in (G @ G.domain.unflatten(v)).items()}["2.weight"]
        torch.Size([2, 4])
    """

    def batch_product(self, batch, seeds, V):
        return self.output_curvature(batch, V, lambda out, jv: batch.loss_hessian(out).matvec(jv))


class FisherMC(NetworkOperator):
    r"""The Monte-Carlo Fisher $\hat F = \sum_n \sum_m s_{nm} s_{nm}^\top$, $s_{nm} = \sqrt{c/M}\, J_n^\top \nabla \ell(f_n, \hat y_{nm})$ with
    ``mc_samples = M`` targets ``ŷ_nm`` per sample drawn from the model's predictive distribution,
    fixed by ``generator`` for the operator's lifetime: ``E[F̂] = G`` (the GGN).

    Args:
        model: any module ``curvature`` takes (wrapped or not, container outputs).
        lossfn: the loss, as for ``curvature``.
        data: ``(X, y)``, or a re-iterable loader of such pairs (the same batches every pass).
        params: parameter name -> tensor: these values, and the operator acts on exactly these
            parameters; default (None): the model's, acting on every ``requires_grad`` one.
        buffers: buffer name -> tensor, replacing the model's (as for ``curvature``).
        output: the tensor of a container output the loss takes (as for ``curvature``).
        generator: draws the dropout masks of a model in training mode (one per batch, fixed
            for the operator's lifetime) and the Monte-Carlo targets.
        chunk_size: vectors multiplied at once by ``A @ M`` (memory grows with it).
        mc_samples: the number ``M`` of targets drawn per sample, an int ≥ 1.

    Raises:
        CurvatureTypeError: an argument of the wrong type (``data`` a one-pass iterator).
        CurvatureError: anything ``curvature`` refuses for this model and loss, no parameter to act
            on, a loader whose batches change between passes, a bad ``chunk_size`` or ``mc_samples``.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib.operators import FisherMC
        >>> model = nn.Sequential(nn.Linear(3, 2))
        >>> X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> F = FisherMC(model, nn.CrossEntropyLoss(), (X, y), generator=torch.Generator().manual_seed(0))
        >>> v = torch.randn(F.shape[1])
        >>> torch.equal(F @ v, F @ v)                                 # the same draws every time
        True
    """

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
        return self.output_curvature(batch, V, apply)


class EmpiricalFisher(NetworkOperator):
    r"""The empirical Fisher $E = \sum_n g_n g_n^\top$ of the individual gradients $g_n = \partial (c\, \ell_n) / \partial \theta$
    (BackPACK's convention: its diagonal is ``SumGradSquared``'s; curvlinops' ``EFLinearOperator``
    scales by ``c`` once, so for ``"mean"`` it is ``M`` times this). Batches of a loader enter with
    their weight squared.

    Args:
        model: any module ``curvature`` takes (wrapped or not, container outputs).
        lossfn: the loss, as for ``curvature``.
        data: ``(X, y)``, or a re-iterable loader of such pairs (the same batches every pass).
        params: parameter name -> tensor: these values, and the operator acts on exactly these
            parameters; default (None): the model's, acting on every ``requires_grad`` one.
        buffers: buffer name -> tensor, replacing the model's (as for ``curvature``).
        output: the tensor of a container output the loss takes (as for ``curvature``).
        generator: draws the dropout masks of a model in training mode (one per batch, fixed
            for the operator's lifetime).
        chunk_size: vectors multiplied at once by ``A @ M`` (memory grows with it).

    Raises:
        CurvatureTypeError: an argument of the wrong type (``data`` a one-pass iterator).
        CurvatureError: anything ``curvature`` refuses for this model and loss, no parameter to act
            on, a loader whose batches change between passes, a bad ``chunk_size``.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import SumGradSquared
        >>> from curvlib.operators import EmpiricalFisher
        >>> model = nn.Sequential(nn.Linear(3, 2))
        >>> X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> E = EmpiricalFisher(model, nn.CrossEntropyLoss(), (X, y))
        >>> sgs = curvature(model, nn.CrossEntropyLoss(), [SumGradSquared()])(X, y)["sum_grad_squared"]
        >>> torch.allclose(E.to_dense().diagonal(), E.domain.flatten(sgs))
        True
    """

    def batch_weight(self, weight: float) -> float:
        return weight * weight

    def batch_product(self, batch, seeds, V):
        def apply(out: Tensor, jv: Tensor) -> Tensor:
            u = torch.func.grad(batch.loss)(out)  # row n: c∇ℓ_n, sample n's own output gradient
            return u * _per_sample_inner(jv, u)
        return self.output_curvature(batch, V, apply)
