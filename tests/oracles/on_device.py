"""The device every test runs on: ``CURVLIB_TEST_DEVICE`` (default ``cpu``).

``conftest.py`` makes it torch's default device when the variable is set, so
tensors, modules and parameters that tests create without a ``device=`` land
there; random streams come from :func:`seeded`, a generator on the same device
(torch refuses a CPU generator for a CUDA tensor). With the variable unset, or
``cpu``, ``seeded(seed)`` is exactly ``torch.Generator().manual_seed(seed)``.

Kept free of curvlib imports so that conftest, oracles and models can use it.
"""

from __future__ import annotations

import functools
import os

import torch

#: The environment as the test session found it, before any library imported later sets its own
#: variables (torch.compile's inductor stores a pointer in ``_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR``,
#: scikit-learn the ``KMP_*`` OpenMP switches): what a subprocess a test starts should inherit.
CLEAN_ENVIRON = dict(os.environ)

SWITCH = "CURVLIB_TEST_DEVICE"
DEVICE = torch.device(os.environ.get(SWITCH) or "cpu")
ON_CPU = DEVICE.type == "cpu"
CPU_ONLY = "inherently CPU-bound: kept off the device chosen by " + SWITCH


def seeded(seed: int) -> torch.Generator:
    """A generator on the test device, seeded with ``seed``."""
    return torch.Generator(device=DEVICE).manual_seed(seed)


def plain_kernels(fn):
    """``fn`` run with cuDNN off, for the oracles' brute force: the plain kernels have what
    cuDNN's lack (an RNN's double backward and its backward in eval mode), and no TF32
    convolutions. On the CPU it changes nothing."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with torch.backends.cudnn.flags(enabled=False):
            return fn(*args, **kwargs)

    return wrapped
