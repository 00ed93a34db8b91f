"""Conv1d/2d/3d rule against the per-sample-copies oracle, over every constructor option."""

import copy
import warnings

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib._core.settings import override
from curvlib.extensions import BatchGrad
from curvlib.rules import conv as conv_rule
from oracles.checks import check_first_order, check_ggn_columns
from oracles.cases import conv_configs
from oracles.on_device import seeded

LOSSES = {"mse": nn.MSELoss, "ce": nn.CrossEntropyLoss, "bce": nn.BCEWithLogitsLoss}
CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
# "same" with an even kernel warns about an internal padded copy; harmless here.
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same'")


def targets(kind, out, gen):
    """Targets for ``out`` ([N, C, *] logits for CE)."""
    if kind == "ce":
        return torch.randint(0, out.shape[1], (out.shape[0],) + tuple(out.shape[2:]), generator=gen)
    if kind == "bce":
        return torch.rand(out.shape, generator=gen, dtype=out.dtype)
    return torch.randn(out.shape, generator=gen, dtype=out.dtype)


def _model_and_data(d, kwargs, spatial, n, seed, head):
    torch.manual_seed(seed)
    gen = seeded(seed)
    conv = CONV[d](**kwargs)
    X = torch.randn((n, kwargs["in_channels"], *spatial), generator=gen, dtype=torch.float64)
    with torch.no_grad():
        out_shape = conv.double()(X).shape
    if head:
        model = nn.Sequential(conv, nn.Sigmoid(), nn.Flatten(), nn.Linear(out_shape[1:].numel(), 3))
    else:
        model = nn.Sequential(conv)
    return model.double(), X, gen


@given(
    config=conv_configs(),
    n=st.integers(1, 3),
    head=st.booleans(),
    loss=st.sampled_from(sorted(LOSSES)),
    reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**16),
)
def test_conv_all_options(config, n, head, loss, reduction, seed):
    d, kwargs, spatial = config
    model, X, gen = _model_and_data(d, kwargs, spatial, n, seed, head)
    y = targets(loss, model(X), gen)
    check_first_order(model, LOSSES[loss](reduction=reduction), X, y)


@given(
    config=conv_configs(dims=(1, 2)),
    n=st.integers(1, 3),
    loss=st.sampled_from(sorted(LOSSES)),
    seed=st.integers(0, 2**16),
)
def test_two_convs_and_linear_head(config, n, loss, seed):
    d, kwargs, spatial = config
    torch.manual_seed(seed)
    gen = seeded(seed)
    first = CONV[d](**kwargs)
    second = CONV[d](kwargs["out_channels"], 3, kernel_size=1, stride=1, padding=1, padding_mode="replicate")
    X = torch.randn((n, kwargs["in_channels"], *spatial), generator=gen, dtype=torch.float64)
    with torch.no_grad():
        features = second.double()(first.double()(X)).shape[1:].numel()
    model = nn.Sequential(first, nn.Tanh(), second, nn.ReLU(), nn.Flatten(), nn.Linear(features, 4)).double()
    check_first_order(model, LOSSES[loss](), X, targets(loss, model(X), gen))


class SharedConv(nn.Module):
    """One conv applied twice (shared weights), then a linear head."""

    def __init__(self, d, channels, features, **kwargs):
        super().__init__()
        self.conv = CONV[d](channels, channels, **kwargs)
        self.head = nn.Linear(features, 2)

    def forward(self, x):
        h = torch.tanh(self.conv(x))
        return self.head(self.conv(h).flatten(1))


@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("padding_mode", ["zeros", "circular"])
def test_conv_used_twice(d, padding_mode):
    torch.manual_seed(d)
    X = torch.randn((3, 2, *[5] * d), dtype=torch.float64)
    model = SharedConv(d, 2, 2 * 5**d, kernel_size=3, padding="same", groups=2, padding_mode=padding_mode).double()
    check_first_order(model, nn.CrossEntropyLoss(), X, torch.tensor([0, 1, 1]))


@pytest.mark.parametrize("d", [1, 2, 3])
def test_class_per_position_cross_entropy(d):
    """CE on the conv output [N, C, *spatial] directly (no head)."""
    torch.manual_seed(0)
    model = CONV[d](2, 3, kernel_size=2, stride=1, padding=1, dilation=2).double()
    X = torch.randn((2, 2, *[4] * d), dtype=torch.float64)
    out = model(X)
    y = torch.randint(0, 3, (2, *out.shape[2:]))
    check_first_order(model, nn.CrossEntropyLoss(), X, y)


