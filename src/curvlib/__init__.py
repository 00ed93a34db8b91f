"""curvlib: per-sample gradients and curvature as a pure functional transform.

    from curvlib import curvature
    from curvlib.extensions import BatchGrad, BatchL2Grad

    qs = curvature(model, lossfn, [BatchGrad(), BatchL2Grad()])(X, y)

See ``help(curvlib.curvature)``, each extension's docstring, docs/conventions.md
and docs/migrating-from-backpack.md.
"""

from ._core.errors import CurvatureError, CurvatureTypeError
from ._core.strategy import strategy
from ._transform.entry import curvature

# help(curvlib.curvature) names the public module, not the private one it is written in
curvature.__module__ = __name__
from . import optim, precondition  # submodules: `curvlib.precondition` works after `import curvlib`

__all__ = ["curvature", "strategy", "CurvatureError", "CurvatureTypeError", "optim", "precondition"]
__version__ = "0.1.0"
