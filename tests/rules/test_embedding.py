"""Embedding rule against the per-sample-copies oracle, and its refusals."""

import copy
from collections import OrderedDict

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from curvlib import curvature
from curvlib.extensions import BatchGrad, BatchL2Grad, SumGradSquared, Variance

from oracles.checks import check_first_order, state_snapshot, _assert_same_state
from oracles.on_device import seeded

LOSSES = {"mse": nn.MSELoss, "ce": nn.CrossEntropyLoss}


class MeanOverPositions(nn.Module):
    """``[N, S, D] -> [N, D]``: average of the embedded positions, then a Linear head."""

    def __init__(self, emb: nn.Embedding, out: int):
        super().__init__()
        self.emb = emb
        self.head = nn.Linear(emb.embedding_dim, out)

    def forward(self, idx):
        return self.head(torch.tanh(self.emb(idx)).mean(1))


def _targets(kind, out, gen):
    if kind == "ce":
        return torch.randint(0, out.shape[1], (out.shape[0],), generator=gen)
    return torch.randn(out.shape, generator=gen, dtype=out.dtype)


@given(
    n=st.integers(1, 4),
    s=st.one_of(st.none(), st.integers(1, 4)),
    v=st.integers(1, 5),
    d=st.integers(1, 3),
    pad=st.one_of(st.none(), st.integers(-1, 4)),
    head=st.sampled_from(["flatten", "mean"]),
    loss=st.sampled_from(sorted(LOSSES)),
    reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**16),
)
def test_embedding(n, s, v, d, pad, head, loss, reduction, seed):
    """Indices ``[N]`` or ``[N, S]`` drawn from a small vocabulary (so indices repeat
    within a sample), with or without ``padding_idx`` (which then occurs)."""
    if pad is not None and not -v <= pad < v:
        pad = pad % v
    gen = seeded(seed)
    torch.manual_seed(seed)
    emb = nn.Embedding(v, d, padding_idx=pad)
    with torch.no_grad():  # the padding row need not stay zero; its gradient must
        emb.weight.copy_(torch.randn(v, d, generator=gen))
    shape = (n,) if s is None else (n, s)
    X = torch.randint(0, v, shape, generator=gen)
    if pad is not None:
        X.view(-1)[0] = emb.padding_idx
    if s is None:
        model = nn.Sequential(emb, nn.Linear(d, 3))
    elif head == "flatten":
        model = nn.Sequential(emb, nn.Flatten(), nn.Linear(s * d, 3))
    else:
        model = MeanOverPositions(emb, 3)
    model = model.double()
    y = _targets(loss, model(X), gen)
    check_first_order(model, LOSSES[loss](reduction=reduction), X, y)


def test_embedding_sparse_same_as_dense():
    """``sparse=True`` only changes autograd's ``.grad`` layout: same quantities as the dense twin.

    (The oracle cannot square sparse gradients, so the dense twin is checked against it.)
    """
    gen = seeded(4)
    torch.manual_seed(4)
    dense = nn.Sequential(nn.Embedding(5, 3, padding_idx=2), nn.Flatten(), nn.Linear(9, 2)).double()
    sparse = copy.deepcopy(dense)
    sparse[0].sparse = True
    X = torch.randint(0, 5, (4, 3), generator=gen)
    X[0, 0] = 2
    y = torch.randint(0, 2, (4,), generator=gen)
    ref = check_first_order(dense, nn.CrossEntropyLoss(), X, y)
    before = state_snapshot(sparse)
    qs = curvature(sparse, nn.CrossEntropyLoss(), [BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()])(X, y)
    _assert_same_state(before, state_snapshot(sparse))
    torch.testing.assert_close(qs.pop("loss"), ref.pop("loss"))
    assert qs.keys() == ref.keys()
    for q, per_param in ref.items():
        for name, value in per_param.items():
            assert not qs[q][name].is_sparse
            torch.testing.assert_close(qs[q][name], value, msg=lambda m: f"{q}[{name}]: {m}")


def test_embedding_many_repeats_and_padding():
    """Long sequences over a tiny vocabulary: every (sample, index) pair repeats."""
    gen = seeded(3)
    torch.manual_seed(3)
    model = MeanOverPositions(nn.Embedding(3, 2, padding_idx=1), 2).double()
    X = torch.randint(0, 3, (4, 17), generator=gen)
    X[2] = 1  # a sample made only of padding: zero individual gradient
    check_first_order(model, nn.MSELoss(reduction="sum"), X, torch.randn(4, 2, dtype=torch.float64, generator=gen))


