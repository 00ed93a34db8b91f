"""Whole-network curvature operators and the algorithms that use them (the spectral helpers' part).

Minimal: imports the algorithm modules; the operators themselves are wired in separately.
"""

from .eigen import Eigenpairs, SpectralDensity, lanczos, spectral_density
from .estimators import Estimate, hutchinson_diagonal, hutchinson_trace, hutchpp_trace, xdiag, xtrace
from .solvers import Solution, cg, minres

__all__ = [
    "Eigenpairs",
    "SpectralDensity",
    "lanczos",
    "spectral_density",
    "Estimate",
    "hutchinson_trace",
    "hutchpp_trace",
    "xtrace",
    "hutchinson_diagonal",
    "xdiag",
    "Solution",
    "cg",
    "minres",
]
