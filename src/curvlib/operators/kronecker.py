"""Kronecker-factored curvature over a data set: ``KFAC`` and ``EKFAC``, block-diagonal
operators with one block per parameter, and their damped inverses.

``KFAC``'s block of parameter ``p`` is the Kronecker product of ``p``'s factors, in
``curvature``'s layout (BackPACK's ``[B, A]`` for Linear and Conv weights, ``B ⊗ A`` acting on
the weight flattened row-major; ``[B]`` for biases; Embedding's ``[A [V], B]``; the exact block
``[F]`` of a norm's parameters; docs/conventions.md), combined over the batches of ``data``
(input factors averaged over all samples, the root factor summed with the weights of the
loss's batches, as the operators' data). ``fisher_type`` chooses the matrix approximated:

| ``fisher_type`` | factors (``curvature`` extension) | approximates |
|---|---|---|
| ``"exact"`` | ``KFLR`` (the loss Hessian's exact root) | ``GGN`` |
| ``"mc"`` | ``KFAC(mc_samples)`` (sampled labels) | ``FisherMC`` |
| ``"empirical"`` | ``KFACEmpirical`` (individual gradients) | ``EmpiricalFisher`` |

``EKFAC`` (George et al., 2018) keeps KFAC's eigenbasis ``Q = Q₁ ⊗ Q₂`` per block and
replaces its eigenvalues by ``Λ*_i = Σ_s ((Qᵀ s)_i)²`` over the columns ``s`` of the matrix's
root (``SqrtGGNExact``, ``SqrtGGNMC`` or ``BatchGrad``), streamed one batch at a time: for
``"exact"`` and ``"empirical"``, ``Λ*`` is the diagonal of ``Qᵀ G Q`` on the block.

``A.inverse(damping)`` is ``(A + λI)⁻¹``, exact for the blocks, by eigendecompositions of the
factors (never the Kronecker product): ``Q (Λ + λ)⁻¹ Qᵀ``. Everything is computed once, at
construction: the operators are fixed matrices (pure: the model is not changed).
"""

from __future__ import annotations

import math
import numbers
from functools import partial
from typing import Dict, Mapping, Optional

import torch
from torch import Tensor, nn

from .. import extensions as ext
from .. import losses
from .._core import inputs as _inputs
from .._core.errors import CurvatureError, CurvatureTypeError
from .._transform.entry import curvature
from .._transform.network import Network
from ..precondition import _kronbasis, transposed_weights
from . import _kronblocks
from .base import CurvatureOperator, ParameterSpace
from .data import Sliced, pairs

__all__ = ["KFAC", "EKFAC", "KroneckerInverse", "FISHER_TYPES"]

FISHER_TYPES = ("mc", "exact", "empirical")
_FACTORS = {"mc": "kfac", "exact": "kflr", "empirical": "kfac_empirical"}
_ROOTS = {"mc": "sqrt_ggn_mc", "exact": "sqrt_ggn_exact", "empirical": "grad_batch"}


def _check_options(fisher_type, mc_samples, generator) -> None:
    if not isinstance(fisher_type, str) or fisher_type not in FISHER_TYPES:
        raise CurvatureError(f"fisher_type={fisher_type!r} is not supported; use one of {FISHER_TYPES}.")
    if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 1:
        raise CurvatureError(f"mc_samples={mc_samples!r}: must be a positive int.")
    if fisher_type != "mc" and mc_samples != 1:
        raise CurvatureError(f"mc_samples={mc_samples} is for fisher_type='mc' only (fisher_type={fisher_type!r} "
                             "draws nothing).")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise CurvatureTypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}.")


def _check_damping(damping) -> float:
    if isinstance(damping, bool) or not isinstance(damping, numbers.Real) or not math.isfinite(float(damping)) \
            or not float(damping) > 0:
        raise CurvatureError(f"damping={damping!r}: must be a positive finite number (λ in (A + λI)⁻¹).")
    return float(damping)


