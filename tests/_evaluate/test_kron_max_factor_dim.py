"""``KFAC``/``KFLR``/``KFACEmpirical(max_factor_dim=d)``: a factor side larger than ``d`` is
the diagonal of the dense factor (1-D), the other side is unchanged; without the option a
dense factor over ``curvlib._core.settings.Settings.dense_factor_bytes`` is refused before any work;
batch slices (and ranks, tests/test_distributed.py) combine a diagonal side by its role.

Oracles: BackPACK's factors by brute force in float64 (``oracles.second_order.kron_reference``:
Jacobians of per-channel output offsets, the layer's inputs) for MLPs drawn by hypothesis;
for the other layouts (Embedding, convolutions, LayerNorm, learned positions, sequences)
curvlib's dense factors, which tests/_evaluate/test_kron_layers.py and test_kfac_approx.py check
against brute force. Downstream: the preconditioners of a 1-D factor equal those of the
dense diagonal matrix (``torch.diag``).
"""

from __future__ import annotations

import time
from unittest import mock

import pytest
import torch
from oracles.on_device import seeded
from hypothesis import given, settings, strategies as st
from torch import nn

import curvlib._evaluate.second_order as secondorder
from curvlib import CurvatureError, curvature
from curvlib._core.settings import override
from curvlib import precondition as pre
from curvlib.extensions import KFAC, KFLR, BatchGrad, KFACEmpirical
from curvlib.optim import KFACOptimizer

from oracles.second_order import kron_reference

DT = torch.float64
LOSSES = {"ce": nn.CrossEntropyLoss(), "mse": nn.MSELoss(reduction="sum")}


def _expected(dense: torch.Tensor, got: torch.Tensor, side: int, max_dim: int) -> torch.Tensor:
    """``dense``, or its diagonal where ``side > max_dim`` (grouped: per-group diagonals)."""
    if side <= max_dim:
        assert got.shape == dense.shape
        return dense
    assert got.dim() == 1, got.shape
    return torch.diagonal(dense, dim1=-2, dim2=-1).reshape(-1)


def _side_dims(f: torch.Tensor) -> int:
    return f.shape[-1]


def _compare(dense: dict, diag: dict, max_dim: int) -> None:
    """Every factor of ``diag`` is ``dense``'s, or its diagonal where that side exceeds ``max_dim``."""
    assert dense.keys() == diag.keys()
    for name in dense:
        assert len(dense[name]) == len(diag[name]), name
        for d, g in zip(dense[name], diag[name]):
            want = d if d.dim() == 1 else _expected(d, g, _side_dims(d), max_dim)
            torch.testing.assert_close(g, want, msg=name)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 4), d_in=st.integers(1, 5), hidden=st.integers(1, 5), d_out=st.integers(2, 5),
       max_dim=st.integers(1, 5), loss=st.sampled_from(sorted(LOSSES)), seed=st.integers(0, 2**16))
def test_linear_sides_match_brute_force(n, d_in, hidden, d_out, max_dim, loss, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out)).to(DT)
    X = torch.randn(n, d_in, dtype=DT)
    y = torch.randint(0, d_out, (n,)) if loss == "ce" else torch.randn(n, d_out, dtype=DT)
    got = curvature(model, LOSSES[loss], [KFLR(max_factor_dim=max_dim)])(X, y)["kflr"]
    for layer, sides in (("0", (hidden, d_in)), ("2", (d_out, hidden))):
        ref = kron_reference(model, LOSSES[loss], X, y, layer, "weight")
        for f, r, side in zip(got[f"{layer}.weight"], ref, sides):
            torch.testing.assert_close(f, _expected(r, f, side, max_dim))
        (b,) = got[f"{layer}.bias"]
        torch.testing.assert_close(b, _expected(ref[0], b, sides[0], max_dim))


class _Tokens(nn.Module):
    """Embedding + learned positions + LayerNorm + a Linear on the sequence + an LM head."""

    def __init__(self, vocab=9, d=4, t=5):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(t, d) / 4)
        self.norm = nn.LayerNorm(d)
        self.mix = nn.Linear(d, 6)
        self.head = nn.Linear(6, vocab)

    def forward(self, idx):
        h = self.norm(self.tok(idx) + self.pos[: idx.shape[1]])
        return self.head(torch.tanh(self.mix(h))).transpose(1, 2)  # [N, V, T] for CrossEntropyLoss


def _convnet():
    return nn.Sequential(nn.Conv2d(2, 6, 2, padding=1), nn.Tanh(), nn.ConvTranspose2d(6, 3, 2, stride=2, groups=3),
                         nn.Flatten(), nn.Linear(3 * 8 * 8, 5))


CASES = {  # model, X, y, loss
    "tokens": (_Tokens, lambda: torch.randint(0, 9, (3, 5)), lambda: torch.randint(0, 9, (3, 5)), nn.CrossEntropyLoss()),
    "conv": (_convnet, lambda: torch.randn(3, 2, 3, 3, dtype=DT), lambda: torch.randn(3, 5, dtype=DT), nn.MSELoss()),
}


