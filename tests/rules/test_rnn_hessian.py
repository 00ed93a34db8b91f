"""The Hessian family through ``nn.RNN``/``nn.LSTM``/``nn.GRU``, against brute force.

* ``DiagHessian`` / ``BatchDiagHessian``: the diagonal of ``∇²_p L`` and of
  every sample's term, by autograd's double backward
  (:func:`torch.autograd.functional.hessian`) through the torch module itself
  (its fused kernel does not run under ``torch.func`` transforms).
* ``PCHMP``: the whole block of every parameter against
  :func:`oracles.pchmp.pchmp_blocks` on the *same* model whose recurrence is
  written out step by step with tensor operations (``Net.unroll``), which the
  oracle traces with ``torch.fx`` and differentiates node by node. That the
  written-out recurrence is the module's is checked twice: equal outputs, and
  the oracle's unmodified blocks are the module's Hessian blocks.

Models: a classifier (last step -> Linear) and a sequence output (Linear at
every step), over the module's options (mode, layers, bias, batch_first,
bidirectional, proj_size) and initial states (none, from the input, a buffer,
learned).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import Tensor, nn
from torch.autograd.functional import hessian

from curvlib import curvature
from curvlib.extensions import PCHMP, BatchDiagHessian, DiagHessian

from oracles.pchmp import pchmp_blocks
from oracles.on_device import seeded

DT = torch.float64
RTOL = 1e-7
KINDS = {
    "rnn_tanh": (nn.RNN, {"nonlinearity": "tanh"}),
    "rnn_relu": (nn.RNN, {"nonlinearity": "relu"}),
    "lstm": (nn.LSTM, {}),
    "lstm_proj": (nn.LSTM, {"proj_size": 1}),
    "gru": (nn.GRU, {}),
}
LOSSES = {"mse": nn.MSELoss, "ce": nn.CrossEntropyLoss}


class LearnedState(nn.Module):
    """A learnable initial state ``[L·D, size]`` as ``[N, L·D, size]``."""

    def __init__(self, ld: int, size: int):
        super().__init__()
        self.h0 = nn.Parameter(0.5 * torch.randn(ld, size))

    def forward(self, x: Tensor) -> Tensor:
        return self.h0.expand(x.shape[0], -1, -1)


class Net(nn.Module):
    """``x [N, T, I]`` -> recurrent module -> Linear (last step, or every step).

    ``init``: ``"none"``, ``"from_x"`` (tanh of a Linear of the first step),
    ``"buffer"`` (fixed, expanded to the batch), ``"learned"``. With
    ``unroll = T`` the recurrence runs written out (:func:`unrolled`).
    """

    def __init__(self, kind, i, h, o, layers, bias, batch_first, bidirectional, init, readout):
        super().__init__()
        cls, extra = KINDS[kind]
        extra = {k: (min(v, h - 1) if k == "proj_size" else v) for k, v in extra.items()}
        self.rnn = cls(i, h, num_layers=layers, bias=bias, batch_first=batch_first,
                       bidirectional=bidirectional, **extra)
        self.lstm, self.batch_first, self.init, self.readout = cls is nn.LSTM, batch_first, init, readout
        d = 2 if bidirectional else 1
        self.ld, h_out = layers * d, (self.rnn.proj_size or h)
        self.sizes = (h_out, h) if self.lstm else (h_out,)
        if init == "from_x":
            self.inits = nn.ModuleList(nn.Linear(i, self.ld * s) for s in self.sizes)
        elif init == "learned":
            self.inits = nn.ModuleList(LearnedState(self.ld, s) for s in self.sizes)
        elif init == "buffer":
            for k, s in enumerate(self.sizes):
                self.register_buffer(f"state{k}", torch.randn(self.ld, 1, s))
        self.fc = nn.Linear(d * h_out, o)
        self.unroll: Optional[int] = None

    def initial(self, x: Tensor):
        if self.init == "none":
            return None
        states = []
        for k, s in enumerate(self.sizes):
            if self.init == "from_x":
                states.append(torch.tanh(self.inits[k](x[:, 0])).unflatten(1, (self.ld, s)).transpose(0, 1))
            elif self.init == "learned":
                states.append(self.inits[k](x).transpose(0, 1))
            else:
                # (broadcast by a product with ones: an expand to x.shape[0] would be a node
                # without tensor inputs, which the brute-force PCHMP cannot differentiate)
                states.append(getattr(self, f"state{k}") * torch.ones_like(x[:, :1, :1]).transpose(0, 1))
        return tuple(states) if self.lstm else states[0]

    def forward(self, x: Tensor) -> Tensor:
        hx = self.initial(x)
        if self.unroll is not None:
            out = unrolled(self.rnn, x, hx, self.unroll)
        else:
            out, _ = self.rnn(x if self.batch_first else x.transpose(0, 1), hx)
            out = out if self.batch_first else out.transpose(0, 1)
        if self.readout == "last":
            return self.fc(out[:, -1])
        return self.fc(out).transpose(1, 2)  # [N, O, T]


def _parts(x: Tensor, k: int, h: int):
    return [x[..., j * h:(j + 1) * h] for j in range(k)]


def _hidden(h: Optional[Tensor], w: Tensor, b: Optional[Tensor]):
    """``W h + b``; a zero state (``None``) gives the bias alone (or nothing)."""
    return F.linear(h, w, b) if h is not None else b


def _step(mode: str, a: Tensor, b, h, c, size: int):
    """One step in PyTorch's formulas (gate order i, f, g, o / r, z, n); ``b``, ``h``, ``c``
    may be ``None`` (zero initial state: the terms they multiply are left out)."""
    pre = a if b is None else a + b
    if mode == "RNN_TANH":
        return torch.tanh(pre), c
    if mode == "RNN_RELU":
        return torch.relu(pre), c
    if mode == "LSTM":
        gi, gf, gg, go = _parts(pre, 4, size)
        c = torch.sigmoid(gi) * torch.tanh(gg) + (torch.sigmoid(gf) * c if c is not None else 0)
        return torch.sigmoid(go) * torch.tanh(c), c
    (a_r, a_z, a_n), (b_r, b_z, b_n) = _parts(a, 3, size), _parts(b, 3, size) if b is not None else (0, 0, None)
    r, z = torch.sigmoid(a_r + b_r), torch.sigmoid(a_z + b_z)
    n = torch.tanh(a_n + r * b_n) if b_n is not None else torch.tanh(a_n)
    return (1 - z) * n + (z * h if h is not None else 0), c


def unrolled(rnn: nn.RNNBase, x: Tensor, hx, steps: int) -> Tensor:
    """The module's output ``[N, T, D·H_out]`` on ``x [N, T, I]``, written out. Absent
    initial states are zeros, constants: the first step leaves out what they multiply
    (a graph of the written-out model must not take them as functions of the input)."""
    d = 2 if rnn.bidirectional else 1
    size = rnn.hidden_size
    lstm = rnn.mode == "LSTM"
    inp = x
    for layer in range(rnn.num_layers):
        outs = []
        for rev in range(d):
            k, sfx = layer * d + rev, f"_l{layer}" + ("_reverse" if rev else "")
            w = lambda name: getattr(rnn, name + sfx) if (rnn.bias or "bias" not in name) else None  # noqa: E731
            if hx is None:
                h, c = None, None
            else:
                h, c = (hx[0][k], hx[1][k]) if lstm else (hx[k], None)
            pre = F.linear(inp, w("weight_ih"), w("bias_ih"))
            out = [None] * steps
            for t in (range(steps - 1, -1, -1) if rev else range(steps)):
                h, c = _step(rnn.mode, pre[:, t], _hidden(h, w("weight_hh"), w("bias_hh")), h, c, size)
                if rnn.proj_size > 0:
                    h = F.linear(h, w("weight_hr"))
                out[t] = h
            outs.append(torch.stack(out, 1))
        inp = torch.cat(outs, -1) if d == 2 else outs[0]
    return inp


configs = dict(
    kind=st.sampled_from(sorted(KINDS)),
    n=st.integers(1, 2),
    t=st.integers(1, 3),
    i=st.integers(1, 2),
    h=st.integers(1, 2),
    layers=st.integers(1, 2),
    bias=st.booleans(),
    batch_first=st.booleans(),
    bidirectional=st.booleans(),
    init=st.sampled_from(["none", "from_x", "buffer", "learned"]),
    readout=st.sampled_from(["last", "seq"]),
    loss=st.sampled_from(sorted(LOSSES)),
    reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**16),
)


def _case(kind, n, t, i, h, layers, bias, batch_first, bidirectional, init, readout, loss, seed):
    torch.manual_seed(seed)
    if kind == "lstm_proj":
        h = max(h, 2)
    model = Net(kind, i, h, 2, layers, bias, batch_first, bidirectional, init, readout).to(DT)
    gen = seeded(seed)
    X = torch.randn(n, t, i, generator=gen, dtype=DT)
    with torch.no_grad():
        out = model(X)
    if loss == "ce":
        y = torch.randint(0, out.shape[1], (n,) + tuple(out.shape[2:]), generator=gen)
    else:
        y = torch.randn(out.shape, generator=gen, dtype=DT)
    return model, X, y


def hessians(model: nn.Module, lossfn: nn.Module, X: Tensor, y: Tensor, name: str) -> Tuple[Tensor, Tensor]:
    """``(∇²_p L [P, P], per-sample terms [N, P, P])`` by autograd's double backward; sample
    ``n``'s term takes row ``n`` of the output from ``p`` and the others fixed."""
    params = {k: p.detach() for k, p in model.named_parameters()}
    p0 = params[name]

    def out_of(t):
        return torch.func.functional_call(model, {**params, name: t}, (X,))

    with torch.no_grad():
        out0 = out_of(p0)
    H = hessian(lambda t: lossfn(out_of(t), y), p0).reshape(p0.numel(), -1)
    per = []
    for k in range(X.shape[0]):
        mask = (torch.arange(X.shape[0]) == k).reshape((-1,) + (1,) * (out0.dim() - 1))
        per.append(hessian(lambda t: lossfn(torch.where(mask, out_of(t), out0), y), p0).reshape(p0.numel(), -1))
    return H, torch.stack(per)