class KroneckerOperator(CurvatureOperator):
    """A block-diagonal operator over named parameters, one Kronecker-factored block each
    (``KFAC``, ``EKFAC`` and their inverses); ``block_product(name, v)`` multiplies one block.

    Args:
        space: the parameter space of its rows and columns (``ParameterSpace``).
        layouts (dict): parameter name -> how the parameter reshapes to its block's core ``[G, o, a]``
            (made by ``KFAC``; the blocks are made by subclasses, not by hand).

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib.operators import KFAC
        >>> model = nn.Sequential(nn.Linear(3, 2))
        >>> X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> K = KFAC(model, nn.CrossEntropyLoss(), (X, y), fisher_type="exact")
        >>> K.block_product("0.weight", torch.ones(1, 2, 3)).shape       # [K, *p] -> [K, *p]
        torch.Size([1, 2, 3])
    """

    def __init__(self, space: ParameterSpace, layouts: Dict[str, _kronbasis.Layout]):
        super().__init__(space.dim, space.dim, space.dtype, space.device, domain=space, codomain=space)
        self.layouts = layouts

    def block_product(self, name: str, v: Tensor) -> Tensor:
        """The block of parameter ``name`` times ``v [K, *p]``.

        Args:
            name: the parameter's name.
            v: ``[K, *p.shape]``: ``K`` vectors shaped like the parameter.

        Returns:
            Tensor: ``[K, *p.shape]``, the block times each vector.
        """
        raise NotImplementedError

    def matmat(self, M: Tensor) -> Tensor:
        V = self.domain.unflatten(M)
        return self.domain.flatten({name: self.block_product(name, v) for name, v in V.items()})

    def to_dense(self, chunk: int = 64) -> Tensor:
        """The matrix ``[P, P]``: the blocks on the diagonal, each formed on its own.

        Args:
            chunk: unused (the blocks are formed whole); as ``CurvatureOperator.to_dense``'s.

        Returns:
            Tensor: ``[P, P]``, block-diagonal.
        """
        blocks = [_kronblocks.dense_block(lambda v, n=name: self.block_product(n, v), shape, self.dtype, self.device)
                  for name, shape in zip(self.domain.names, self.domain.shapes)]
        return torch.block_diag(*blocks)


class KroneckerInverse(KroneckerOperator):
    r"""$(A + \lambda I)^{-1}$ of a Kronecker operator ``A``, per block $Q \operatorname{diag}(\Lambda + \lambda)^{-1} Q^\top$ (``Λ``: the
    spectrum ``spectra[name]``, ``[G, o, a]`` in the block's core layout); from ``A.inverse``.

    Args:
        space: the parameter space of its rows and columns (``ParameterSpace``).
        layouts (dict): parameter name -> the block's core layout, as ``A``'s.
        eigen (dict): parameter name -> the eigendecompositions of ``A``'s factors.
        spectra (dict): parameter name -> $\Lambda + \lambda$ (``[G, o, a]``), the damped spectrum inverted.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib.operators import KFAC
        >>> model = nn.Sequential(nn.Linear(3, 2)).double()
        >>> X, y = torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 2, (8,))
        >>> K = KFAC(model, nn.CrossEntropyLoss(), (X, y), fisher_type="exact")
        >>> dense = K.to_dense() + 0.1 * torch.eye(K.shape[0], dtype=torch.float64)
        >>> torch.allclose(K.inverse(0.1).to_dense(), torch.linalg.inv(dense))
        True
    """

    def __init__(self, space: ParameterSpace, layouts, eigen: Dict[str, _kronbasis.Eigen], spectra: Dict[str, Tensor]):
        super().__init__(space, layouts)
        self.eigen, self.spectra = eigen, spectra

    def block_product(self, name, v):
        return _kronblocks.spectral(self.layouts[name], self.eigen[name], 1.0 / self.spectra[name], v)


