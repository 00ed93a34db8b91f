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

LOCK = threading.RLock()