def _assert_close(got: Dict[str, Tensor], want: Dict[str, Tensor], what: str) -> None:
    """Every entry within ``RTOL`` of the largest entry of the whole result."""
    assert list(got) == list(want), f"{what}: keys {list(got)} != {list(want)}"
    scale = max([float(w.abs().max()) for w in want.values()] + [1e-300])
    for name in want:
        assert got[name].shape == want[name].shape, f"{what}[{name}]: shape {got[name].shape}"
        err = float((got[name] - want[name]).abs().max())
        assert err <= RTOL * scale, f"{what}[{name}]: max error {err:.3e}, relative {err / scale:.3e}"


@settings(max_examples=25)
@given(**configs)
def test_diag_and_batch_diag_hessian(kind, n, t, i, h, layers, bias, batch_first, bidirectional, init, readout,
                                     loss, reduction, seed):
    model, X, y = _case(kind, n, t, i, h, layers, bias, batch_first, bidirectional, init, readout, loss, seed)
    lossfn = LOSSES[loss](reduction=reduction)
    qs = curvature(model, lossfn, [DiagHessian(), BatchDiagHessian()])(X, y)
    want_d, want_b = {}, {}
    for name, p in model.named_parameters():
        H, Hn = hessians(model, lossfn, X, y, name)
        want_d[name] = H.diagonal().reshape(p.shape)
        want_b[name] = Hn.diagonal(dim1=1, dim2=2).reshape((n,) + tuple(p.shape))
        torch.testing.assert_close(Hn.sum(0), H)  # oracle self-check
    _assert_close(qs[DiagHessian().name], want_d, "diag_h")
    _assert_close(qs[BatchDiagHessian().name], want_b, "diag_h_batch")


