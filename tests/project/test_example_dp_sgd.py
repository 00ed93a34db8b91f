"""examples/dp_sgd.py: the clipped sum of individual gradients, both ways, against a brute force.

Oracle: per-sample gradients from ``torch.func.vmap(grad)`` of the one-sample loss
(float64), clipped by hand with ``min(1, C / (‖g_n‖ + 1e-6))`` and summed. And, when
Opacus is installed, its ``GradSampleModule`` + ``DPOptimizer`` clipping.
"""

import os
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.func import functional_call, grad, vmap

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
import dp_sgd  # noqa: E402


@pytest.fixture(autouse=True)
def _on_cpu():
    with torch.device("cpu"):  # a CPU script, whatever CURVLIB_TEST_DEVICE says
        yield


def brute_force_clipped_sum(model, X, y, max_norm):
    params = {k: p.detach() for k, p in model.named_parameters()}

    def one_loss(p, x, t):
        return nn.functional.cross_entropy(functional_call(model, p, (x[None],)), t[None], reduction="sum")

    per_sample = vmap(grad(one_loss), in_dims=(None, 0, 0))(params, X, y)
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in per_sample.values()]).sum(0).sqrt()
    c = torch.clamp(max_norm / (norms + 1e-6), max=1.0)
    return {k: (c.view(-1, *[1] * (g.dim() - 1)) * g).sum(0) for k, g in per_sample.items()}


def problem(kind, n, seed):
    torch.manual_seed(seed)  # CPU (the fixture), so the global stream
    model = dp_sgd.make_model(kind).double()
    X = torch.rand(n, 64, dtype=torch.float64)
    y = torch.randint(0, 10, (n,))
    return model, X, y


def assert_close(got, want, rtol=1e-10):
    scale = max(float(v.abs().max()) for v in want.values())
    for k in want:
        err = float((got[k] - want[k]).abs().max())
        assert err <= rtol * scale, f"{k}: max error {err:.2e} vs scale {scale:.2e}"


@settings(max_examples=12, deadline=None)
@given(kind=st.sampled_from(["mlp", "conv"]), n=st.integers(1, 9), seed=st.integers(0, 1000),
       max_norm=st.floats(1e-3, 1e2), variant=st.sampled_from(["materialized", "ghost"]))
def test_clipped_sum_matches_brute_force(kind, n, seed, max_norm, variant):
    model, X, y = problem(kind, n, seed)
    fn = dp_sgd.clipped_sum_materialized if variant == "materialized" else dp_sgd.clipped_sum_ghost
    got = fn(model, nn.CrossEntropyLoss(reduction="sum"), X, y, max_norm)
    assert_close(got, brute_force_clipped_sum(model, X, y, max_norm))


def test_clipping_is_active_and_the_check_can_fail():
    """With a small C every sample is clipped (the sum is not the gradient), and a wrong C is caught."""
    model, X, y = problem("mlp", 6, 0)
    lossfn = nn.CrossEntropyLoss(reduction="sum")
    got = dp_sgd.clipped_sum_ghost(model, lossfn, X, y, 0.01)
    full = torch.autograd.grad(lossfn(model(X), y), list(model.parameters()))
    assert max(float(g.abs().max()) for g in got.values()) < 0.5 * max(float(g.abs().max()) for g in full)
    with pytest.raises(AssertionError):
        assert_close(got, brute_force_clipped_sum(model, X, y, 0.0101))


@pytest.mark.parametrize("kind", ["mlp", "conv"])
def test_matches_opacus(kind):
    pytest.importorskip("opacus")
    model, X, y = problem(kind, 16, 3)
    theirs = dp_sgd.opacus_clipped_sum(model, X, y, 0.5)
    assert_close(dp_sgd.clipped_sum_materialized(model, nn.CrossEntropyLoss(reduction="sum"), X, y, 0.5), theirs)
    assert_close(dp_sgd.clipped_sum_ghost(model, nn.CrossEntropyLoss(reduction="sum"), X, y, 0.5), theirs)
