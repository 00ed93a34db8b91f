"""Concurrent calls of the same ``f`` from several threads.

Forward-mode AD (the Hessian diagonals' second derivatives, the dense residuals'
Hessians, GGNMP and PCHMP), ``functional_call``'s slot swaps (the generic rule),
the eager runner's redirects (untraced models) and the random state the products
replay are process-wide in torch; curvlib serialises them (``curvlib._core.sync.LOCK``).
Here 4 threads start together (a barrier) and each calls ``f`` many times; every
result must equal the single-threaded one, and the model must be unchanged.

Without the lock these tests fail (checked by replacing ``LOCK`` with a no-op in
every module that uses it: ``RuntimeError: ... no level exists``, wrong Hessian
diagonals and products, and "Layer 'a' has an instance attribute 'forward'"
refusals for the untraced model).
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from torch import nn

from curvlib import curvature
from curvlib.extensions import (
    GGNMP, HMP, PCHMP, BatchDiagHessian, BatchGrad, BatchL2Grad, DiagGGNExact, DiagHessian, SqrtGGNExact,
)

from oracles.checks import _assert_same_state, state_snapshot
from oracles.on_device import seeded

DT = torch.float64
THREADS, CALLS = 4, 12


class Scale(nn.Module):
    """A parametrized module without a hand-written rule (the generic rule: functional_call)."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        return torch.tanh(x * self.scale)


class Untraced(nn.Module):
    """Data-dependent control flow: run eagerly with its layers redirected."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.drop = nn.Linear(3, 6), nn.Linear(6, 2), nn.Dropout(0.3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if h.sum() > -1e9:
            h = self.drop(h)
        return self.b(h)


def _evaluate(qs: dict, V: dict) -> dict:
    """Every tensor of a result, products applied to fixed ``V`` (flattened to one dict)."""
    out = {"loss": qs["loss"]}
    for key, value in qs.items():
        if isinstance(value, dict):
            for name, v in value.items():
                out[f"{key}[{name}]"] = v(V[name]) if callable(v) else v
    return out


def _hammer(call, expected: dict, calls: int = CALLS) -> None:
    """``THREADS`` threads × ``calls`` calls of ``call(i)``, each compared with ``expected[i]``."""
    barrier = threading.Barrier(THREADS)
    failures, done = [], []

    def worker(t):
        try:
            barrier.wait()
            for k in range(calls):
                i = (t + k) % len(expected)
                got = call(i)
                for key, want in expected[i].items():
                    if not torch.allclose(got[key], want, rtol=1e-12, atol=1e-14):
                        failures.append(f"thread {t} call {k}: {key} differs")
                done.append(1)
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(f"thread {t}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, f"{len(failures)} failures, e.g. {failures[:3]}"
    assert len(done) == THREADS * calls


def _vectors(model, seed=0):
    g = seeded(seed)
    return {n: torch.randn((2,) + tuple(p.shape), generator=g, dtype=DT) for n, p in model.named_parameters()}


def test_hessian_family_and_products_in_threads():
    """Smooth activations (element-wise residuals) and a generic layer: DiagHessian,
    BatchDiagHessian, GGNMP, PCHMP, HMP and the GGN family."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), Scale(5), nn.Linear(5, 4), nn.GELU(), nn.Linear(4, 3)).to(DT)
    g = seeded(1)
    data = [(torch.randn(4, 3, generator=g, dtype=DT), torch.randint(0, 3, (4,), generator=g)) for _ in range(3)]
    exts = [DiagHessian(), BatchDiagHessian(), GGNMP(), PCHMP(), HMP(), DiagGGNExact(), SqrtGGNExact(), BatchGrad()]
    f = curvature(model, nn.CrossEntropyLoss(), exts)
    V = _vectors(model)
    before = state_snapshot(model)
    expected = [_evaluate(f(X, y), V) for X, y in data]
    _hammer(lambda i: _evaluate(f(*data[i]), V), expected, calls=6)
    _assert_same_state(before, state_snapshot(model))


