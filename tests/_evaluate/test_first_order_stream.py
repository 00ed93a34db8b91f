"""First-order quantities read off during the loss's backward.

``curvlib._evaluate.first_order.first_order_streamed`` reads every site as its output gradient
arrives (``curvlib._evaluate.streamed.stream_sites``) and drops it. Checked here in float64 against
the per-sample oracle (``oracles.individual_gradients``) on sequence models with tied
weights and a module used twice (whose individual gradients are summed over their sites
before any square), that the streamed path is the one taken, that it never holds the
sites' gradients all at once, and that it agrees with the all-at-once path bit for bit
where the order of additions is the same.
"""

from __future__ import annotations

import weakref

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from torch import nn

import curvlib
import curvlib._evaluate.linearise as engine
import curvlib._evaluate.first_order as firstorder
import curvlib._transform.call as transform
from curvlib import curvature
from curvlib._core.settings import override
from curvlib._core.strategy import strategy
from curvlib.extensions import (BatchDiagGGNMC, BatchGrad, BatchL2Grad, DiagGGNExact, DiagGGNMC, KFAC,
                                SumGradSquared, Variance)
from curvlib.rules import linear

from oracles.checks import FIRST_ORDER_EXTENSIONS, check_first_order
from oracles.first_order import assert_close_dicts, first_order_reference
from oracles.on_device import ON_CPU

DT = torch.float64


class TiedLM(nn.Module):
    """Tokens ``[N, T]`` -> logits ``[N, V, T]``: embedding tied with the head, learned
    positions, one ``nn.Linear`` used twice, pre-LN residual blocks."""

    def __init__(self, vocab: int = 7, d: int = 6, length: int = 5, blocks: int = 2, tied: bool = True):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(length, d) * 0.1)
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(blocks))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d))
                                  for _ in range(blocks))
        self.shared = nn.Linear(d, d)
        self.tied = tied
        self.head = None if tied else nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        h = self.emb(x) + self.pos[: x.shape[1]]
        for norm, mlp in zip(self.norms, self.mlps):
            h = h + mlp(norm(h))
            h = h + torch.tanh(self.shared(h))  # the same weights in every block
        logits = nn.functional.linear(h, self.emb.weight) if self.tied else self.head(h)
        return logits.transpose(1, 2)


def _lm(seed: int, n: int, tied: bool = True, length: int = 5):
    torch.manual_seed(seed)
    model = TiedLM(tied=tied, length=length).to(DT)
    X = torch.randint(0, 7, (n, length))
    y = torch.randint(0, 7, (n, length))
    return model, nn.CrossEntropyLoss(), X, y


@pytest.fixture(autouse=True, scope="module")
def _stream_small_models():
    """These models are tiny: stream them anyway (by default only sites of at least
    ``Settings.stream_min_bytes`` together are streamed)."""
    with override(stream_min_bytes=0):
        yield


@pytest.fixture
def spy(monkeypatch):
    """Records every streamed backward and, at each site read, how many of the earlier
    sites' gradients are still alive."""
    calls = {"streams": 0, "alive": []}
    stream, read = engine.stream_sites, firstorder.FirstOrderReader.read
    refs = []

    def counting_stream(*args, **kwargs):
        calls["streams"] += 1
        return stream(*args, **kwargs)

    def counting_read(self, site, g, streamed=False):
        calls["alive"].append(sum(r() is not None for r in refs))
        refs.append(weakref.ref(g))
        return read(self, site, g, streamed)

    monkeypatch.setattr(engine, "stream_sites", counting_stream)
    monkeypatch.setattr(firstorder.FirstOrderReader, "read", counting_read)
    return calls


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 4), tied=st.booleans())
def test_sequence_model_with_tied_and_shared_weights(seed, n, tied):
    """Oracle: per-sample copies of every parameter; the tied embedding/head and the
    shared Linear sum their sites' individual gradients before squaring."""
    check_first_order(*_lm(seed, n, tied))


def test_the_streamed_path_is_taken_and_frees_each_gradient(spy):
    model, lossfn, X, y = _lm(0, 3, tied=False, length=4)
    check_first_order(model, lossfn, X, y)
    assert spy["streams"] == 1
    sites = len(spy["alive"])
    assert sites >= 10
    # all at once, the last read would see every earlier gradient alive; streamed, only
    # the few the backward itself still holds (a residual stream's gradient, the probes')
    assert max(spy["alive"]) <= 3, spy["alive"]


def test_small_sites_are_read_all_at_once(spy):
    """Below ``Settings.stream_min_bytes`` of site outputs the hooks would cost more than the memory
    they save: one backward returns every site's gradient at its end; same results."""
    with override(stream_min_bytes=2**40):
        check_first_order(*_lm(0, 3, tied=True, length=4))
    assert spy["streams"] == 0


