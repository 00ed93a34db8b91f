"""The extensions: pass instances to ``curvlib.curvature``.

Each instance's ``name`` is the key of its result (BackPACK's attribute name).
"""

from ._base import Extension
from .firstorder import BatchGrad, BatchL2Grad, SumGradSquared, Variance
from ._base import SecondOrder
from .kronecker import KFAC, KFLR, KFRA, KFACEmpirical
from .products import GGNMP, HMP, PCHMP
from .secondorder import (
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    BatchDiagHessian,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
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
