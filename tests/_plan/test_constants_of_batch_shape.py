"""Tensors that carry no sample's values but have the batch's shape are constants, not mixings
(:mod:`curvlib._plan.independence`): a mask made by ``h.new_ones(N, N)``, ``new_zeros``,
``new_full``, ``*_like`` (Funnel, Longformer), an ALiBi bias built from shapes and merged with
the heads ``[N·H, 1, T]`` (Bloom, GPT-NeoX-Japanese), a learned bias expanded to the batch.
Each model is drawn on both front ends (torch.fx, and the ATen front end, where the tracer
evaluates such constants once); every quantity equals the float64 brute force. The same shapes
built from hot values (a parameter-dependent ``[N, N]`` product, a learned per-sample bias
merged in another order than the scores) stay refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib.extensions import KFLR, BatchGrad

from oracles.merged_heads import merge, split
from oracles.checks import check_first_order, check_second_order
from oracles.on_device import seeded

DT = torch.float64
CREATORS = ("new_ones", "new_zeros", "new_full", "new_empty", "ones_like", "full_like", "zeros_like")


def _second_order(model: nn.Module, X, y) -> None:
    """The GGN family against the brute force; KFLR runs and is finite (its oracle takes layers on
    rows ``[N, I]`` only, these read sequences)."""
    check_second_order(model, nn.MSELoss(), X, y, hessian=False, hmp=False)
    factors = curvature(model, nn.MSELoss(), [KFLR()])(X, y)["kflr"]
    assert factors and all(bool(f.isfinite().all()) for fs in factors.values() for f in fs)


def _created(h, how: str, shape):
    """A tensor of ``shape`` made from ``h``'s dtype and device (or, for ``*_like``, from a
    tensor of that shape cut from ``h``'s shape), filled with a value that is the same for
    every sample: ones, or ``1 +`` zeros."""
    if how == "new_ones":
        return h.new_ones(shape)
    if how == "new_zeros":
        return 1 + h.new_zeros(shape)
    if how == "new_full":
        return h.new_full(shape, 1.0)
    if how == "new_empty":
        return h.new_empty(shape).fill_(1.0)
    like = h.detach().new_zeros(shape)
    return {"ones_like": torch.ones_like, "full_like": lambda t: torch.full_like(t, 1.0),
            "zeros_like": lambda t: 1 + torch.zeros_like(t)}[how](like)


class CreatedMask(nn.Module):
    """``[N, T, 3]`` -> Linear -> ``h * mask`` with a mask ``[N, N]`` (``square``: Funnel's
    ``new_ones`` of the batch's size in two dims) or ``[N, T]`` made from ``h``'s shape, read as
    a per-sample factor of one -> Tanh -> mean over T -> Linear. ``mixing``: the ``[N, N]``
    factor is ``h hᵀ`` normalised instead, the same shape built from every sample's values."""

    def __init__(self, how: str, square: bool, aten: bool, mixing: bool = False):
        super().__init__()
        self.a, self.act, self.b = nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)
        self.how, self.square, self.aten, self.mixing = how, square, aten, mixing

    def forward(self, x):
        if self.aten and bool(x.abs().sum() >= 0):  # a branch on values: the ATen front end
            x = x + 0
        h = self.a(x)
        n, t = h.shape[0], h.shape[1]
        if self.mixing:
            g = h.flatten(1) @ h.flatten(1).t()                         # [N, N] from all samples
            factor = (g / g.abs().sum(1, keepdim=True)).sum(1)[:, None]
        elif self.square:
            factor = _created(h, self.how, (n, n)).mean(1)[:, None]      # [N, 1] of ones
        else:
            factor = _created(h, self.how, (n, t))                      # [N, T] of ones
        return self.b(self.act(h * factor[..., None]).mean(1))


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(2, 4), how=st.sampled_from(CREATORS), square=st.booleans(),
       aten=st.booleans())
def test_created_mask_is_a_constant(seed, n, how, square, aten):
    torch.manual_seed(seed)
    g = seeded(seed)
    X, y = torch.randn(n, 3, 3, generator=g, dtype=DT), torch.randn(n, 2, generator=g, dtype=DT)
    model = CreatedMask(how, square, aten).to(DT)
    check_first_order(model, nn.MSELoss(), X, y)
    _second_order(model, X, y)