@pytest.mark.parametrize("approx", [None, "expand"])
@pytest.mark.parametrize("max_dim", [3, 5, 8])
@pytest.mark.parametrize("case", sorted(CASES))
def test_other_layouts_keep_the_dense_factors_diagonal(case, max_dim, approx):
    make, X, y, lossfn = CASES[case]
    torch.manual_seed(0)
    model, X, y = make().to(DT), X(), y()
    for cls in (KFLR, KFACEmpirical):
        dense = curvature(model, lossfn, [cls(kfac_approx=approx)])(X, y)[cls.name]
        # chunk_size=1: the column chunks' root factors are summed, the input factors kept
        diag = curvature(model, lossfn, [cls(kfac_approx=approx, max_factor_dim=max_dim)], chunk_size=1)(X, y)
        _compare(dense, diag[cls.name], max_dim)
    dense = curvature(model, lossfn, [KFAC(generator=seeded(1))])(X, y)["kfac"]
    diag = curvature(model, lossfn, [KFAC(generator=seeded(1), max_factor_dim=max_dim)])(X, y)
    _compare(dense, diag["kfac"], max_dim)


def test_head_output_side_is_the_diagonal():
    torch.manual_seed(0)
    model = _Tokens().to(DT)
    X, y = torch.randint(0, 9, (3, 5)), torch.randint(0, 9, (3, 5))
    f = curvature(model, nn.CrossEntropyLoss(), [KFLR(max_factor_dim=8)])(X, y)["kflr"]
    assert [tuple(t.shape) for t in f["head.weight"]] == [(9,), (6, 6)]
    assert [tuple(t.shape) for t in f["head.bias"]] == [(9,)]
    assert [tuple(t.shape) for t in f["tok.weight"]] == [(9,), (4, 4)]  # Embedding's [A [V], B]: unchanged


@pytest.mark.parametrize("method", ["pi", "plain", "exact"])
def test_preconditioners_read_a_diagonal_side(method):
    """A 1-D factor acts as ``torch.diag`` of it in every preconditioner (and EKFAC)."""
    torch.manual_seed(0)
    model = _Tokens().to(DT)
    X, y = torch.randint(0, 9, (3, 5)), torch.randint(0, 9, (3, 5))
    lossfn = nn.CrossEntropyLoss()
    qs = curvature(model, lossfn, [KFLR(max_factor_dim=5), BatchGrad()])(X, y)
    one_d = qs["kflr"]
    as_matrix = {n: [torch.diag(t) if t.dim() == 1 and n.startswith(("head", "mix")) else t for t in fs]
                 for n, fs in one_d.items()}
    assert any(t.dim() == 1 for t in one_d["head.weight"]) and any(t.dim() == 1 for t in one_d["mix.weight"])
    got = pre.kron_inverse_vp(one_d, qs["grad"], 1e-2, method=method)
    want = pre.kron_inverse_vp(as_matrix, qs["grad"], 1e-2, method=method)
    for name in want:
        torch.testing.assert_close(got[name], want[name])
    if method == "exact":  # brute force: (diag(B) ⊗ A + λ)⁻¹ vec(g) for the head
        B, A = one_d["head.weight"]
        dense = torch.kron(torch.diag(B), torch.diag(A) if A.dim() == 1 else A)
        dense = dense + 1e-2 * torch.eye(dense.shape[0], dtype=DT)
        g = qs["grad"]["head.weight"]
        torch.testing.assert_close(got["head.weight"].reshape(-1), torch.linalg.solve(dense, g.reshape(-1)))
    scale = pre.reduction_scale(lossfn, y)
    s_1d = pre.ekfac_eigenvalues(one_d, qs["grad_batch"], scale=scale)
    s_mat = pre.ekfac_eigenvalues(as_matrix, qs["grad_batch"], scale=scale)
    e1 = pre.ekfac_inverse_vp(one_d, s_1d, qs["grad"], damping=1e-2)
    e2 = pre.ekfac_inverse_vp(as_matrix, s_mat, qs["grad"], damping=1e-2)
    for name in e2:
        torch.testing.assert_close(e1[name], e2[name])


def test_optimizer_steps_with_a_diagonal_head():
    torch.manual_seed(0)
    model = _Tokens()
    X, y = torch.randint(0, 9, (4, 5)), torch.randint(0, 9, (4, 5))
    for curv in ("kfac", "kflr", "ekfac"):
        opt = KFACOptimizer(model, nn.CrossEntropyLoss(), lr=0.05, damping=1e-2, curvature=curv, max_factor_dim=5)
        losses = [float(opt.step(X, y)) for _ in range(4)]
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], (curv, losses)


def _lm(vocab: int, d: int = 8):
    return nn.Sequential(nn.Embedding(vocab, d), nn.Linear(d, vocab))


