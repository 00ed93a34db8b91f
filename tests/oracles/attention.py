"""The attention tests' check: every exact extension against the brute force, with the oracles
run the way PyTorch's attention modules can be differentiated by ``torch.func``.

The second-order oracles use ``torch.func`` (``jacrev``/``hessian``), under which PyTorch's
slow path is taken (parameters require grad), with SDPA pinned to its composite math kernel
(``sdpa_kernel(SDPBackend.MATH)``: the fused CPU kernel has no forward-mode derivative) and
the MHA fast path off (``torch.backends.mha.set_fastpath_enabled(False)``, which only
changes how the no-grad reference loss is computed): :func:`oracle_mode`. curvlib itself
is run with neither setting and must not warn.
"""

import contextlib
import warnings

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from curvlib import curvature

from oracles.reference import assert_matches, exact_extensions, reference

DT = torch.float64
CE = nn.CrossEntropyLoss()


@contextlib.contextmanager
def oracle_mode():
    """Composite SDPA and no MHA fast path for the oracles (see the module doc)."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def check_all(model, X, y, lossfn=CE, hessian=True, rtol=1e-7):
    """Every exact extension against :func:`oracles.reference.reference`; curvlib must not warn."""
    exts = exact_extensions(hessian=hessian)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=DeprecationWarning)  # torch's own jit-decomposition loader
        # (a mode that leaves a projection unused: zero quantities, said once)
        warnings.filterwarnings("ignore", message="curvlib: the model's forward does not use")
        qs = curvature(model, lossfn, exts)(X, y)
    with oracle_mode():
        ref = reference(model, lossfn, X, y, hessian=hessian, pchmp=False)
    assert_matches(qs, ref, type(model).__name__, rtol)
    return qs
