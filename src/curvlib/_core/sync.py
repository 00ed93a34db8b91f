"""One lock for the parts of curvlib that touch process-wide state.

Several threads may call the same ``f`` (or different ones on one model).
Most of the work is thread-safe, but three things are process-wide in torch:

* forward-mode AD (``torch.func.jvp``, ``jacfwd``, ``hessian``): its dual-level
  state is global, so two threads running ``jvp`` at once corrupt each other's
  tangents;
* ``functional_call`` swaps a module's parameter and buffer slots for the
  duration of the call (the generic rule), and the eager runner redirects the
  layers' ``forward`` for one run: another thread would see the swapped slots;
* the global random state, which the block products replay.

Every such section runs under :data:`LOCK` (re-entrant: the sections nest).
"""

import threading
import warnings

LOCK = threading.RLock()


_FORWARD_AD_READY = False


def prepare_forward_ad() -> None:
    """Load torch's forward-mode decompositions once, quietly.

    The first dual tensor of a process makes torch script its jvp decompositions
    (``torch.autograd.forward_ad._maybe_load_decompositions``), which warns that
    ``torch.jit.script`` is deprecated, inside the user's call. Loading them here,
    with that warning silenced, keeps a call free of torch's warnings (paid once a process).
    """
    global _FORWARD_AD_READY
    if _FORWARD_AD_READY:
        return
    with LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch.autograd import forward_ad  # lazy: its import scripts jvp decompositions (see above)

        forward_ad._maybe_load_decompositions()
        _FORWARD_AD_READY = True