def test_refused_before_any_work_naming_parameter_bytes_and_option(monkeypatch):
    model = _lm(50257)
    X, y = torch.randint(0, 50257, (2, 16)), torch.randint(0, 50257, (2, 16))
    lossfn = nn.CrossEntropyLoss()
    f = curvature(nn.Sequential(model, _Transpose()), lossfn, [KFAC()])
    calls = mock.Mock(side_effect=AssertionError("second-order work started"))
    monkeypatch.setattr(secondorder, "second_order", calls)
    start = time.perf_counter()
    with pytest.raises(CurvatureError, match=r"'0\.1\.weight'.*\[50257, 50257\] of 10103064196 bytes.*"
                                             r"max_factor_dim") as err:
        f(X, y)
    assert time.perf_counter() - start < 5.0  # the dense factor alone: 10 GB, minutes to form
    assert not calls.called
    assert "KFAC(max_factor_dim=...)" in str(err.value)


def test_budget_is_the_stated_one():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    X, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    with override(dense_factor_bytes=6 * 6 * 4 - 1):  # [6, 6] float32 is one byte over
        with pytest.raises(CurvatureError, match=r"'0\.weight'.*\[6, 6\] of 144 bytes.*over the 143 bytes"):
            curvature(model, nn.CrossEntropyLoss(), [KFLR()])(X, y)
        qs = curvature(model, nn.CrossEntropyLoss(), [KFLR(max_factor_dim=5)])(X, y)  # chosen: no refusal
        assert qs["kflr"]["0.weight"][0].shape == (6,)
        qs = curvature(model, nn.CrossEntropyLoss(), [KFLR(max_factor_dim=6)])(X, y)  # dense by choice
        assert qs["kflr"]["0.weight"][0].shape == (6, 6)


class _Transpose(nn.Module):
    def forward(self, z):
        return z.transpose(1, 2)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "4"])
def test_option_values(bad):
    for cls in (KFAC, KFLR, KFACEmpirical):
        with pytest.raises(CurvatureError, match="max_factor_dim"):
            cls(max_factor_dim=bad)


class _Mixed(nn.Module):
    """Every Kronecker layout whose root factor a diagonal side hides from the shapes: an
    Embedding ``[A [V], B]`` (root last), a Linear ``[B, A]`` (root first) and a weight stored
    ``[in, out]`` (``[A, B]``, root last)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.w = nn.Parameter(torch.randn(4, 5) / 2)
        self.head = nn.Linear(5, 6)

    def forward(self, idx):
        h = torch.tanh(nn.functional.linear(self.emb(idx), self.w.t()))
        return self.head(h).mean(1)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("max_dim", [2, 4])
def test_batch_slices_combine_diagonal_sides_by_their_role(reduction, max_dim):
    """``batch_chunk_size`` with ``max_factor_dim``: each slice's root factor (``B``, diagonal or
    not) is rescaled like the loss (``r``; ``r²`` for KFACEmpirical), the input factor averaged
    with the slice's share: the factors equal the whole batch's. Read off the shapes, a
    diagonal ``B`` looks like Embedding's ``A`` and the two are swapped (``"sum"``: ``r = 1``,
    share ``n_k/N``)."""
    gen = seeded(3)
    model = _Mixed().to(DT)
    X, y = torch.randint(0, 7, (7, 3), generator=gen), torch.randint(0, 6, (7,), generator=gen)
    lossfn = nn.CrossEntropyLoss(reduction=reduction)
    exts = lambda: [KFLR(max_factor_dim=max_dim), KFACEmpirical(max_factor_dim=max_dim)]  # noqa: E731
    whole = curvature(model, lossfn, exts())(X, y)
    sliced = curvature(model, lossfn, exts(), batch_chunk_size=3)(X, y)
    for key in ("kflr", "kfac_empirical"):
        for name, factors in whole[key].items():
            assert any(f.dim() == 1 for f in factors) or len(factors) == 1, (key, name)
            for a, b in zip(factors, sliced[key][name]):
                torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=f"{key}[{name}]")


class _Transposed(nn.Module):
    """A weight stored ``[in, out]`` (GPT-2's ``Conv1D``): factors ``[A, B]``, root last."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 5) / 2)
        self.b = nn.Parameter(torch.zeros(5))
        self.out = nn.Linear(5, 4)

    def forward(self, x):
        return self.out(torch.tanh(nn.functional.linear(x, self.w.t(), self.b)))


@pytest.mark.parametrize("max_dim", [None, 4])
def test_transposed_weight_chunked_columns_sum_its_root_factor(max_dim):
    """Column chunks add ``B``, the last factor of ``[A, B]`` (they added ``A`` before)."""
    torch.manual_seed(0)
    model = _Transposed().to(DT)
    X, y = torch.randn(6, 3, dtype=DT), torch.randint(0, 4, (6,))
    whole = curvature(model, nn.CrossEntropyLoss(), [KFLR(max_factor_dim=max_dim)])(X, y)["kflr"]
    chunked = curvature(model, nn.CrossEntropyLoss(), [KFLR(max_factor_dim=max_dim)], chunk_size=1)(X, y)["kflr"]
    for name in whole:
        for a, b in zip(whole[name], chunked[name]):
            torch.testing.assert_close(a, b)
    assert [t.dim() for t in whole["w"]] == ([2, 2] if max_dim is None else [2, 1])
