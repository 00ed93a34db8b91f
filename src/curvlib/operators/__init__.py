"""The whole network's curvature: linear operators over all parameters and a data loader, and
the spectral, trace and solver tools that act on them.

Operators (:mod:`~curvlib.operators.network`, :mod:`~curvlib.operators.jacobian`): ``A @ v``
multiplies without forming the matrix, ``A.to_scipy()``, ``A.to_dense()``.

Example::

    >>> import torch
    >>> from torch import nn
    >>> from curvlib.operators import GGN
    >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    >>> X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    >>> G = GGN(model, nn.CrossEntropyLoss(), (X, y))
    >>> G.shape
    (26, 26)
    >>> (G @ torch.randn(26)).shape
    torch.Size([26])
"""

from .base import CurvatureOperator, ParameterSpace
from .jacobian import Jacobian, TransposedJacobian
from .network import GGN, EmpiricalFisher, FisherMC, Hessian, NetworkOperator
from .eigen import Eigenpairs, SpectralDensity, lanczos, spectral_density
from .estimators import Estimate, hutchinson_diagonal, hutchinson_trace, hutchpp_trace, xdiag, xtrace
from .solvers import Solution, cg, minres

__all__ = [
    "CurvatureOperator", "ParameterSpace", "NetworkOperator",
    "GGN", "FisherMC", "EmpiricalFisher", "Hessian", "Jacobian", "TransposedJacobian",
    "Eigenpairs", "SpectralDensity", "lanczos", "spectral_density",
    "Estimate", "hutchinson_trace", "hutchpp_trace", "xtrace", "hutchinson_diagonal", "xdiag",
    "Solution", "cg", "minres",
]