def pchmp_of(model, lossfn, X, y, modify: str) -> Dict[str, Tensor]:
    """curvlib's PCHMP blocks ``{name: [P, P]}`` (the callables applied to the identity)."""
    fns = curvature(model, lossfn, [PCHMP(modify=modify)])(X, y)["pchmp"]
    eye = lambda p: torch.eye(p.numel(), dtype=DT).reshape((p.numel(),) + tuple(p.shape))  # noqa: E731
    return {k: fns[k](eye(p)).reshape(p.numel(), -1) for k, p in model.named_parameters() if p.requires_grad}


@settings(max_examples=15)
@given(**configs, modify=st.sampled_from(["clip", "abs"]))
def test_pchmp(kind, n, t, i, h, layers, bias, batch_first, bidirectional, init, readout, loss, reduction, seed,
               modify):
    model, X, y = _case(kind, n, t, i, h, layers, bias, batch_first, bidirectional, init, readout, loss, seed)
    lossfn = LOSSES[loss](reduction=reduction)
    got = pchmp_of(model, lossfn, X, y, modify)
    twin = Net(kind, i, max(h, 2) if kind == "lstm_proj" else h, 2, layers, bias, batch_first, bidirectional, init,
               readout).to(DT)
    twin.load_state_dict(model.state_dict())
    twin.unroll = X.shape[1]
    torch.testing.assert_close(twin(X), model(X), rtol=1e-12, atol=1e-12)
    exact = {k: hessians(model, lossfn, X, y, k)[0] for k in got}
    _assert_close(pchmp_blocks(twin, lossfn, X, y, None), exact, "oracle self-check (unmodified = Hessian)")
    _assert_close(got, pchmp_blocks(twin, lossfn, X, y, modify), f"pchmp ({modify})")