def test_embedding_tied_to_output_layer():
    """Weight shared by the embedding and the output Linear: individual gradients are summed."""

    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 3, padding_idx=0)
            self.out = nn.Linear(3, 5, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, idx):  # [N, S] -> [N, V, S]
            return self.out(torch.tanh(self.emb(idx))).movedim(-1, 1)

    gen = seeded(0)
    torch.manual_seed(0)
    model = TinyLM().double()
    X = torch.randint(0, 5, (3, 4), generator=gen)
    check_first_order(model, nn.CrossEntropyLoss(), X, torch.randint(0, 5, (3, 4), generator=gen))


def test_embedding_batch_not_in_dim0():
    """Embedding of ``[S, N]`` indices (batch in dim 1 of its output) is handled exactly."""

    class TimeMajor(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(4, 2, padding_idx=3)
            self.fc = nn.Linear(2 * 3, 2)

        def forward(self, idx):  # idx [N, S]
            h = self.emb(idx.t())  # [S, N, D]
            return self.fc(h.transpose(0, 1).flatten(1))

    gen = seeded(2)
    torch.manual_seed(2)
    model = TimeMajor().double()
    X = torch.randint(0, 4, (5, 3), generator=gen)
    check_first_order(model, nn.CrossEntropyLoss(reduction="sum"), X, torch.randint(0, 2, (5,), generator=gen))


def test_embedding_frozen():
    """A frozen embedding (``from_pretrained``) gets no quantities; the head still does."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding.from_pretrained(torch.randn(6, 2, dtype=torch.float64)), nn.Flatten(), nn.Linear(4, 2)
    ).double()
    X = torch.randint(0, 6, (3, 2))
    qs = check_first_order(model, nn.MSELoss(), X, torch.randn(3, 2, dtype=torch.float64))
    assert "0.weight" not in qs["grad_batch"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_norm": 1.0}, r"'emb'.*max_norm=1\.0.*mutate.*max_norm=None"),
        ({"scale_grad_by_freq": True}, r"'emb'.*scale_grad_by_freq=True.*mixes samples"),
    ],
)
def test_embedding_refused(kwargs, match):
    """Options that mutate the weight or mix samples are refused before any work."""
    model = nn.Sequential(OrderedDict(emb=nn.Embedding(4, 3, **kwargs), flat=nn.Flatten(), out=nn.Linear(6, 2)))
    model = model.double()
    with torch.no_grad():
        model.emb.weight.mul_(10.0)  # rows with norm > max_norm: a look-up would renormalise them
    X = torch.randint(0, 4, (3, 2))
    before = state_snapshot(model)
    with pytest.raises(ValueError, match=match):
        curvature(model, nn.MSELoss(), [BatchGrad(), BatchL2Grad(), SumGradSquared()])(
            X, torch.randn(3, 2, dtype=torch.float64)
        )
    _assert_same_state(before, state_snapshot(model))


class _NewTensorsAtLeast(TorchDispatchMode):
    """The ATen ops whose output is a new tensor (no input's storage) of at least ``numel`` entries."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self.ops += [str(func) for t in tree_leaves(out)
                     if isinstance(t, torch.Tensor) and t.numel() >= self.numel and t.untyped_storage().data_ptr() not in given]
        return out


def test_embedding_individual_gradients_formed_once():
    """``BatchGrad``'s ``[N, V, D]`` of an embedding is one buffer the rows are summed into in
    place, not a zero buffer and a second one the size of the result (a language model's
    vocabulary makes it the call's largest tensor)."""
    n, v, d, s = 3, 50, 4, 6
    model = nn.Sequential(nn.Embedding(v, d), nn.Flatten(), nn.Linear(s * d, 2)).double()
    X, y = torch.randint(0, v, (n, s)), torch.randint(0, 2, (n,))
    f = curvature(model, nn.CrossEntropyLoss(), [BatchGrad()])
    with _NewTensorsAtLeast(n * v * d) as made:
        q = f(X, y)
    assert made.ops == ["aten.new_zeros.default"], made.ops
    assert q["grad_batch"]["0.weight"].shape == (n, v, d)
