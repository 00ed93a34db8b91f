"""Kronecker factors (``KFLR``, ``KFACEmpirical``, ``KFAC``; ``kfac_approx`` None /
``"expand"`` / ``"reduce"``) of ``nn.RNN``/``nn.LSTM``/``nn.GRU`` parameters, from their
definitions with the time steps as the positions sharing each weight.

Oracle (float64, nothing of curvlib): the recurrence written out step by step
(:func:`unrolled`, checked equal to the module's output), with an additive offset
``δ[n, t]`` on the output of every linear site ``z_t = W u_t (+ b)`` (``W_ih x_t``,
``W_hh h_{t-1}``, LSTM's ``W_hr m_t``). Then per sample ``n`` and step ``t``:

* ``J_{n,t} = ∂f_n/∂δ[n, t]`` by ``jacrev``, ``H_n`` the loss Hessian block:
  KFLR ``B_expand = Σ_{n,t} J_{n,t}ᵀ H_n J_{n,t}``,
  ``B_reduce = B_None = Σ_n (Σ_t J_{n,t})ᵀ H_n (Σ_t J_{n,t})``;
* ``g[n, t] = ∂L/∂δ[n, t]`` by ``grad``: KFACEmpirical ``B_expand = Σ_{n,t} g gᵀ``,
  ``B_reduce = B_None = Σ_n (Σ_t g)(Σ_t g)ᵀ``;
* the recorded site inputs ``u[n, t]`` (``x_t``, ``h_{t-1}`` with the initial state,
  zero when none is passed, ``m_t``): ``A_None = (1/N) Σ_{n,t} u uᵀ``,
  ``A_expand = A_None / T``, ``A_reduce = (1/N) Σ_n ū ūᵀ`` (``ū`` the mean over ``t``).

KFAC (Monte Carlo): ``B`` equals ``Σ S Sᵀ`` of the bias's ``SqrtGGNMC`` drawn from the
same generator state, ``A`` equals KFLR's, and ``B`` converges to KFLR's.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import Tensor, nn
from torch.func import grad, jacrev

from curvlib import CurvatureError, curvature
from curvlib.extensions import KFAC, KFACEmpirical, KFLR, KFRA, SqrtGGNMC

from oracles.second_order import loss_hessian_blocks
from oracles.on_device import seeded

DT = torch.float64
KINDS = {
    "rnn_tanh": (nn.RNN, {"nonlinearity": "tanh"}),
    "rnn_relu": (nn.RNN, {"nonlinearity": "relu"}),
    "lstm": (nn.LSTM, {}),
    "lstm_proj": (nn.LSTM, {"proj_size": 1}),
    "gru": (nn.GRU, {}),
}
LOSSES = {"mse": nn.MSELoss, "ce": nn.CrossEntropyLoss}
APPROXES = (None, "expand", "reduce")


class Net(nn.Module):
    """``x [N, T, I]`` -> recurrent module (initial state none / from the input / a buffer)
    -> Linear on the last step (``[N, O]``) or on every step (``[N, O, T]``)."""

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
        elif init == "buffer":
            for k, s in enumerate(self.sizes):
                self.register_buffer(f"state{k}", torch.randn(self.ld, 1, s))
        self.fc = nn.Linear(d * h_out, o)

    def initial(self, x: Tensor):
        if self.init == "none":
            return None
        states = []
        for k, s in enumerate(self.sizes):
            if self.init == "from_x":
                states.append(torch.tanh(self.inits[k](x[:, 0])).unflatten(1, (self.ld, s)).transpose(0, 1))
            else:
                states.append(getattr(self, f"state{k}").expand(-1, x.shape[0], -1))
        return tuple(states) if self.lstm else states[0]

    def head(self, out: Tensor) -> Tensor:
        return self.fc(out[:, -1]) if self.readout == "last" else self.fc(out).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.rnn(x if self.batch_first else x.transpose(0, 1), self.initial(x))
        return self.head(out if self.batch_first else out.transpose(0, 1))

    def written_out(self, x: Tensor, deltas: Dict[str, Tensor], inputs: Optional[dict] = None) -> Tensor:
        """The same output with the recurrence written out and offsets on its linear sites."""
        return self.head(unrolled(self.rnn, x, self.initial(x), deltas, inputs))


def site_shapes(rnn: nn.RNNBase, n: int, t: int) -> Dict[str, Tuple[int, int, int]]:
    """``{weight name: [N, T, out]}``: the output of the linear site each weight acts in."""
    return {name: (n, t, p.shape[0]) for name, p in rnn.named_parameters() if name.startswith("weight")}


def unrolled(rnn: nn.RNNBase, x: Tensor, hx, deltas: Dict[str, Tensor], inputs: Optional[dict]) -> Tensor:
    """``[N, T, D·H_out]``: PyTorch's formulas step by step (gate order i, f, g, o / r, z, n);
    ``z = W u + b + δ[weight name][:, t]`` at every linear site; ``inputs[weight name]``
    collects the site inputs ``u [N, T, in]`` (indexed by true time)."""
    d, size, lstm = (2 if rnn.bidirectional else 1), rnn.hidden_size, rnn.mode == "LSTM"
    n, steps = x.shape[0], x.shape[1]
    inp = x
    for layer in range(rnn.num_layers):
        outs = []
        for rev in range(d):
            k, sfx = layer * d + rev, f"_l{layer}" + ("_reverse" if rev else "")
            p = lambda name: getattr(rnn, name + sfx) if (rnn.bias or "bias" not in name) else None  # noqa: E731
            h_out = rnn.proj_size or size
            h = x.new_zeros(n, h_out) if hx is None else (hx[0][k] if lstm else hx[k])
            c = (x.new_zeros(n, size) if hx is None else hx[1][k]) if lstm else None
            pre = F.linear(inp, p("weight_ih"), p("bias_ih")) + deltas["weight_ih" + sfx]
            rec = {"weight_hh": [None] * steps, "weight_hr": [None] * steps}
            out = [None] * steps
            for t in (range(steps - 1, -1, -1) if rev else range(steps)):
                rec["weight_hh"][t] = h
                b = F.linear(h, p("weight_hh"), p("bias_hh")) + deltas["weight_hh" + sfx][:, t]
                h, c = _step(rnn.mode, pre[:, t], b, h, c, size)
                if rnn.proj_size > 0:
                    rec["weight_hr"][t] = h
                    h = F.linear(h, p("weight_hr")) + deltas["weight_hr" + sfx][:, t]
                out[t] = h
            if inputs is not None:
                inputs["weight_ih" + sfx] = inp
                inputs["weight_hh" + sfx] = torch.stack(rec["weight_hh"], 1)
                if rnn.proj_size > 0:
                    inputs["weight_hr" + sfx] = torch.stack(rec["weight_hr"], 1)
            outs.append(torch.stack(out, 1))
        inp = torch.cat(outs, -1) if d == 2 else outs[0]
    return inp


def _step(mode: str, a: Tensor, b: Tensor, h: Tensor, c: Optional[Tensor], size: int):
    if mode in ("RNN_TANH", "RNN_RELU"):
        return (torch.tanh if mode == "RNN_TANH" else torch.relu)(a + b), c
    if mode == "LSTM":
        gi, gf, gg, go = (a + b).split(size, -1)
        c = torch.sigmoid(gf) * c + torch.sigmoid(gi) * torch.tanh(gg)
        return torch.sigmoid(go) * torch.tanh(c), c
    (a_r, a_z, a_n), (b_r, b_z, b_n) = a.split(size, -1), b.split(size, -1)
    r, z = torch.sigmoid(a_r + b_r), torch.sigmoid(a_z + b_z)
    n = torch.tanh(a_n + r * b_n)  # b_n = W_hn h + b_hn: the site's output, before r ⊙
    return (1 - z) * n + z * h, c


def reference(model: Net, lossfn: nn.Module, X: Tensor, y: Tensor) -> Dict[str, Dict[object, list]]:
    """``{"kflr"|"kfac_empirical": {approx: {param name: factors}}}`` from the definitions."""
    rnn = model.rnn
    shapes = site_shapes(rnn, X.shape[0], X.shape[1])
    zeros = {k: torch.zeros(s, dtype=DT) for k, s in shapes.items()}
    inputs: dict = {}
    with torch.no_grad():
        out = model.written_out(X, zeros, inputs)
        torch.testing.assert_close(out, model(X), rtol=1e-12, atol=1e-12)  # the oracle is the module
    n = X.shape[0]
    J = jacrev(lambda ds: model.written_out(X, ds))(zeros)
    H = loss_hessian_blocks(lossfn, out, y)  # [N, C, C]
    g = grad(lambda ds: lossfn(model.written_out(X, ds), y))(zeros)
    result: Dict[str, Dict[object, dict]] = {"kflr": {}, "kfac_empirical": {}}
    for approx in APPROXES:
        kflr, ef = {}, {}
        for wname, u in inputs.items():
            Jw = J[wname].reshape(n, -1, *shapes[wname])
            Jn = torch.stack([Jw[i, :, i] for i in range(n)])  # [N, C, T, O]
            gw = g[wname]  # [N, T, O]
            if approx == "expand":
                B = torch.einsum("ncto,ncd,ndtq->oq", Jn, H, Jn)
                E = torch.einsum("nto,ntq->oq", gw, gw)
            else:
                Js, gs = Jn.sum(2), gw.sum(1)
                B = torch.einsum("nco,ncd,ndq->oq", Js, H, Js)
                E = gs.T @ gs
            A = _input_factor(u, approx)
            kflr[wname], ef[wname] = [B, A], [E, A]
            bname = wname.replace("weight", "bias")
            if hasattr(rnn, bname) and rnn.bias:
                kflr[bname], ef[bname] = [B], [E]
        result["kflr"][approx], result["kfac_empirical"][approx] = kflr, ef
    return result


def _input_factor(u: Tensor, approx: Optional[str]) -> Tensor:
    n, t = u.shape[0], u.shape[1]
    if approx == "reduce":
        ubar = u.mean(1)
        return ubar.T @ ubar / n
    A = torch.einsum("nti,ntj->ij", u, u) / n
    return A / t if approx == "expand" else A


def _close(a: Tensor, b: Tensor, what: str) -> None:
    b = b.detach()
    scale = max(float(b.abs().max()), 1e-12)
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10 * scale, msg=lambda m: f"{what}: {m}")


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


configs = dict(
    kind=st.sampled_from(sorted(KINDS)),
    n=st.integers(1, 3),
    t=st.integers(1, 3),
    i=st.integers(1, 2),
    h=st.integers(1, 2),
    layers=st.integers(1, 2),
    bias=st.booleans(),
    batch_first=st.booleans(),
    bidirectional=st.booleans(),
    init=st.sampled_from(["none", "from_x", "buffer"]),
    readout=st.sampled_from(["last", "seq"]),
    loss=st.sampled_from(sorted(LOSSES)),
    reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**16),
)


@settings(max_examples=30)
@given(**configs)
def test_kflr_and_empirical_factors(kind, n, t, i, h, layers, bias, batch_first, bidirectional, init, readout,
                                    loss, reduction, seed):
    """KFLR (exact GGN roots) and KFACEmpirical (per-sample gradients) of every recurrent
    parameter, for every ``kfac_approx``, against the factors built from their definitions."""
    model, X, y = _case(kind, n, t, i, h, layers, bias, batch_first, bidirectional, init, readout, loss, seed)
    lossfn = LOSSES[loss](reduction=reduction)
    want = reference(model, lossfn, X, y)
    for approx in APPROXES:
        got = curvature(model, lossfn, [KFLR(kfac_approx=approx), KFACEmpirical(kfac_approx=approx)])(X, y)
        for key in ("kflr", "kfac_empirical"):
            for name, factors in want[key][approx].items():
                full = f"rnn.{name}"
                assert len(got[key][full]) == len(factors), full
                for j, (a, b) in enumerate(zip(got[key][full], factors)):
                    _close(a, b, f"{key}(kfac_approx={approx!r})[{full}][{j}]")


@pytest.mark.parametrize("approx", APPROXES)
@pytest.mark.parametrize("kind", ["rnn_tanh", "lstm_proj", "gru"])
def test_kfac_monte_carlo(kind, approx):
    """KFAC's ``B`` is ``Σ S Sᵀ`` of the bias's Monte-Carlo root (same draws; positions summed:
    None, "reduce"), its ``A`` is KFLR's, and ``B`` converges to KFLR's (every approx)."""
    model, X, y = _case(kind, 3, 3, 2, 2, 1, True, True, True, "from_x", "last", "ce", 0)
    lossfn = nn.CrossEntropyLoss()
    exact = curvature(model, lossfn, [KFLR(kfac_approx=approx)])(X, y)["kflr"]
    for m in (1, 3):
        gen = lambda: seeded(5)  # noqa: E731
        kfac = curvature(model, lossfn, [KFAC(mc_samples=m, kfac_approx=approx, generator=gen())])(X, y)["kfac"]
        sqrt = curvature(model, lossfn, [SqrtGGNMC(mc_samples=m, generator=gen())])(X, y)["sqrt_ggn_mc"]
        for name, factors in kfac.items():
            if not name.startswith("rnn.weight"):
                continue
            _close(factors[1], exact[name][1], f"A of {name}")
            bias = name.replace("weight", "bias")
            if approx != "expand" and bias in sqrt:
                S = sqrt[bias].reshape(-1, sqrt[bias].shape[-1])
                _close(factors[0], S.T @ S, f"B of {name}")
                _close(kfac[bias][0], S.T @ S, f"B of {bias}")
    mc = curvature(model, lossfn, [KFAC(mc_samples=3000, kfac_approx=approx,
                                        generator=seeded(1))])(X, y)["kfac"]
    for name in ("rnn.weight_ih_l0", "rnn.weight_hh_l0_reverse"):
        assert (mc[name][0] - exact[name][0]).norm() < 0.1 * exact[name][0].norm(), name


class Cell(nn.Module):
    """``T = 1`` without initial state: an RNN step is ``tanh(W_ih x + b_ih + b_hh)``."""

    def __init__(self, rnn: nn.RNN, fc: nn.Linear):
        super().__init__()
        self.lin = nn.Linear(rnn.input_size, rnn.hidden_size, dtype=DT)
        with torch.no_grad():
            self.lin.weight.copy_(rnn.weight_ih_l0)
            self.lin.bias.copy_(rnn.bias_ih_l0 + rnn.bias_hh_l0)
        self.fc = fc

    def forward(self, x):
        return self.fc(torch.tanh(self.lin(x)))


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_single_step_is_a_linear_layer(loss):
    """With ``T = 1`` and zero initial state, ``weight_ih``'s factors are those of the
    equivalent Linear layer (every extension and approx)."""
    model, X, y = _case("rnn_tanh", 4, 1, 3, 2, 1, True, True, False, "none", "last", loss, 3)
    cell = Cell(model.rnn, model.fc).to(DT)
    lossfn = LOSSES[loss]()
    for approx in APPROXES:
        gen = lambda: seeded(2)  # noqa: E731
        exts = lambda: [KFLR(kfac_approx=approx), KFACEmpirical(kfac_approx=approx),  # noqa: E731
                        KFAC(mc_samples=2, kfac_approx=approx, generator=gen())]
        got = curvature(model, lossfn, exts())(X, y)
        want = curvature(cell, lossfn, exts())(X[:, 0], y)
        for key in ("kflr", "kfac_empirical", "kfac"):
            for a, b in zip(got[key]["rnn.weight_ih_l0"], want[key]["lin.weight"]):
                _close(a, b, f"{key}({approx!r}) weight")
            for bias in ("rnn.bias_ih_l0", "rnn.bias_hh_l0"):
                _close(got[key][bias][0], want[key]["lin.bias"][0], f"{key}({approx!r}) {bias}")
            # weight_hh acts on the zero initial state: A = 0
            assert got[key]["rnn.weight_hh_l0"][1].abs().max() == 0


@pytest.mark.parametrize("approx", APPROXES)
def test_chunks_and_batch_slices(approx):
    """Column chunks and batch slices give the same factors (exactly one factor, ``B``,
    depends on the root: curvlib._core.kronlayout)."""
    model, X, y = _case("lstm", 4, 3, 2, 2, 2, True, False, True, "buffer", "seq", "ce", 7)
    lossfn = nn.CrossEntropyLoss()
    exts = [KFLR(kfac_approx=approx), KFACEmpirical(kfac_approx=approx)]
    whole = curvature(model, lossfn, exts)(X, y)
    for kw in ({"chunk_size": 1}, {"batch_chunk_size": 3}):
        parts = curvature(model, lossfn, exts, **kw)(X, y)
        for key in ("kflr", "kfac_empirical"):
            for name, factors in whole[key].items():
                for a, b in zip(parts[key][name], factors):
                    _close(a, b, f"{key}[{name}] with {kw}")


def test_module_applied_twice_is_positions():
    """A recurrent module used twice (on its own output): ``kfac_approx=None`` treats the
    uses like more positions (roots summed in ``B``, inputs' outer products in ``A``), and so do
    "expand" and "reduce", as for a shared Linear weight."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(2, 2, batch_first=True)
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            o, _ = self.rnn(x)
            o, _ = self.rnn(o)
            return self.fc(o[:, -1])

    torch.manual_seed(0)
    model = Twice().to(DT)
    X, y = torch.randn(3, 2, 2, dtype=DT), torch.randint(0, 2, (3,))
    lossfn = nn.CrossEntropyLoss()
    got = curvature(model, lossfn, [KFLR()])(X, y)["kflr"]
    # oracle: one offset per use and step, summed over both (uses as positions)
    with torch.no_grad():
        o1, _ = model.rnn(X)
        o2, _ = model.rnn(o1)
    n = X.shape[0]
    H = loss_hessian_blocks(lossfn, model(X), y)

    def out_with(d1, d2):
        r1 = unrolled(model.rnn, X, None, {"weight_ih_l0": d1, "weight_hh_l0": torch.zeros(n, 2, 6, dtype=DT)}, None)
        r2 = unrolled(model.rnn, r1, None, {"weight_ih_l0": d2, "weight_hh_l0": torch.zeros(n, 2, 6, dtype=DT)}, None)
        return model.fc(r2[:, -1])

    z = torch.zeros(n, 2, 6, dtype=DT)
    J1, J2 = jacrev(out_with, argnums=(0, 1))(z, z)
    Js = torch.stack([(J1[i, :, i] + J2[i, :, i]).sum(1) for i in range(n)])  # [N, C, O]
    B = torch.einsum("nco,ncd,ndq->oq", Js, H, Js).detach()
    A = (torch.einsum("nti,ntj->ij", X, X) + torch.einsum("nti,ntj->ij", o1, o1)) / n
    _close(got["rnn.weight_ih_l0"][0], B, "B")
    _close(got["rnn.weight_ih_l0"][1], A, "A")
    # "expand"/"reduce": the same positions, each (use, step) a row of B resp. x̄ their mean
    per_step = torch.stack([torch.cat([J1[i, :, i], J2[i, :, i]], 1) for i in range(n)])  # [N, C, 2T, O]
    x = torch.cat([X, o1], 1)  # [N, 2T, I]
    expand = curvature(model, lossfn, [KFLR(kfac_approx="expand")])(X, y)["kflr"]["rnn.weight_ih_l0"]
    _close(expand[0], torch.einsum("ncso,ncd,ndsq->oq", per_step, H, per_step).detach(), "B expand")
    _close(expand[1], torch.einsum("nti,ntj->ij", x, x) / (n * x.shape[1]), "A expand")
    reduce = curvature(model, lossfn, [KFLR(kfac_approx="reduce")])(X, y)["kflr"]["rnn.weight_ih_l0"]
    _close(reduce[0], B, "B reduce")
    _close(reduce[1], x.mean(1).T @ x.mean(1) / n, "A reduce")


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_kfra_refused_by_name(kind):
    model, X, y = _case(kind, 2, 2, 2, 2, 1, True, True, False, "none", "last", "mse", 0)
    with pytest.raises(CurvatureError, match=r"KFRA is not defined for the recurrent module\(s\) \['rnn'\].*KFLR or KFAC"):
        curvature(model, nn.MSELoss(), [KFRA()])(X, y)