@pytest.mark.parametrize(
    "c_in, c_out, kernel, spatial",
    [(1, 1, 1, 6), (4, 4, 3, 3), (3, 2, 3, 5)],  # L² > A·B (materialised) and L² ≤ A·B (Gram)
)
def test_norm_paths(c_in, c_out, kernel, spatial):
    """Both batch_l2 branches and the L = 1 sum_grad_squared branch agree with the oracle."""
    torch.manual_seed(0)
    model = nn.Conv2d(c_in, c_out, kernel).double()
    X = torch.randn(3, c_in, spatial, spatial, dtype=torch.float64)
    check_first_order(model, nn.MSELoss(), X, torch.randn_like(model(X)))


def test_kernel_covers_input_single_position():
    """L = 1: the sum of squares uses (g²)(u²)ᵀ."""
    torch.manual_seed(0)
    model = nn.Conv1d(2, 3, 4, groups=1).double()
    X = torch.randn(3, 2, 4, dtype=torch.float64)
    check_first_order(model, nn.MSELoss(reduction="sum"), X, torch.randn(3, 3, 1, dtype=torch.float64))


@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("padding", ["same", "valid", 1])
@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "replicate", "circular"])
def test_explicit_padding_reproduces_module(d, padding, padding_mode):
    """F.pad with explicit_padding, then a conv with padding 0, equals the module."""
    torch.manual_seed(0)
    conv = CONV[d](2, 2, kernel_size=(2, 3, 4)[:d], padding=padding, dilation=(1, 2, 1)[:d],
                   padding_mode=padding_mode).double()
    X = torch.randn((1, 2, *[6] * d), dtype=torch.float64)
    mode = "constant" if padding_mode == "zeros" else padding_mode
    padded = torch.nn.functional.pad(X, conv_rule.explicit_padding(conv), mode=mode)
    expected = conv(X)
    got = conv_rule._CONV[d](padded, conv.weight, conv.bias, conv.stride, 0, conv.dilation)
    torch.testing.assert_close(got, expected)


def test_unbatched_input_is_refused():
    class Squeeze(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(3, 2, 1)

        def forward(self, x):  # x [N, 3]: an unbatched Conv1d input [C, L] would be wrong here
            return self.conv(x.transpose(0, 1)).transpose(0, 1)

    X = torch.randn(4, 3, dtype=torch.float64)
    model = Squeeze().double()
    with pytest.raises(CurvatureError, match="conv"):
        curvature(model, nn.MSELoss(), [BatchGrad()])(X, torch.randn(4, 2, dtype=torch.float64))


def test_only_bias_trainable():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 2, padding_mode="reflect", padding=1), nn.Flatten()).double()
    model[0].weight.requires_grad_(False)
    X = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    check_first_order(model, nn.MSELoss(), X, torch.randn_like(model(X)))


