"""The whole network's curvature: linear operators over all parameters and a data loader, and
the spectral, trace and solver tools that act on them.

Operators (``A @ v`` multiplies without forming the matrix; ``A.to_dense()``, ``A.to_scipy()``,
``A.block(names)``):

* :class:`GGN`, :class:`FisherMC`, :class:`EmpiricalFisher`, :class:`Hessian` and
  :class:`Jacobian` (:mod:`~curvlib.operators.network`, :mod:`~curvlib.operators.jacobian`);
* :class:`KFAC` and :class:`EKFAC`, with ``.inverse(damping)`` (:mod:`~curvlib.operators.kronecker`).

Tools, on any operator (or dense matrix) ``A`` with ``A.shape``, ``A.dtype``, ``A.device`` and
``A @ M``: :func:`lanczos` eigenpairs and :func:`spectral_density` (:mod:`~curvlib.operators.eigen`);
:func:`hutchinson_trace`, :func:`hutchpp_trace`, :func:`xtrace`, :func:`hutchinson_diagonal`,
:func:`xdiag` (:mod:`~curvlib.operators.estimators`); :func:`cg`, :func:`minres`
(:mod:`~curvlib.operators.solvers`).

Example::

    >>> import torch
    >>> from torch import nn
    >>> from curvlib.operators import GGN, lanczos
    >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    >>> X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    >>> G = GGN(model, nn.CrossEntropyLoss(), (X, y))
    >>> G.shape
    (26, 26)
    >>> (G @ torch.randn(26)).shape
    torch.Size([26])
    >>> lanczos(G, k=2).values.shape
    torch.Size([2])
"""

from .base import CurvatureOperator, ParameterSpace
from .eigen import Eigenpairs, SpectralDensity, lanczos, spectral_density
from .estimators import Estimate, hutchinson_diagonal, hutchinson_trace, hutchpp_trace, xdiag, xtrace
from .jacobian import Jacobian, TransposedJacobian
from .kronecker import EKFAC, KFAC, KroneckerInverse, KroneckerOperator
from .hessian import Hessian
from .network import GGN, EmpiricalFisher, FisherMC, NetworkOperator
from .solvers import Solution, cg, minres

__all__ = [
    # operators
    "CurvatureOperator", "ParameterSpace", "NetworkOperator",
    "GGN", "FisherMC", "EmpiricalFisher", "Hessian", "Jacobian", "TransposedJacobian",
    "KroneckerOperator", "KFAC", "EKFAC", "KroneckerInverse",
    # spectra
    "Eigenpairs", "SpectralDensity", "lanczos", "spectral_density",
    # traces and diagonals
    "Estimate", "hutchinson_trace", "hutchpp_trace", "xtrace", "hutchinson_diagonal", "xdiag",
    # inverse products
    "Solution", "cg", "minres",
]