class KFAC(KroneckerOperator):
    r"""KFAC of ``model``'s curvature on ``data`` (module doc): one block per parameter, the
    Kronecker product of its factors.

    Args:
        model: any module ``curvature`` takes.
        lossfn: as for ``curvature``.
        data: ``(X, y)``, or a re-iterable loader of such pairs (one pass; EKFAC: two).
        params: parameter name -> tensor: these values, and the operator acts on exactly these
            parameters; default: the model's, on every ``requires_grad`` one.
        buffers: buffer name -> tensor, replacing the model's (as for ``curvature``).
        output: the tensor of a container output the loss takes (as for ``curvature``).
        generator: draws the Monte-Carlo labels (``fisher_type="mc"``); seeded, reproducible.
        fisher_type: ``"mc"`` (default), ``"exact"`` or ``"empirical"`` (module doc).
        mc_samples: sampled labels per sample (``"mc"`` only).
        max_factor_dim: a factor side larger than it is diagonal (as for the extensions).
        kfac_approx: ``None``, ``"expand"`` or ``"reduce"`` for weights shared by positions (as
            for the extensions; curvlinops' default is ``"expand"``; the three coincide without
            shared positions).
        keep_factors: ``False``: each block's factors are freed once eigendecomposed, at construction
            (``factors`` is ``None``; each block is $Q \operatorname{diag}(\lambda_{out} \lambda_{in}^\top) Q^\top$, equal up to rounding).

    Attributes:
        factors: parameter name -> its list of factors, combined over the data (``curvature``'s
            layout; what ``curvlib.precondition.kron_preconditioner`` takes; ``None`` with
            ``keep_factors=False``); a weight's and its bias's shared output side is one tensor.
        layouts: parameter name -> how the parameter reshapes to its block's core ``[G, o, a]``.
        eigen: parameter name -> the factors' eigendecompositions (clamped at 0).

    Raises:
        CurvatureError: an unsupported ``fisher_type``, ``mc_samples`` or option, data without
            batches, several batches of a loss of unknown normalisation, or what ``curvature``
            refuses.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib.operators import KFAC
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> K = KFAC(model, nn.CrossEntropyLoss(), (X, y), fisher_type="exact")
        >>> K.shape, [f.shape for f in K.factors["0.weight"]]
        ((26, 26), [torch.Size([4, 4]), torch.Size([3, 3])])
        >>> v = torch.randn(26)
        >>> torch.allclose(K.inverse(0.1) @ (K @ v + 0.1 * v), v, atol=1e-4)
        True
    """

    def __init__(self, model: nn.Module, lossfn, data, params: Optional[Mapping[str, Tensor]] = None,
                 buffers: Optional[Mapping[str, Tensor]] = None, output=None,
                 generator: Optional[torch.Generator] = None, fisher_type: str = "mc", mc_samples: int = 1,
                 max_factor_dim: Optional[int] = None, kfac_approx: Optional[str] = None, *,
                 keep_factors: bool = True):
        _check_options(fisher_type, mc_samples, generator)
        self.fisher_type, self.mc_samples, self.generator = fisher_type, mc_samples, generator
        self.spec = losses.loss_spec(lossfn)
        self.model, self.lossfn, self.data, self.output = model, lossfn, data, output
        self.params, self.buffers = params, buffers
        options = dict(max_factor_dim=max_factor_dim, kfac_approx=kfac_approx)
        extension = {"mc": lambda: ext.KFAC(mc_samples=mc_samples, generator=generator, **options),
                     "exact": lambda: ext.KFLR(**options),
                     "empirical": lambda: ext.KFACEmpirical(**options)}[fisher_type]()
        self.factors, space = self._accumulate(extension)
        transposed = transposed_weights(model)
        layouts = {n: _kronbasis.layout_of(n, self.factors[n], s, n in transposed) for n, s in zip(space.names, space.shapes)}
        super().__init__(space, layouts)
        self._eigen: Dict[str, _kronbasis.Eigen] = {}
        if not keep_factors:
            self._decompose_releasing()

    def batches(self, extension: ext.Extension, accumulator: _kronblocks.Accumulator, size: Optional[int] = None):
        """``(qs, N_b, root weight μ_b)`` per batch of the data (``accumulator`` counts it, and
        refuses a batch it cannot weight before its work), ``qs = curvature(...)`` with ``extension``;
        ``size``: batches cut into slices of at most that many samples (:class:`~curvlib.operators.data.Sliced`).

        :meta private:
        """
        f = curvature(self.model, self.lossfn, [extension], output=self.output)
        for X, y in Sliced(self.data, size):
            weight = accumulator.root_weight(losses.normaliser(self.spec, y))
            yield f(X, y, params=self.params, buffers=self.buffers), _inputs.batch_size(X), weight, X

    def accumulator(self) -> _kronblocks.Accumulator:
        """A fresh accumulator of the data's batches for this loss and ``fisher_type``.

        :meta private:
        """
        return _kronblocks.Accumulator(self.spec.reduction, self.fisher_type == "empirical", self.spec.name)

    def _accumulate(self, extension):
        accumulator = self.accumulator()
        total, sides, space = None, None, None
        for qs, samples, weight, X in self.batches(extension, accumulator):
            part = qs[extension.name]
            if space is None:
                space = ParameterSpace.of(qs["grad"])
                runner = Network(self.model, self.lossfn, self.output).runner
                sides = _kronblocks.root_sides(part, runner.kron_root_last(X, self.params))
            total = accumulator.add_factors(total, part, sides, samples, weight)
            del qs, part  # the batch's own factors and gradient: not alive beside the next batch's
        if total is None:
            raise CurvatureError("data has no batches: pass (X, y) or a loader yielding at least one (X, y).")
        return accumulator.factors(total, sides), space

    def block_product(self, name, v):
        if self.factors is None:  # keep_factors=False: Q diag(λ_out λ_inᵀ) Qᵀ from the eigendecompositions
            spectrum = _kronblocks.damped_spectrum(self.eigen[name], self.layouts[name], 0.0, False)
            return _kronblocks.spectral(self.layouts[name], self.eigen[name], spectrum, v)
        return _kronblocks.multiply(self.layouts[name], self.factors[name], v)

    @property
    def eigen(self) -> Dict[str, _kronbasis.Eigen]:
        """Parameter name -> its factors' eigendecompositions (computed once, when first needed; a shared
        factor once; eigenvalues clamped at 0: ``lam_out [G, o]``, ``lam_in [G, a]``, ``q_out``, ``q_in``)."""
        done: dict = {}
        for name in self.domain.names:
            if name not in self._eigen:
                self._eigen[name] = _kronbasis.eigen_of(self.factors[name], self.layouts[name], name, done)
        return self._eigen

    def _decompose_releasing(self) -> None:
        """Every block's eigendecompositions, its factors freed once decomposed; ``factors`` becomes ``None``."""
        factors, self.factors = self.factors, None
        done: dict = {}
        for name in self.domain.names:
            self._eigen[name] = _kronbasis.eigen_of(factors.pop(name), self.layouts[name], name, done)

    def inverse(self, damping: float, heuristic: bool = False) -> KroneckerInverse:
        r"""$(K + \lambda I)^{-1}$, exact per block (``heuristic=True``: Martens & Grosse's π-damping,
        $(R + \sqrt{\lambda} / \pi)^{-1} \otimes (I + \pi \sqrt{\lambda})^{-1}$ per two-factor block; a single factor: exact).

        Raises:
            CurvatureError: ``damping`` not a positive finite number.

        Args:
            damping: $\lambda > 0$.
            heuristic: π-damping instead of the exact inverse of each damped block.

        Returns:
            KroneckerInverse: $(K + \lambda I)^{-1}$, an operator on the same parameter space.
        """
        lam = _check_damping(damping)
        spectra = {n: _kronblocks.damped_spectrum(e, self.layouts[n], lam, bool(heuristic)) for n, e in self.eigen.items()}
        return KroneckerInverse(self.domain, self.layouts, self.eigen, spectra)