def test_parametrized_conv_falls_back_to_generic():
    """A weight-normed conv has no plain ``weight`` parameter; the generic rule takes it exactly."""
    torch.manual_seed(0)
    conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(2, 2, 3, padding=1))
    model = nn.Sequential(conv, nn.Flatten()).double()
    X = torch.randn(3, 2, 5, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_first_order(model, nn.MSELoss(), X, torch.randn_like(model(X)))


@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("ext", ["KFLR", "KFRA"])
@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_kronecker_factors_match_backpack(d, ext):
    """Kronecker factors of conv weight/bias equal BackPACK's (zeros padding, groups=1)."""
    backpack = pytest.importorskip("backpack")
    from curvlib import extensions

    torch.manual_seed(d)
    conv = CONV[d](2, 3, kernel_size=2, stride=(2, 1, 1)[:d], padding=1, dilation=(1, 2, 1)[:d])
    X = torch.randn((3, 2, *[4] * d), dtype=torch.float64)
    with torch.no_grad():
        features = conv.double()(X).shape[1:].numel()
    model = nn.Sequential(conv, nn.ReLU(), nn.Flatten(), nn.Linear(features, 3)).double()
    y = torch.tensor([0, 2, 1])
    ours = getattr(extensions, ext)()
    qs = curvature(model, nn.CrossEntropyLoss(), [ours])(X, y)

    bp_model, bp_loss = backpack.extend(copy.deepcopy(model)), backpack.extend(nn.CrossEntropyLoss())
    with backpack.backpack(getattr(backpack.extensions, ext)()):
        bp_loss(bp_model(X), y).backward()
    for name, p in bp_model.named_parameters():
        theirs = getattr(p, ours.name)
        assert len(qs[ours.name][name]) == len(theirs)
        for a, b in zip(qs[ours.name][name], theirs):
            torch.testing.assert_close(a, b)


def test_kfra_factors_of_grouped_conv_are_refused():
    """KFRA refuses grouped convolutions; KFAC gives per-group factors (tests/_evaluate/test_kron_layers.py)."""
    from curvlib.extensions import KFAC, KFRA

    model = nn.Sequential(nn.Conv1d(2, 2, 1, groups=2), nn.Flatten()).double()
    X, y = torch.randn(2, 2, 3, dtype=torch.float64), torch.randn(2, 6, dtype=torch.float64)
    with pytest.raises(CurvatureError, match="groups=2"):
        curvature(model, nn.MSELoss(), [KFRA()])(X, y)
    assert [f.shape for f in curvature(model, nn.MSELoss(), [KFAC()])(X, y)["kfac"]["0.weight"]] == [(2, 1, 1)] * 2


# --------------------------------------------------------------------- per-sample methods


# Each configuration once per method; the first-order and column paths of outer_rule
# (conv: batch as groups, bmm on the unfold; blocks of 1, some and all columns).
PER_SAMPLE_CASES = [
    (1, dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=2, dilation=2, groups=2), (9,)),
    (2, dict(in_channels=2, out_channels=4, kernel_size=(2, 3), padding="same", dilation=(2, 1)), (5, 4)),
    (2, dict(in_channels=4, out_channels=2, kernel_size=3, stride=(1, 2), padding=1, groups=2,
             padding_mode="reflect"), (5, 6)),
    (2, dict(in_channels=3, out_channels=4, kernel_size=1, stride=2), (5, 5)),
    (2, dict(in_channels=2, out_channels=3, kernel_size=3), (3, 3)),  # one output position
    (3, dict(in_channels=2, out_channels=4, kernel_size=2, stride=(2, 1, 1), padding=(1, 0, 1), groups=2,
             padding_mode="circular"), (3, 4, 3)),
]


@pytest.mark.parametrize("method", ["conv", "bmm", None])  # None: by shape (columns: bmm on the memoised unfold)
@pytest.mark.parametrize("block_bytes", [0, 300, 2**30], ids=["one", "some", "all"])
@pytest.mark.parametrize("case", range(len(PER_SAMPLE_CASES)))
def test_per_sample_methods(method, block_bytes, case):
    d, kwargs, spatial = PER_SAMPLE_CASES[case]
    with override(conv_method=method, conv_column_block_bytes=block_bytes):
        torch.manual_seed(case)
        conv = CONV[d](**kwargs).double()
        X = torch.randn((3, kwargs["in_channels"], *spatial), dtype=torch.float64)
        with torch.no_grad():
            features = conv(X)[0].numel()
        model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(features, 4)).double()
        y = torch.tensor([0, 3, 1])
        check_first_order(model, nn.CrossEntropyLoss(), X, y)
        check_ggn_columns(model, nn.CrossEntropyLoss(), X, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_methods_agree_on_a_larger_layer(dtype):
    """Batch as groups and bmm give the same individual gradients at a size where each is chosen."""
    torch.manual_seed(0)
    conv = nn.Conv2d(16, 32, 3, padding=1).to(dtype)
    X = torch.randn(4, 16, 8, 8, dtype=dtype)
    model = nn.Sequential(conv, nn.Flatten())
    y = torch.randn(4, 32 * 64, dtype=dtype)
    results = {}
    for method in ("conv", "bmm"):
        with override(conv_method=method):
            results[method] = curvature(model, nn.MSELoss(), [BatchGrad()])(X, y)
    for key in ("grad", "grad_batch"):
        for name in results["conv"][key]:
            torch.testing.assert_close(results["conv"][key][name], results["bmm"][key][name])
    assert conv_rule.choose_method(16, 32, 9, 64) == "conv"
    assert conv_rule.choose_method(3, 32, 9, 1024) == "bmm"
    assert conv_rule.choose_method(64, 64, 1, 36) == "bmm"