@pytest.mark.parametrize("aten", [False, True])
def test_same_shape_from_every_sample_stays_refused(aten):
    g = seeded(1)
    X, y = torch.randn(3, 3, 3, generator=g, dtype=DT), torch.randn(3, 2, generator=g, dtype=DT)
    with pytest.raises(CurvatureError, match="Samples are mixed"):
        curvature(CreatedMask("new_ones", True, aten, mixing=True).to(DT), nn.MSELoss(), [BatchGrad()])(X, y)


class FilledBuffer(nn.Module):
    """``buf = h.new_zeros(N, T, 4)`` filled in place with a Linear's output (``add_``, ``+=``, or
    ``buf[:, 1:] = h[:, 1:]``), then read: the buffer holds sample data from the write on;
    ``mixing`` takes a softmax of it over the batch dim."""

    def __init__(self, how: str, aten: bool, mixing: bool = False):
        super().__init__()
        self.a, self.act, self.b = nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)
        self.how, self.aten, self.mixing = how, aten, mixing

    def forward(self, x):
        if self.aten and bool(x.abs().sum() >= 0):  # a branch on values: the ATen front end
            x = x + 0
        h = self.a(x)
        buf = h.new_zeros(h.shape)
        if self.how == "add_":
            buf.add_(h)
        elif self.how == "setitem":
            buf[:, 1:] = h[:, 1:]
        else:
            buf += h
        return self.b(self.act(buf.softmax(0) if self.mixing else buf).mean(1))


@pytest.mark.parametrize("aten", [False, True])
@pytest.mark.parametrize("how", ["add_", "setitem", "iadd"])
def test_buffer_filled_in_place_holds_sample_data(how, aten):
    g = seeded(5)
    X, y = torch.randn(3, 3, 3, generator=g, dtype=DT), torch.randn(3, 2, generator=g, dtype=DT)
    check_first_order(FilledBuffer(how, aten).to(DT), nn.MSELoss(), X, y)
    with pytest.raises(CurvatureError, match="Samples are mixed"):
        curvature(FilledBuffer(how, aten, mixing=True).to(DT), nn.MSELoss(), [BatchGrad()])(X, y)


# ----------------------------------------------------------------------------- ALiBi on merged heads

H, DH = 2, 2


