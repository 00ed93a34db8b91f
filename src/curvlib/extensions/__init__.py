"""The extensions: pass instances to :func:`curvlib.curvature`.

Each instance's ``name`` is the key of its result.
"""

from ._base import Extension
from .firstorder import BatchGrad, BatchL2Grad, SumGradSquared, Variance

__all__ = ["Extension", "BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance"]
