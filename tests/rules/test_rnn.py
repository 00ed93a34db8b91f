"""Recurrent rule (nn.RNN, nn.LSTM, nn.GRU) against the per-sample-copies oracle."""

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from curvlib import CurvatureError, curvature
from curvlib.extensions import BatchGrad
from curvlib.rules import rnn as rnn_rule
from curvlib._core.site import Recorder

from oracles.checks import check_first_order
from oracles.on_device import seeded

# kind -> (module class, extra constructor arguments)
KINDS = {
    "rnn_tanh": (nn.RNN, {"nonlinearity": "tanh"}),
    "rnn_relu": (nn.RNN, {"nonlinearity": "relu"}),
    "lstm": (nn.LSTM, {}),
    "lstm_proj": (nn.LSTM, {"proj_size": 1}),
    "gru": (nn.GRU, {}),
}
INITS = ("none", "from_x", "buffer", "learned")
LOSSES = {"mse": nn.MSELoss, "ce": nn.CrossEntropyLoss}


def _make_rnn(kind, i, h, layers, bias, batch_first, bidirectional, dropout=0.0):
    cls, extra = KINDS[kind]
    extra = dict(extra)
    if "proj_size" in extra:
        extra["proj_size"] = min(extra["proj_size"], h - 1) or 0
    return cls(
        i, h, num_layers=layers, bias=bias, batch_first=batch_first,
        bidirectional=bidirectional, dropout=dropout, **extra,
    )


class LearnedState(nn.Module):
    """A learnable initial state ``[L·D, size]``, broadcast to ``[N, L·D, size]``."""

    def __init__(self, ld, size):
        super().__init__()
        self.h0 = nn.Parameter(0.5 * torch.randn(ld, size))

    def forward(self, x):
        return self.h0.expand(x.shape[0], -1, -1)


class Net(nn.Module):
    """``x [N, T, I]`` -> recurrent layer (with an optional initial state) -> Linear.

    ``init``: ``"none"`` (zeros), ``"from_x"`` (a Linear of the first step),
    ``"buffer"`` (a fixed non-zero buffer expanded to the batch), ``"learned"``
    (a trainable state). ``readout``: ``"last"`` (the last output step) or
    ``"states"`` (mean output over time and the final states).
    """

    def __init__(self, kind, i, h, o, layers, bias, batch_first, bidirectional, init, readout, dropout=0.0):
        super().__init__()
        self.rnn = _make_rnn(kind, i, h, layers, bias, batch_first, bidirectional, dropout)
        self.lstm = isinstance(self.rnn, nn.LSTM)
        self.batch_first, self.init, self.readout = batch_first, init, readout
        d = 2 if bidirectional else 1
        self.ld, self.h_out = layers * d, (self.rnn.proj_size or h)
        self.sizes = (self.h_out, h) if self.lstm else (self.h_out,)
        if init == "from_x":
            self.inits = nn.ModuleList(nn.Linear(i, self.ld * s) for s in self.sizes)
        elif init == "buffer":
            for k, s in enumerate(self.sizes):
                self.register_buffer(f"state{k}", torch.randn(self.ld, 1, s))
        elif init == "learned":
            self.inits = nn.ModuleList(LearnedState(self.ld, s) for s in self.sizes)
        feat = d * self.h_out
        if readout == "states":
            feat += self.ld * sum(self.sizes)
        self.fc = nn.Linear(feat, o)

    def initial(self, x):
        if self.init == "none":
            return None
        states = []
        for k, s in enumerate(self.sizes):
            if self.init == "from_x":
                st_ = torch.tanh(self.inits[k](x[:, 0])).unflatten(1, (self.ld, s)).transpose(0, 1)
            elif self.init == "buffer":
                st_ = getattr(self, f"state{k}").expand(-1, x.shape[0], -1)
            else:
                st_ = self.inits[k](x).transpose(0, 1)
            states.append(st_)
        return tuple(states) if self.lstm else states[0]

    def forward(self, x):
        hx = self.initial(x)
        if hx is not None:  # (cuDNN's RNNs take contiguous states only)
            hx = tuple(h.contiguous() for h in hx) if isinstance(hx, tuple) else hx.contiguous()
        out, state = self.rnn(x if self.batch_first else x.transpose(0, 1), hx)
        if not self.batch_first:
            out = out.transpose(0, 1)
        if self.readout == "last":
            return self.fc(out[:, -1])
        finals = (state[0], state[1]) if self.lstm else (state,)
        flat = [s.transpose(0, 1).flatten(1) for s in finals]
        return self.fc(torch.cat([out.mean(1), *flat], 1))


