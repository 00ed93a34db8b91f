"""The extensions: pass instances to ``curvlib.curvature``.

Each instance's ``name`` is the key of its result (BackPACK's attribute name).
"""

from ._base import Extension
from .firstorder import BatchGrad, BatchL2Grad, SumGradSquared, Variance
from .secondorder import (
    GGNMP,
    HMP,
    KFAC,
    KFACEmpirical,
    KFLR,
    KFRA,
    PCHMP,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    BatchDiagHessian,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SecondOrder,
    SqrtGGNExact,
    SqrtGGNMC,
)

__all__ = [
    "Extension", "SecondOrder",
    "BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance",
    "DiagGGNExact", "DiagGGNMC", "BatchDiagGGNExact", "BatchDiagGGNMC",
    "DiagHessian", "BatchDiagHessian", "KFAC", "KFLR", "KFRA", "KFACEmpirical",
    "SqrtGGNExact", "SqrtGGNMC", "GGNMP", "HMP", "PCHMP",
]
