"""Test set-up: one torch thread, float64 oracles, derandomised hypothesis in CI.

Device switch: ``CURVLIB_TEST_DEVICE=cuda python -m pytest`` runs every test on
that device (default ``cpu``). When the variable is set (``cpu`` included, which
exercises the same path), it becomes torch's default device here, so the tests'
data, models and parameters are created on it, and ``oracles.on_device.seeded(seed)`` gives
random streams on it (use it instead of ``torch.Generator()``; a test checks
that no device-less generator is left). Subprocess tests pass the environment
on; tests that are inherently CPU-bound (thread counts, gloo) stay on CPU or
are skipped under a non-CPU switch, with the reason ``oracles.on_device.CPU_ONLY``.
torch's default device is thread-local: threads a test starts create their
tensors on CPU unless told otherwise.
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from oracles.on_device import DEVICE, SWITCH
from slow_cases import SLOW
import torchvision_shim

torchvision_shim.install()  # before anything imports torchvision (transformers, timm, laplace do)

# Tiny float64 convolutions are far slower with 2 threads than with 1.
torch.set_num_threads(1)

if os.environ.get(SWITCH):
    torch.set_default_device(DEVICE)

_common = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("ci", derandomize=True, max_examples=25, print_blob=True, **_common)
settings.register_profile("dev", max_examples=25, **_common)
settings.register_profile("thorough", max_examples=300, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))



def pytest_collection_modifyitems(items):
    """The measured slow cases (``slow_cases.SLOW``) are ``slow``, deselected by default."""
    for item in items:
        if item.nodeid in SLOW:
            item.add_marker(pytest.mark.slow)