def _diag_reference(model, lossfn, X, y):
    return {k: hessians(model, lossfn, X, y, k)[0].diagonal().reshape(p.shape)
            for k, p in model.named_parameters() if p.requires_grad}


@given(kind=st.sampled_from(["rnn_tanh", "lstm", "gru"]), twice=st.booleans(), seed=st.integers(0, 2**16))
def test_module_applied_to_its_own_output(kind, twice, seed):
    """A recurrent module applied to its own output sequence (and initial state): its
    input projection's and first step's weight-input couplings are nodes too."""

    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = KINDS[kind][0](2, 2, batch_first=True, **KINDS[kind][1])
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            out, state = self.rnn(x)
            out, _ = self.rnn(out, state if twice else None)
            return self.fc(out[:, -1])

    torch.manual_seed(seed)
    model = Chain().to(DT)
    X = torch.randn(2, 3, 2, dtype=DT, generator=seeded(seed))
    y = torch.tensor([0, 1])
    lossfn = nn.CrossEntropyLoss()
    got = curvature(model, lossfn, [DiagHessian()])(X, y)[DiagHessian().name]
    _assert_close(got, _diag_reference(model, lossfn, X, y), "diag_h")


@given(kind=st.sampled_from(sorted(KINDS)), frozen=st.sampled_from(["weight_hh", "bias_hh", "weight_ih", "_l0"]),
       init=st.sampled_from(["none", "from_x"]), modify=st.sampled_from(["clip", "abs"]), seed=st.integers(0, 2**16))
@settings(max_examples=10)
def test_frozen_parameters(kind, frozen, init, modify, seed):
    """Frozen recurrent parameters: no entry, and the others' diagonal and PCHMP blocks exact."""
    model, X, y = _case(kind, 2, 3, 2, 2, 1, True, True, False, init, "last", "ce", seed)
    for k, p in model.named_parameters():
        p.requires_grad_(frozen not in k)
    lossfn = nn.CrossEntropyLoss()
    got = curvature(model, lossfn, [DiagHessian()])(X, y)[DiagHessian().name]
    _assert_close(got, _diag_reference(model, lossfn, X, y), "diag_h")
    twin = Net(kind, 2, 2, 2, 1, True, True, False, init, "last").to(DT)
    twin.load_state_dict(model.state_dict())
    twin.unroll = X.shape[1]
    for k, p in twin.named_parameters():
        p.requires_grad_(frozen not in k)
    _assert_close(pchmp_of(model, lossfn, X, y, modify), pchmp_blocks(twin, lossfn, X, y, modify), "pchmp")