class Alibi(nn.Module):
    """``[N, T, 4]`` -> q, k, v ``[N, H, T, DH]`` merged into ``[N·H, T, DH]`` (``head_major``
    or not) -> ``baddbmm(bias, q, kᵀ)`` with an ALiBi bias ``slope_h · j`` merged ``[N·H, 1, T]``
    -> softmax -> ``@ v`` -> split -> Linear -> mean over T -> Linear.

    The bias is built, as ``bias`` says, from shapes with fixed slopes (``"shapes"``), from
    learned slopes (``"learned"``: a parameter expanded to the batch), or from the input's own
    per-sample positions (``"input"``: a cumulative count of positive entries, merged in
    ``bias_head_major`` order, which must match the scores' to keep samples apart); with
    ``"hot"`` from a Linear on the input (a per-sample learned bias), merged likewise. ``how``
    merges it: ``expand`` then reshape, ``repeat``, ``repeat_interleave``."""

    def __init__(self, head_major: bool, bias: str, how: str, aten: bool, bias_head_major=None):
        super().__init__()
        self.qkv, self.out, self.head = nn.Linear(4, 3 * H * DH), nn.Linear(H * DH, 4), nn.Linear(4, 2)
        self.slopes = nn.Parameter(torch.tensor([0.5, 0.25])) if bias == "learned" else None
        self.to_bias = nn.Linear(4, H) if bias == "hot" else None
        self.head_major, self.bias, self.how, self.aten = head_major, bias, how, aten
        self.bias_head_major = head_major if bias_head_major is None else bias_head_major

    def _bias(self, x):
        n, t = x.shape[0], x.shape[1]
        slopes = self.slopes if self.slopes is not None else torch.tensor([0.5, 0.25], dtype=x.dtype)
        if self.bias in ("input", "hot"):
            pos = (x[..., 0] > 0).to(x.dtype).cumsum(-1) if self.bias == "input" else self.to_bias(x).transpose(1, 2)
            per = slopes[None, :, None] * pos[:, None, :] if self.bias == "input" else pos   # [N, H, T]
            return merge(per, self.bias_head_major)[:, None, :]
        row = slopes[:, None] * torch.arange(t, dtype=x.dtype)[None, :]                    # [H, T]
        if self.how == "expand":
            full = row[:, None].expand(H, n, t) if self.head_major else row[None].expand(n, H, t)
            return full.reshape(n * H, 1, t)
        if self.how == "repeat":  # head-major: each head's row N times in a row
            return (row.repeat_interleave(n, 0) if self.head_major else row.repeat(n, 1))[:, None, :]
        return (row.repeat(1, n).reshape(H * n, t) if self.head_major else row.repeat(n, 1))[:, None, :]

    def forward(self, x):
        if self.aten and bool(x.abs().sum() >= 0):  # a branch on values: the ATen front end
            x = x + 0
        n, t = x.shape[0], x.shape[1]
        q, k, v = (merge(z.transpose(1, 2), self.head_major)
                   for z in self.qkv(x).view(n, t, 3, H, DH).unbind(2))                # [N·H, T, DH]
        scores = torch.baddbmm(self._bias(x), q, k.transpose(1, 2), beta=1.0, alpha=DH ** -0.5)
        h = split(scores.softmax(-1) @ v, n, H, self.head_major)                           # [N, H, T, DH]
        return self.head(self.out(h.transpose(1, 2).reshape(n, t, H * DH)).mean(1))


def _alibi_data(seed: int, n: int):
    g = seeded(seed)
    return torch.randn(n, 3, 4, generator=g, dtype=DT), torch.randn(n, 2, generator=g, dtype=DT)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(2, 4), head_major=st.booleans(),
       bias=st.sampled_from(["shapes", "input", "hot"]), how=st.sampled_from(["expand", "repeat", "tile"]),
       aten=st.booleans())
def test_alibi_bias_on_merged_heads(seed, n, head_major, bias, how, aten):
    torch.manual_seed(seed)
    X, y = _alibi_data(seed, n)
    model = Alibi(head_major, bias, how, aten).to(DT)
    check_first_order(model, nn.MSELoss(), X, y)
    _second_order(model, X, y)


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(2, 4), head_major=st.booleans(),
       how=st.sampled_from(["expand", "repeat", "tile"]), aten=st.booleans())
def test_learned_slopes_meet_the_batch_in_a_merged_layer(seed, n, head_major, how, aten):
    """Learned slopes expanded to ``[N·H, 1, T]`` mix no samples; their first use beside the
    input's values, ``baddbmm``, is an op on parameters on merged rows, run once per sample
    (:class:`curvlib._plan.per_sample_ops.PerSample`): exact (it was refused before)."""
    torch.manual_seed(seed)
    X, y = _alibi_data(seed, n)
    model = Alibi(head_major, "learned", how, aten).to(DT)
    check_first_order(model, nn.MSELoss(), X, y)
    _second_order(model, X, y)


@pytest.mark.parametrize("aten", [False, True])
@pytest.mark.parametrize("head_major", [False, True])
def test_per_sample_bias_merged_in_another_order_stays_refused(aten, head_major):
    """A learned per-sample bias merged head-major beside batch-major scores (or the other way
    round) adds sample ``m``'s bias to sample ``n``'s scores."""
    X, y = _alibi_data(2, 3)
    model = Alibi(head_major, "hot", "expand", aten, bias_head_major=not head_major).to(DT)
    with pytest.raises(CurvatureError, match="Samples are mixed"):
        curvature(model, nn.MSELoss(), [BatchGrad()])(X, y)


# ----------------------------------------------------------------------------- a Function on merged rows