def _data(model, n, t, i, loss, seed):
    gen = seeded(seed)
    X = torch.randn(n, t, i, generator=gen, dtype=torch.float64)
    out = model(X)
    if loss == "ce":
        y = torch.randint(0, out.shape[1], (n,), generator=gen)
    else:
        y = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    return X, y


configs = dict(
    n=st.integers(1, 3),
    t=st.integers(1, 4),
    i=st.integers(1, 3),
    h=st.integers(1, 3),
    layers=st.integers(1, 2),
    bias=st.booleans(),
    batch_first=st.booleans(),
    bidirectional=st.booleans(),
    init=st.sampled_from(INITS),
    readout=st.sampled_from(["last", "states"]),
    loss=st.sampled_from(sorted(LOSSES)),
    reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**16),
)


@pytest.mark.parametrize("kind", sorted(KINDS))
@given(**configs)
def test_rnn_first_order(kind, n, t, i, h, layers, bias, batch_first, bidirectional, init, readout, loss, reduction, seed):
    torch.manual_seed(seed)
    model = Net(kind, i, h, 2, layers, bias, batch_first, bidirectional, init, readout).double()
    X, y = _data(model, n, t, i, loss, seed)
    check_first_order(model, LOSSES[loss](reduction=reduction), X, y)


@given(
    kind=st.sampled_from(sorted(KINDS)),
    n=st.integers(1, 3),
    t=st.integers(1, 4),
    i=st.integers(1, 3),
    h=st.integers(2, 3),
    layers=st.integers(1, 3),
    bias=st.booleans(),
    batch_first=st.booleans(),
    bidirectional=st.booleans(),
    with_hx=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_forward_matches_module(kind, n, t, i, h, layers, bias, batch_first, bidirectional, with_hx, seed):
    """The unrolled forward returns exactly what the torch module returns."""
    torch.manual_seed(seed)
    m = _make_rnn(kind, i, h, layers, bias, batch_first, bidirectional).double()
    x = torch.randn((n, t, i) if batch_first else (t, n, i), dtype=torch.float64)
    hx = None
    if with_hx:
        ld = layers * (2 if bidirectional else 1)
        h0 = torch.randn(ld, n, m.proj_size or h, dtype=torch.float64)
        hx = (h0, torch.randn(ld, n, h, dtype=torch.float64)) if isinstance(m, nn.LSTM) else h0
    names = {k: k for k, _ in m.named_parameters()}
    tensors = dict(m.named_parameters())
    with torch.no_grad():
        got = rnn_rule.forward(m, "rnn", names, tensors, (x, hx), {}, Recorder(None))
        ref = m(x, hx)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_frozen_parameters_and_shared_module():
    """Frozen weights get no entry; a module applied twice sums over both uses."""

    class TwoPasses(nn.Module):
        def __init__(self):
            super().__init__()
            self.init = nn.Linear(3, 2 * 2)
            self.gru = nn.GRU(3, 2, num_layers=2, batch_first=True)
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            h0 = self.init(x[:, -1]).unflatten(1, (2, 2)).transpose(0, 1)
            a, _ = self.gru(x, h0)
            b, _ = self.gru(x.flip(1), hx=h0)
            return self.fc(torch.cat([a[:, -1], b[:, 0]], 1))

    torch.manual_seed(0)
    model = TwoPasses().double()
    model.gru.bias_hh_l0.requires_grad_(False)
    model.gru.weight_hh_l1.requires_grad_(False)
    model.gru.bias_hh_l1.requires_grad_(False)
    X = torch.randn(3, 4, 3, dtype=torch.float64)
    qs = check_first_order(model, nn.MSELoss(), X, torch.randn(3, 3, dtype=torch.float64))
    assert "gru.bias_hh_l0" not in qs["grad_batch"]


def test_params_argument_subset():
    """``params=`` with a subset: quantities for exactly those, with those values."""
    torch.manual_seed(0)
    model = Net("lstm_proj", 2, 3, 2, 2, True, False, True, "from_x", "states").double()
    X, y = _data(model, 3, 3, 2, "mse", 0)
    params = {k: p.detach() + 0.1 for k, p in model.named_parameters() if "_l1" in k}
    qs = curvature(model, nn.MSELoss(), [BatchGrad()])(X, y, params=params)
    assert list(qs["grad_batch"]) == list(params)
    moved = Net("lstm_proj", 2, 3, 2, 2, True, False, True, "from_x", "states").double()
    moved.load_state_dict({**model.state_dict(), **params})
    for k, p in moved.named_parameters():
        p.requires_grad_(k in params)
    ref = check_first_order(moved, nn.MSELoss(), X, y)
    for k in params:
        torch.testing.assert_close(qs["grad_batch"][k], ref["grad_batch"][k])


@pytest.mark.parametrize("kind", ["rnn_tanh", "lstm", "gru"])
def test_dropout_eval_mode_is_exact(kind):
    torch.manual_seed(0)
    model = Net(kind, 2, 3, 2, 2, True, True, False, "from_x", "last", dropout=0.5).double().eval()
    X, y = _data(model, 3, 4, 2, "ce", 0)
    check_first_order(model, nn.CrossEntropyLoss(), X, y)


def test_dropout_training_mode_is_self_consistent():
    """With dropout in training mode the forward is random; the quantities of one
    call still belong to one forward: individual gradients sum to the gradient."""
    torch.manual_seed(0)
    model = Net("lstm", 2, 3, 2, 2, True, True, False, "buffer", "last", dropout=0.5).double().train()
    X, y = _data(model, 4, 3, 2, "mse", 0)
    qs = curvature(model, nn.MSELoss(reduction="sum"), [BatchGrad()])(X, y)
    for k, g in qs["grad"].items():
        torch.testing.assert_close(qs["grad_batch"][k].sum(0), g)


def _call(m, *args, **kwargs):
    names = {k: k for k, _ in m.named_parameters()}
    return rnn_rule.forward(m, "net.rnn", names, dict(m.named_parameters()), args, kwargs, Recorder(None))


def test_refuses_packed_sequence():
    m = nn.LSTM(2, 3, batch_first=True)
    packed = pack_padded_sequence(torch.randn(2, 3, 2), torch.tensor([3, 2]), batch_first=True)
    with pytest.raises(CurvatureError, match="net.rnn.*PackedSequence"):
        _call(m, packed)


def test_refuses_unbatched_input():
    with pytest.raises(CurvatureError, match="net.rnn.*unbatched"):
        _call(nn.GRU(2, 3), torch.randn(4, 2))


def test_refuses_initial_state_with_fixed_batch():
    """A [L·D, N, H] buffer of the wrong batch size is refused before any work."""

    class Fixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.RNN(2, 3, batch_first=True)
            self.register_buffer("h0", torch.zeros(1, 5, 3))
            self.fc = nn.Linear(3, 1)

        def forward(self, x):
            out, _ = self.rnn(x, self.h0)
            return self.fc(out[:, -1])

    X = torch.randn(4, 3, 2)
    with pytest.raises(CurvatureError, match="rnn.*h.*\\[1, 5, 3\\].*\\[1, 4, 3\\]"):
        curvature(Fixed(), nn.MSELoss(), [BatchGrad()])(X, torch.randn(4, 1))


def test_refuses_lstm_hx_not_a_pair():
    with pytest.raises(CurvatureError, match="net.rnn.*tuple \\(h0, c0\\)"):
        _call(nn.LSTM(2, 3, batch_first=True), torch.randn(2, 3, 2), torch.zeros(1, 2, 3))


def test_refuses_parametrized_weights():
    from torch.nn.utils import parametrize

    class Scale(nn.Module):
        def forward(self, w):
            return 2 * w

    m = nn.RNN(2, 3)
    parametrize.register_parametrization(m, "weight_hh_l0", Scale())
    with pytest.raises(CurvatureError, match="net.rnn.*weight_hh_l0.*not plain"):
        rnn_rule.check(m, "net.rnn")