def test_dense_residual_in_threads():
    """LayerNorm's dense per-sample residual (torch.func.hessian: forward over reverse)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3, elementwise_affine=False), nn.Linear(3, 2)).to(DT)
    g = seeded(1)
    data = [(torch.randn(4, 3, generator=g, dtype=DT), torch.randn(4, 2, generator=g, dtype=DT)) for _ in range(2)]
    f = curvature(model, nn.MSELoss(), [DiagHessian()])
    expected = [_evaluate(f(X, y), {}) for X, y in data]
    _hammer(lambda i: _evaluate(f(*data[i]), {}), expected, calls=3)


def test_products_created_in_one_thread_evaluated_in_others():
    """The callables of one call, evaluated concurrently (each re-runs the forward)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Sigmoid(), nn.Linear(5, 2)).to(DT)
    X, y = torch.randn(6, 3, dtype=DT), torch.randn(6, 2, dtype=DT)
    qs = curvature(model, nn.MSELoss(), [GGNMP(), PCHMP(modify="abs"), HMP()])(X, y)
    Vs = [_vectors(model, s) for s in range(3)]
    expected = [{f"{k}[{n}]": qs[k][n](V[n]) for k in ("ggnmp", "pchmp", "hmp") for n in V} for V in Vs]
    _hammer(lambda i: {f"{k}[{n}]": qs[k][n](Vs[i][n]) for k in ("ggnmp", "pchmp", "hmp") for n in Vs[i]}, expected)


def test_dropout_with_generators_in_threads():
    """Each call's masks come from its own generator: a thread's call equals the
    single-threaded call with the same generator seed (products included)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.Dropout(0.4), nn.Tanh(), nn.Linear(6, 2)).to(DT)
    X, y = torch.randn(5, 3, dtype=DT), torch.randint(0, 2, (5,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f = curvature(model, nn.CrossEntropyLoss(), [BatchGrad(), DiagHessian(), GGNMP(), PCHMP()])
        V = _vectors(model)

        def call(i):
            return _evaluate(f(X, y, generator=seeded(100 + i)), V)

        expected = [call(i) for i in range(4)]
        assert not torch.equal(expected[0]["grad[0.weight]"], expected[1]["grad[0.weight]"])
        _hammer(call, expected)


def test_untraced_model_in_threads():
    """An untraced model (eager runner: layer redirects, a global pre-hook), with dropout."""
    torch.manual_seed(0)
    model = Untraced().to(DT)
    X, y = torch.randn(5, 3, dtype=DT), torch.randn(5, 2, dtype=DT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f = curvature(model, nn.MSELoss(), [BatchGrad(), BatchL2Grad()])
        before = state_snapshot(model)

        def call(i):
            return _evaluate(f(X, y, generator=seeded(i)), {})

        expected = [call(i) for i in range(3)]
        _hammer(call, expected)
    _assert_same_state(before, state_snapshot(model))
    assert "forward" not in vars(model.a) and "forward" not in vars(model.b)


@pytest.mark.slow
def test_many_models_many_threads():
    """Different curvature objects on different models at once (8 threads)."""
    global THREADS
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(3, 4), act(), nn.Linear(4, 2)).to(DT) for act in (nn.Tanh, nn.ELU, nn.Softplus)]
    X, y = torch.randn(4, 3, dtype=DT), torch.randn(4, 2, dtype=DT)
    fs = [curvature(m, nn.MSELoss(), [DiagHessian(), GGNMP(), PCHMP()]) for m in models]
    Vs = [_vectors(m) for m in models]
    expected = [_evaluate(f(X, y), V) for f, V in zip(fs, Vs)]
    THREADS, old = 8, THREADS
    try:
        _hammer(lambda i: _evaluate(fs[i](X, y), Vs[i]), expected)
    finally:
        THREADS = old