class EKFAC(KFAC):
    """Eigenvalue-corrected KFAC (George et al., 2018; module doc): KFAC's eigenbasis, eigenvalues
    ``Λ*`` fitted to the columns of the matrix's root, batch by batch.

    Args:
        model: the network (any module ``curvature`` takes).
        lossfn: the loss, as for ``curvature``.
        data: ``(X, y)``, or a re-iterable loader of such pairs (two passes: the factors, then
            the eigenvalues).
        params: parameter name -> tensor: these values, and the operator acts on exactly these
            parameters; default (None): the model's, on every ``requires_grad`` one.
        buffers: buffer name -> tensor, replacing the model's (as for ``curvature``).
        output: the tensor of a container output the loss takes (as for ``curvature``).
        generator: draws the Monte-Carlo labels (``fisher_type="mc"``); seeded, reproducible.
        fisher_type: ``"mc"`` (default), ``"exact"`` or ``"empirical"``, as for ``KFAC``.
        mc_samples: sampled labels per sample (``"mc"`` only).
        max_factor_dim: a factor side larger than it is diagonal (as for the extensions).
        kfac_approx: ``None``, ``"expand"`` or ``"reduce"``, as for ``KFAC``.
        correction_batch_size: samples per ``curvature`` call in the eigenvalue pass, whose roots are
            ``[C·N_b, P]`` (or ``[M·N_b, P]``, ``[N_b, P]``), the parameters then in groups of at most
            ``P / (1 + C·N_b)`` entries, a call each (``curvlib.operators.data.parameter_groups``);
            None: the data's batches, all parameters at once. The same eigenvalues either way.
        keep_factors: as for ``KFAC`` (``False``: the factors are freed before the eigenvalue pass).

    Attributes:
        eigenvalues: parameter name -> ``Λ* [G, o, a]`` in the block's core layout (what
            ``curvlib.precondition.ekfac_preconditioner`` takes, with ``factors``).

    Raises:
        CurvatureError: as ``KFAC``, and a ``correction_batch_size`` that is not a positive int
            or None.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib.operators import EKFAC
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> E = EKFAC(model, nn.CrossEntropyLoss(), (X, y), fisher_type="exact")
        >>> E.eigenvalues["0.weight"].shape                 # [G, o, a]
        torch.Size([1, 4, 3])
        >>> v = torch.randn(26)
        >>> torch.allclose(E.inverse(0.1) @ (E @ v + 0.1 * v), v, atol=1e-4)
        True
    """

    def __init__(self, model: nn.Module, lossfn, data, params=None, buffers=None, output=None, generator=None,
                 fisher_type: str = "mc", mc_samples: int = 1, max_factor_dim: Optional[int] = None,
                 kfac_approx: Optional[str] = None, correction_batch_size: Optional[int] = None, *,
                 keep_factors: bool = True):
        Sliced(data, correction_batch_size)  # checks the size before any work
        self.correction_batch_size = correction_batch_size
        super().__init__(model, lossfn, data, params, buffers, output, generator, fisher_type, mc_samples,
                         max_factor_dim, kfac_approx, keep_factors=keep_factors)
        root = {"mc": lambda: ext.SqrtGGNMC(mc_samples=mc_samples, generator=generator),
                "exact": ext.SqrtGGNExact, "empirical": ext.BatchGrad}[fisher_type]()
        self.eigenvalues = self._correct(root)

    def _correct(self, root: ext.Extension) -> Dict[str, Tensor]:
        eigen, accumulator, size = self.eigen, self.accumulator(), self.correction_batch_size
        f = curvature(self.model, self.lossfn, [root], output=self.output)
        # with a batch size, one call per group of parameters, its gradient and C·N_b root columns together
        # at most the model's gradient; the generator restarted for each group: the same sampled labels
        groups = _kronblocks.grouped_params(self.model, self.params, self.domain, size and size * self.mc_samples)
        total: Dict[str, Tensor] = {}
        for X, y in Sliced(self.data, size):
            weight = accumulator.root_weight(losses.normaliser(self.spec, y))
            for roots in _kronblocks.grouped_roots(partial(f, X, y, buffers=self.buffers), groups, self.generator, root.name):
                _kronblocks.add_projected(total, roots, self.layouts, eigen, weight)
        return {name: s.mul_(accumulator.root_scale()) for name, s in total.items()}

    def block_product(self, name, v):
        return _kronblocks.spectral(self.layouts[name], self.eigen[name], self.eigenvalues[name], v)

    def inverse(self, damping: float, heuristic: bool = False) -> KroneckerInverse:
        r"""$(E + \lambda I)^{-1} = Q \operatorname{diag}(\Lambda^* + \lambda)^{-1} Q^\top$ per block, exact (``heuristic`` is refused: π-damping
        splits λ between two factors, which EKFAC's eigenvalues are not).

        Raises:
            CurvatureError: ``damping`` not a positive finite number, or ``heuristic=True``.

        Args:
            damping: $\lambda > 0$.
            heuristic: must be False.

        Returns:
            KroneckerInverse: $(E + \lambda I)^{-1}$, an operator on the same parameter space.
        """
        lam = _check_damping(damping)
        if heuristic:
            raise CurvatureError("EKFAC.inverse(heuristic=True) is not supported: its eigenvalues are not a "
                                 "Kronecker product of two factors' to split the damping between; use heuristic=False.")
        return KroneckerInverse(self.domain, self.layouts, self.eigen, {n: s + lam for n, s in self.eigenvalues.items()})