class Cumulate(torch.autograd.Function):
    """YOSO's cumulation, in miniature: ``(tanh(q kᵀ) ⊙ m mᵀ) v`` per row of ``[R, T, D]``, with
    its own backward and jvp; ``shift`` reads ``v`` of the previous row instead (rows of other
    samples)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(mask, q, k, v, shift):
        v = v.roll(1, 0) if shift else v
        return (torch.tanh(q @ k.transpose(-1, -2)) * mask[..., :, None] * mask[..., None, :]) @ v

    @staticmethod
    def setup_context(ctx, inputs, output):
        mask, q, k, v, shift = inputs
        v = v.roll(1, 0) if shift else v
        m, t = mask[..., :, None] * mask[..., None, :], torch.tanh(q @ k.transpose(-1, -2))
        ctx.save_for_backward(m, t, q, k, v)
        ctx.save_for_forward(m, t, q, k, v)
        ctx.shift = shift

    @staticmethod
    def backward(ctx, g):
        m, t, q, k, v = ctx.saved_tensors
        grad_v = (t * m).transpose(-1, -2) @ g
        grad_s = (g @ v.transpose(-1, -2)) * m * (1 - t ** 2)
        grad_v = grad_v.roll(-1, 0) if ctx.shift else grad_v
        return None, grad_s @ k, grad_s.transpose(-1, -2) @ q, grad_v, None

    @staticmethod
    def jvp(ctx, _, dq, dk, dv, __):
        m, t, q, k, v = ctx.saved_tensors
        dt = (1 - t ** 2) * (dq @ k.transpose(-1, -2) + q @ dk.transpose(-1, -2))
        return (dt * m) @ v + (t * m) @ (dv.roll(1, 0) if ctx.shift else dv)


class MergedFunction(nn.Module):
    """``[N, T, 4]`` -> q, k, v merged batch-major ``[N·H, T, DH]`` -> :class:`Cumulate` with a
    mask ``[N·H, T]`` made as YOSO makes it (``repeat_interleave`` of a per-sample mask over the
    heads): of ones from shapes, or from the input's values -> split -> Linear -> mean -> Linear."""

    def __init__(self, mask_from_input: bool, aten: bool, shift: bool = False):
        super().__init__()
        self.qkv, self.out, self.head = nn.Linear(4, 3 * H * DH), nn.Linear(H * DH, 4), nn.Linear(4, 2)
        self.mask_from_input, self.aten, self.shift = mask_from_input, aten, shift

    def forward(self, x):
        if self.aten and bool(x.abs().sum() >= 0):  # a branch on values: the ATen front end
            x = x + 0
        n, t = x.shape[0], x.shape[1]
        mask = (x[..., 0] > -1).to(x.dtype) if self.mask_from_input else torch.ones(n, t, dtype=x.dtype)
        mask = mask.unsqueeze(1).repeat_interleave(H, dim=1).reshape(n * H, t)
        q, k, v = (z.transpose(1, 2).reshape(n * H, t, DH) for z in self.qkv(x).view(n, t, 3, H, DH).unbind(2))
        h = Cumulate.apply(mask, q, k, v, self.shift).reshape(n, H, t, DH)
        return self.head(self.out(h.transpose(1, 2).reshape(n, t, H * DH)).mean(1))


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(2, 4), mask_from_input=st.booleans(), aten=st.booleans())
def test_function_on_merged_rows_is_tested_numerically(seed, n, mask_from_input, aten):
    """The Function is outside curvlib's tables: its leak test (sample ``j``'s rows of its
    inputs changed, other rows of its output unchanged) passes; every quantity is exact."""
    torch.manual_seed(seed)
    X, y = _alibi_data(seed, n)
    model = MergedFunction(mask_from_input, aten).to(DT)
    check_first_order(model, nn.MSELoss(), X, y)
    _second_order(model, X, y)


@pytest.mark.parametrize("aten", [False, True])
def test_function_reading_other_rows_is_refused(aten):
    X, y = _alibi_data(4, 3)
    with pytest.raises(CurvatureError, match="Cumulate.*changed other samples' outputs"):
        curvature(MergedFunction(False, aten, shift=True).to(DT), nn.MSELoss(), [BatchGrad()])(X, y)