def test_streamed_equals_all_at_once():
    model, lossfn, X, y = _lm(3, 4, tied=False)
    exts = [e() for e in FIRST_ORDER_EXTENSIONS]
    streamed = curvature(model, lossfn, exts)(X, y)
    with override(stream_first_order=False):
        at_once = curvature(model, lossfn, exts)(X, y)
        assert list(streamed) == list(at_once)
        torch.testing.assert_close(streamed["loss"], at_once["loss"], rtol=0, atol=0)
        # bit for bit on the CPU; CUDA's embedding backward adds rows in no fixed order
        tol = 0 if ON_CPU else 1e-13
        for q in ["grad"] + [e.name for e in exts]:
            assert_close_dicts(streamed[q], at_once[q], q, rtol=tol, atol=tol)


def test_with_mc_second_order_first(spy):
    """DiagGGNMC is computed before the loss's backward (which then frees the graph): the
    same draws as the all-at-once order give the same diagonal."""
    model, lossfn, X, y = _lm(5, 3, tied=True)
    exts = [BatchL2Grad(), Variance(), DiagGGNMC(mc_samples=2)]
    torch.manual_seed(1)  # (the draws come from the global random state)
    with strategy("looped"):  # (CUDA's default is the batched strategy: one pass for the columns)
        streamed = curvature(model, lossfn, exts)(X, y)
    assert spy["streams"] == 2 + 1  # each MC column (looped strategy), then the loss's backward
    with override(stream_first_order=False):
        torch.manual_seed(1)
        at_once = curvature(model, lossfn, exts)(X, y)
        for q in ("grad", "batch_l2", "variance", "diag_ggn_mc"):
            assert_close_dicts(streamed[q], at_once[q], q, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("tied", [True, False])
def test_one_mc_column_read_during_its_pullback(spy, tied):
    """One MC column (the default) is pulled back reading each parameter as soon as all its
    sites are passed (``_secondorder._read_streamed``; the tied embedding waits for the head):
    the same diagonals, per-sample diagonals and Kronecker factors as all sites at once."""
    model, lossfn, X, y = _lm(7, 3, tied=tied)
    exts = [BatchL2Grad(), DiagGGNMC(), BatchDiagGGNMC(), KFAC()]
    torch.manual_seed(2)
    streamed = curvature(model, lossfn, exts)(X, y)
    assert spy["streams"] == 4  # each MC extension's column (its own draw), then the loss's backward
    with override(stream_first_order=False, stream_columns=False):
        torch.manual_seed(2)
        at_once = curvature(model, lossfn, exts)(X, y)
        for q in ("grad", "batch_l2", "diag_ggn_mc", "diag_ggn_mc_batch"):
            assert_close_dicts(streamed[q], at_once[q], q, rtol=1e-12, atol=1e-14)
        for name, factors in at_once["kfac"].items():
            for a, b in zip(streamed["kfac"][name], factors):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_one_exact_column_against_the_oracle():
    """A scalar output has a one-column exact root: its streamed GGN diagonal is the exact one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1)).to(DT)
    X, y = torch.randn(6, 4, dtype=DT), torch.randn(6, 1, dtype=DT)
    qs = curvature(model, nn.MSELoss(), [DiagGGNExact()])(X, y)
    params = dict(model.named_parameters())
    for name, p in params.items():  # MSE "mean" over 6 entries: GGN = (2/6) Σ_n J_nᵀ J_n
        jac = torch.func.vmap(torch.func.jacrev(
            lambda v, x: torch.func.functional_call(model, {**params, name: v}, (x[None],))[0, 0]), (None, 0))(p, X)
        torch.testing.assert_close(qs["diag_ggn_exact"][name], (2 / 6) * (jac**2).sum(0))


def test_float_inputs_and_inplace_graphs():
    """A float input makes the first layer's output a non-leaf lowest target (its hook hands
    on zeros); ``ReLU(inplace=True)`` makes every target a zero probe (all lowest)."""
    torch.manual_seed(0)
    for act in (nn.Tanh(), nn.ReLU(inplace=True)):
        model = nn.Sequential(nn.Linear(5, 4), act, nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT)
        X, y = torch.randn(6, 5, dtype=DT), torch.randint(0, 3, (6,))
        check_first_order(model, nn.CrossEntropyLoss(), X, y)


def test_site_the_loss_does_not_reach():
    """A site whose output is multiplied by zero still reaches the loss; one whose output
    the loss never sees is read with zeros (as the all-at-once path's ``allow_unused``)."""

    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 2), nn.Linear(3, 2)

        def forward(self, x):
            self.a(x)  # (no use of the output: no contribution)
            return self.b(x)

    torch.manual_seed(0)
    model = Unused().to(DT)
    X, y = torch.randn(4, 3, dtype=DT), torch.randn(4, 2, dtype=DT)
    qs = curvature(model, nn.MSELoss(), [BatchGrad(), BatchL2Grad(), SumGradSquared()])(X, y)
    ref = first_order_reference(model, nn.MSELoss(), X, y)
    for q in ("grad", "grad_batch", "batch_l2", "sum_grad_squared"):
        assert_close_dicts(qs[q], ref[q], q)


