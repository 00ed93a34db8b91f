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


# Known bugs found by the second-order oracle tests, kept visible until fixed
# (see CHANGELOG "Known issues"); strict, so a fix turns them red as XPASS.
import pytest  # noqa: E402

KNOWN_BUGS = {
    "test_embedding_padding_row_products": "GGNMP/HMP/PCHMP: forward-mode derivative of "
    "F.embedding includes the padding_idx row that PyTorch's backward zeroes",
    "test_products_with_no_vectors[HMP]": "HMP with V=0 vectors fails inside torch.func",
    "test_hmp_mse_mean": "HMP on MSE(mean): double backward hits an immutable ZeroTensor",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        for key, why in KNOWN_BUGS.items():
            if item.name.startswith(key) or item.name == key:
                item.add_marker(pytest.mark.xfail(reason=why, strict=True))
