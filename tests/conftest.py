"""Test set-up: one torch thread, float64 oracles, derandomised hypothesis in CI."""

import os

import torch
from hypothesis import HealthCheck, settings

# Tiny float64 convolutions are ~200x slower with 2 threads than with 1.
torch.set_num_threads(1)

_common = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("ci", derandomize=True, max_examples=25, print_blob=True, **_common)
settings.register_profile("dev", max_examples=25, **_common)
settings.register_profile("thorough", max_examples=300, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