@pytest.mark.parametrize("length, features", [(3, 4), (6, 2)])
def test_linear_ghost_norm(monkeypatch, length, features):
    """``‖Σ_s g_s x_sᵀ‖² = Σ_{s,t} (g_s·g_t)(x_s·x_t)`` where ``T² <= O·I`` (3² <= 16: the
    individual gradients ``[N, O, I]`` are never formed, which the patched outer product
    would refuse) and the formed gradients otherwise (6² > 4)."""
    ghost = length * length <= features * features
    if ghost:
        def refuse(*args):
            raise AssertionError("the ghost norm formed [N, O, I]")

        monkeypatch.setattr(linear, "_per_sample_outer", refuse)
    torch.manual_seed(length)
    model = nn.Sequential(nn.Linear(features, features), nn.Tanh(), nn.Linear(features, features)).to(DT)
    X, y = torch.randn(3, length, features, dtype=DT), torch.randn(3, length, features, dtype=DT)
    qs = curvature(model, nn.MSELoss(), [BatchL2Grad()])(X, y)
    ref = first_order_reference(model, nn.MSELoss(), X, y)
    assert_close_dicts(qs["batch_l2"], ref["batch_l2"], "batch_l2")


def test_several_mc_columns_read_one_at_a_time(spy):
    """``mc_samples > 1`` under the looped strategy (CPU): each column is pulled back on its
    own, its sites read as they are passed (never all columns' site gradients at once), with
    the same results as all columns pulled back together; under the batched strategy (CUDA)
    the columns keep their one fused pullback."""
    model, lossfn, X, y = _lm(9, 3, tied=True)
    exts = [DiagGGNMC(mc_samples=3), BatchDiagGGNMC(mc_samples=2), KFAC(mc_samples=2)]
    with curvlib.strategy("looped"):
        torch.manual_seed(4)
        streamed = curvature(model, lossfn, exts)(X, y)
    assert spy["streams"] == 3 + 2 + 2 + 1  # one per column, then the loss's backward
    with curvlib.strategy("batched"):
        torch.manual_seed(4)
        fused = curvature(model, lossfn, exts)(X, y)
    assert spy["streams"] == 8 + 1  # the columns pulled back together (no stream), then the loss's backward
    with override(stream_first_order=False, stream_columns=False):
        torch.manual_seed(4)
        at_once = curvature(model, lossfn, exts)(X, y)
        for result in (streamed, fused):
            for q in ("grad", "diag_ggn_mc", "diag_ggn_mc_batch"):
                assert_close_dicts(result[q], at_once[q], q, rtol=1e-12, atol=1e-14)
            for name, factors in at_once["kfac"].items():
                for a, b in zip(result["kfac"][name], factors):
                    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_site_outputs_only_the_graph_needs_are_not_kept(monkeypatch):
    """After the forward, a site output that no backward node saves (a Linear feeding a residual
    addition, above another site) is held by nobody: the pullbacks keep the sites' layouts, not
    the recorder, whose targets would keep every site output alive."""
    import gc

    from curvlib._core.site import Recorder

    outputs, alive = [], []
    add, forward = Recorder.add, transform.forward_with_probes

    def spy_add(self, site, out):
        outputs.append(weakref.ref(out))
        return add(self, site, out)

    def spy_forward(*args, **kwargs):
        lin = forward(*args, **kwargs)
        gc.collect()
        alive.append([r() is not None for r in outputs])
        return lin

    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.inner, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)

        def forward(self, x):
            h = self.first(x)
            return self.head(torch.tanh(h + self.inner(h)))

    torch.manual_seed(0)
    model = Residual().to(DT)
    X, y = torch.randn(4, 6, dtype=DT), torch.randint(0, 3, (4,))
    f = curvature(model, nn.CrossEntropyLoss(), [BatchL2Grad()])
    f(X, y)  # planned: the spies see the linearising forward alone
    monkeypatch.setattr(Recorder, "add", spy_add)
    monkeypatch.setattr(transform, "forward_with_probes", spy_forward)
    f(X, y)
    assert len(outputs) == 3 and alive == [[True, False, True]]  # `inner`'s output: only a gradient edge
