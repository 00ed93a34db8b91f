"""ConvTranspose1d/2d/3d rule against the per-sample-copies oracle, over every option."""

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib._core.settings import override
from curvlib.extensions import BatchGrad
from oracles.checks import check_first_order, check_ggn_columns
from oracles.on_device import seeded

LOSSES = {"mse": nn.MSELoss, "ce": nn.CrossEntropyLoss, "bce": nn.BCEWithLogitsLoss}
CONV_T = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


def targets(kind, out, gen):
    """Targets for ``out`` ([N, C, *] logits for CE)."""
    if kind == "ce":
        return torch.randint(0, out.shape[1], (out.shape[0],) + tuple(out.shape[2:]), generator=gen)
    if kind == "bce":
        return torch.rand(out.shape, generator=gen, dtype=out.dtype)
    return torch.randn(out.shape, generator=gen, dtype=out.dtype)


def _min_size(s, k, stride, pad, dil):
    return (s - 1) * stride - 2 * pad + dil * (k - 1) + 1


@st.composite
def conv_transpose_configs(draw, dims=(1, 2, 3)):
    """``(d, kwargs, spatial, extra)``: a valid nn.ConvTransposeNd, an input size, and
    ``extra[j]`` in ``[0, stride_j)`` to add to the minimal output size (for ``output_size``)."""
    d = draw(st.sampled_from(dims))
    groups = draw(st.integers(1, 2))
    c_in = groups * draw(st.integers(1, 2))
    c_out = groups * draw(st.integers(1, 2))
    smax = 5 if d < 3 else 3
    kernel = tuple(draw(st.integers(1, 3 if d < 3 else 2)) for _ in range(d))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(d))
    dilation = tuple(draw(st.integers(1, 3)) for _ in range(d))
    spatial = tuple(draw(st.integers(1, smax)) for _ in range(d))
    padding, output_padding, extra = [], [], []
    for k, s, dl, n in zip(kernel, stride, dilation, spatial):
        # the output must keep at least one position
        full = _min_size(n, k, s, 0, dl)
        padding.append(draw(st.integers(0, min(2, (full - 1) // 2))))
        output_padding.append(draw(st.integers(0, max(s, dl) - 1)))
        extra.append(draw(st.integers(0, s - 1)))
    kwargs = dict(
        in_channels=c_in,
        out_channels=c_out,
        kernel_size=kernel,
        stride=stride,
        padding=tuple(padding) if draw(st.booleans()) or d == 1 else padding[0],
        output_padding=tuple(output_padding),
        groups=groups,
        bias=draw(st.booleans()),
        dilation=dilation,
    )
    if not isinstance(kwargs["padding"], tuple):  # one int for every dim: must fit every dim
        p = min(padding)
        kwargs["padding"] = p
        padding = [p] * d
    return d, kwargs, spatial, tuple(extra)


class WithOutputSize(nn.Module):
    """``up(x, output_size=...)``, then an optional linear head."""

    def __init__(self, up, output_size, head_features):
        super().__init__()
        self.up = up
        self.output_size = list(output_size)
        self.head = None if head_features is None else nn.Linear(head_features, 3)

    def forward(self, x):
        h = self.up(x, output_size=self.output_size)
        if self.head is None:
            return h
        return self.head(torch.sigmoid(h).flatten(1))


@given(
    config=conv_transpose_configs(),
    n=st.integers(1, 3),
    head=st.booleans(),
    use_output_size=st.booleans(),
    loss=st.sampled_from(sorted(LOSSES)),
    reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**16),
)
def test_conv_transpose_all_options(config, n, head, use_output_size, loss, reduction, seed):
    d, kwargs, spatial, extra = config
    torch.manual_seed(seed)
    gen = seeded(seed)
    if use_output_size:
        kwargs = {**kwargs, "output_padding": 0}
    up = CONV_T[d](**kwargs).double()
    X = torch.randn((n, kwargs["in_channels"], *spatial), generator=gen, dtype=torch.float64)
    if use_output_size:
        pad = kwargs["padding"] if isinstance(kwargs["padding"], tuple) else (kwargs["padding"],) * d
        size = [
            _min_size(s, k, st_, p, dl) + e
            for s, k, st_, p, dl, e in zip(spatial, kwargs["kernel_size"], kwargs["stride"], pad,
                                           kwargs["dilation"], extra)
        ]
        with torch.no_grad():
            features = up(X, output_size=size).shape[1:].numel()
        model = WithOutputSize(up, size, features if head else None).double()
    else:
        with torch.no_grad():
            features = up(X).shape[1:].numel()
        model = nn.Sequential(up, nn.Sigmoid(), nn.Flatten(), nn.Linear(features, 3)) if head else up
        model = model.double()
    y = targets(loss, model(X), gen)
    check_first_order(model, LOSSES[loss](reduction=reduction), X, y)


@pytest.mark.parametrize("d", [1, 2, 3])
def test_encoder_decoder_with_output_size(d):
    """Conv (stride 2) then ConvTranspose back to the input's size via output_size, twice-used head."""

    class AutoEncoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.down = CONV[d](2, 4, 3, stride=2, padding=1)
            self.up = CONV_T[d](4, 2, 3, stride=2, padding=1, groups=2)

        def forward(self, x):
            return self.up(torch.tanh(self.down(x)), output_size=x.shape)

    torch.manual_seed(d)
    model = AutoEncoder().double()
    X = torch.randn((3, 2, *[4] * d), dtype=torch.float64)
    out = model(X)
    assert out.shape == X.shape
    check_first_order(model, nn.MSELoss(), X, torch.randn_like(X))


@pytest.mark.parametrize("d", [1, 2])
def test_conv_transpose_used_twice(d):
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = CONV_T[d](2, 2, 2, stride=1, padding=1, dilation=2)
            self.head = nn.Linear(2 * 4**d, 2)

        def forward(self, x):
            h = torch.tanh(self.up(x))
            return self.head(self.up(h).flatten(1))

    torch.manual_seed(0)
    model = Twice().double()
    X = torch.randn((3, 2, *[4] * d), dtype=torch.float64)
    check_first_order(model, nn.CrossEntropyLoss(reduction="sum"), X, torch.tensor([1, 0, 1]))


@pytest.mark.parametrize("channels, kernel, spatial", [(1, 1, 6), (4, 3, 2)])
def test_norm_paths(channels, kernel, spatial):
    """batch_l2 through the materialised (L² > A·B) and the Gram (L² ≤ A·B) branch."""
    torch.manual_seed(0)
    model = nn.ConvTranspose2d(channels, channels, kernel, stride=2).double()
    X = torch.randn(3, channels, spatial, spatial, dtype=torch.float64)
    check_first_order(model, nn.MSELoss(), X, torch.randn_like(model(X)))


def test_single_input_position():
    """L = 1 (one input position): the sum of squares uses (x²)(v²)ᵀ."""
    torch.manual_seed(0)
    model = nn.ConvTranspose1d(3, 2, 3, padding=1).double()
    X = torch.randn(3, 3, 1, dtype=torch.float64)
    check_first_order(model, nn.MSELoss(), X, torch.randn_like(model(X)))


def test_unbatched_input_is_refused():
    class Unbatched(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.ConvTranspose1d(3, 2, 1)

        def forward(self, x):  # x [N, 3] -> an unbatched [C, L] input
            return self.up(x.transpose(0, 1)).transpose(0, 1)

    model = Unbatched().double()
    X = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(CurvatureError, match="up"):
        curvature(model, nn.MSELoss(), [BatchGrad()])(X, torch.randn(4, 2, dtype=torch.float64))


# Each configuration once per method of curvlib.rules.conv (batch as groups, bmm on the
# unfold of g̃) and per block of root columns (1, some, all), first and second order.
PER_SAMPLE_CASES = [
    (1, dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1, groups=2), (4,), None),
    # output_padding ≥ stride (allowed by dilation): g̃ is longer than the span of the input
    (2, dict(in_channels=2, out_channels=4, kernel_size=(2, 3), stride=(1, 2), padding=(1, 0),
             dilation=(3, 1), output_padding=(2, 1)), (3, 2), None),
    (2, dict(in_channels=2, out_channels=2, kernel_size=1, stride=2), (3, 3), [6, 5]),
    (2, dict(in_channels=3, out_channels=2, kernel_size=3, padding=1), (1, 1), None),  # one input position
    (3, dict(in_channels=2, out_channels=4, kernel_size=2, stride=(2, 1, 1), padding=(0, 1, 0), groups=2),
     (2, 3, 2), None),
]


@pytest.mark.parametrize("method", ["conv", "bmm"])
@pytest.mark.parametrize("block_bytes", [0, 300, 2**30], ids=["one", "some", "all"])
@pytest.mark.parametrize("case", range(len(PER_SAMPLE_CASES)))
def test_per_sample_methods(method, block_bytes, case):
    d, kwargs, spatial, output_size = PER_SAMPLE_CASES[case]
    with override(conv_method=method, conv_column_block_bytes=block_bytes):
        torch.manual_seed(case)
        up = CONV_T[d](**kwargs).double()
        X = torch.randn((3, kwargs["in_channels"], *spatial), dtype=torch.float64)
        with torch.no_grad():
            features = up(X, output_size=output_size)[0].numel()
        if output_size is None:
            model = nn.Sequential(up, nn.Sigmoid(), nn.Flatten(), nn.Linear(features, 3)).double()
        else:
            model = WithOutputSize(up, output_size, features).double()
        y = torch.tensor([0, 2, 1])
        check_first_order(model, nn.CrossEntropyLoss(), X, y)
        check_ggn_columns(model, nn.CrossEntropyLoss(), X, y)
