"""Linear rule against the per-sample-copies oracle."""

import torch
from hypothesis import given, strategies as st
from torch import nn

from oracles.checks import check_first_order
from oracles.on_device import seeded


def _targets(kind, out, gen):
    if kind == "ce":
        return torch.randint(0, out.shape[1], (out.shape[0],) + tuple(out.shape[2:]), generator=gen)
    if kind == "bce":
        return torch.rand(out.shape, generator=gen, dtype=out.dtype)
    return torch.randn(out.shape, generator=gen, dtype=out.dtype)


LOSSES = {"mse": nn.MSELoss, "ce": nn.CrossEntropyLoss, "bce": nn.BCEWithLogitsLoss}


@given(
    n=st.integers(1, 4),
    extra=st.lists(st.integers(1, 3), max_size=2),
    i=st.integers(1, 5),
    o=st.integers(1, 4),
    bias=st.booleans(),
    loss=st.sampled_from(sorted(LOSSES)),
    reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**16),
)
def test_linear_any_leading_dims(n, extra, i, o, bias, loss, reduction, seed):
    gen = seeded(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(i, 3, bias=bias), nn.Sigmoid(), nn.Linear(3, o, bias=bias)).double()
    X = torch.randn((n, *extra, i), generator=gen, dtype=torch.float64)
    if loss == "ce" and extra:
        # [N, *S, C] -> [N, C, *S] for class-per-position outputs
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.net = model

            def forward(self, x):
                return self.net(x).movedim(-1, 1)

        model = M()
    out = model(X)
    y = _targets(loss, out, gen)
    check_first_order(model, LOSSES[loss](reduction=reduction), X, y)


def test_linear_large_sequence_uses_materialised_path():
    """s² > O·I switches batch_l2 to the materialised path; both must agree with the oracle."""
    torch.manual_seed(0)
    model = nn.Linear(2, 2).double()
    X = torch.randn(3, 7, 2, dtype=torch.float64)
    check_first_order(model, nn.MSELoss(), X, torch.randn(3, 7, 2, dtype=torch.float64))


def test_linear_batch_not_in_dim0():
    """A Linear applied to [T, N, I] (batch in dim 1) is handled exactly."""

    class TimeMajor(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):  # x [N, T, I]
            return self.fc(x.transpose(0, 1)).transpose(0, 1).sum(1)

    torch.manual_seed(0)
    model = TimeMajor().double()
    X = torch.randn(4, 5, 3, dtype=torch.float64)
    check_first_order(model, nn.CrossEntropyLoss(), X, torch.randint(0, 2, (4,)))


@given(
    n=st.integers(1, 3),
    positions=st.integers(5, 12),
    i=st.integers(1, 4),
    o=st.integers(1, 3),
    bias=st.booleans(),
    only_batch_grad=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_linear_over_positions_gradient_summed_from_individual_ones(n, positions, i, o, bias, only_batch_grad, seed):
    """With the individual gradients requested, a Linear over >= 8 positions sums them for
    ``grad`` (``Σ_n g_n``) instead of the product ``gᵀx``: both paths against the oracle."""
    from curvlib.extensions import BatchGrad, BatchL2Grad

    gen = seeded(seed)
    model = nn.Sequential(nn.Linear(i, 3, bias=bias), nn.Tanh(), nn.Linear(3, o, bias=bias)).double()
    X = torch.randn(n, positions, i, generator=gen, dtype=torch.float64)
    y = torch.randn(n, positions, o, generator=gen, dtype=torch.float64)
    exts = (BatchGrad,) if only_batch_grad else (BatchGrad, BatchL2Grad)
    qs = check_first_order(model, nn.MSELoss(), X, y, exts)
    for name, g in qs["grad"].items():
        torch.testing.assert_close(g, qs["grad_batch"][name].sum(0))


@given(
    n=st.integers(1, 12),
    positions=st.integers(2, 4),
    i=st.integers(1, 4),
    o=st.integers(1, 5),
    entries=st.sampled_from([1, 3, 16, 2**24]),
    reuse=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_linear_squares_in_blocks_with_the_gradient(n, positions, i, o, entries, reuse, seed):
    """``grad_with_squares`` and ``sum_grad_squared`` of a Linear over positions, formed in blocks
    of samples or rows (``Settings.linear_squares_entries``), squared one sample at a time or (more than 8 per
    block) in two kernels, into a reused scratch buffer or fresh ones, twice in a row with
    different sizes: ``Σ_n (Σ_s g xᵀ)²`` and ``Σ_n Σ_s g xᵀ`` against the per-sample float64 oracle."""
    from unittest import mock

    import curvlib.rules.linear as linear
    from curvlib._core.scratch import reusing
    from curvlib._core.settings import override
    from curvlib._core.site import Site

    gen = seeded(seed)
    with override(linear_squares_entries=entries), (reusing() if reuse else mock.MagicMock()):
        for o_k in (o, o + 2):
            x = torch.randn(n, positions, i, generator=gen, dtype=torch.float64)
            g = torch.randn(n, positions, o_k, generator=gen, dtype=torch.float64)
            site = Site(linear.LINEAR, {"weight": "w", "bias": "b"}, "fc", meta={"batch_dim": 0}, saved={"x": x})
            per_sample = torch.einsum("nso,nsi->noi", g, x)
            grads, squares = linear.grad_with_squares(site, g, ["weight", "bias"])
            alone = linear.sum_grad_squared(site, g, ["weight"])
            torch.testing.assert_close(grads["weight"], per_sample.sum(0))
            torch.testing.assert_close(squares["weight"], (per_sample**2).sum(0))
            torch.testing.assert_close(alone["weight"], (per_sample**2).sum(0))
            torch.testing.assert_close(squares["bias"], (g.sum(1) ** 2).sum(0))
