"""Forced strategies (curvlib.strategy / CURVLIB_STRATEGY): both give the oracle's numbers.

``"batched"`` is the CUDA default (columns of a chunk pulled back under
``torch.func.vmap``, conv column blocks of hundreds of MiB), ``"looped"`` the CPU
default; forcing each on the CPU checks the math of both paths. Oracles: the
float64 per-sample Jacobians/Hessians of ``oracles.reference.reference``.
"""

from __future__ import annotations

import collections
import threading

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import curvlib
from curvlib import CurvatureError, curvature, extensions
from curvlib._core import strategy as _strategy
from curvlib._core.settings import current, override
from oracles.cases import conv_configs
from oracles.on_device import seeded
from oracles.reference import assert_matches, exact_extensions, kflr_map, reference

STRATEGIES = ["batched", "looped"]
CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
CONV_T = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same'")


def _check_exact(model: nn.Module, X, y, strategy: str, hessian: bool = True, kflr: bool = True, what: str = ""):
    """Every exact extension (and KFLR) under ``strategy`` against the float64 oracle."""
    lossfn = nn.CrossEntropyLoss()
    with curvlib.strategy(strategy):
        qs = curvature(model, lossfn, exact_extensions(hessian=hessian, kflr=kflr))(X, y)
    ref = reference(model, lossfn, X, y, hessian=hessian, kflr=kflr_map(model) if kflr else None)
    assert_matches(qs, ref, f"{strategy} {what}")


def _head(body: nn.Module, X) -> nn.Sequential:
    with torch.no_grad():
        features = body(X)[0].numel()
    return nn.Sequential(body, nn.Tanh(), nn.Flatten(), nn.Linear(features, 3)).double()


# ----------------------------------------------------------------------------- the switch


def test_strategy_resolution(monkeypatch):
    monkeypatch.delenv(_strategy.ENV, raising=False)
    assert _strategy.resolve("cpu") == "looped" and _strategy.resolve("cuda") == "batched"
    monkeypatch.setenv(_strategy.ENV, "batched")  # read at call time
    assert _strategy.resolve("cpu") == "batched"
    with curvlib.strategy("looped"):  # the context wins over the environment
        assert _strategy.resolve("cuda") == "looped"
        with curvlib.strategy("auto"):
            assert _strategy.resolve("cpu") == "looped" and _strategy.resolve("cuda") == "batched"
        assert _strategy.resolve("cuda") == "looped"
    assert _strategy.resolve("cpu") == "batched"
    seen = []
    with curvlib.strategy("looped"):  # a context per thread: a new thread sees the environment
        t = threading.Thread(target=lambda: seen.append(_strategy.resolve("cpu")))
        t.start()
        t.join()
    assert seen == ["batched"]


def test_unknown_strategy_is_refused(monkeypatch):
    with pytest.raises(CurvatureError, match=r"curvlib.strategy: strategy 'fast' is not known; supported are"):
        with curvlib.strategy("fast"):
            pass
    monkeypatch.setenv(_strategy.ENV, "gpu")
    f = curvature(nn.Linear(2, 2).double(), nn.MSELoss(), [extensions.DiagGGNExact()])
    with pytest.raises(CurvatureError, match="CURVLIB_STRATEGY: strategy 'gpu' is not known"):
        f(torch.zeros(1, 2, dtype=torch.float64), torch.zeros(1, 2, dtype=torch.float64))


def test_batched_conv_blocks_take_the_large_budget(monkeypatch):
    monkeypatch.delenv(_strategy.ENV, raising=False)
    assert _strategy.column_block_bytes("cpu", 123) == 123
    with curvlib.strategy("batched"):
        assert _strategy.column_block_bytes("cpu", 123) == current().batched_min_bytes
        monkeypatch.setattr("curvlib._core.tensors.available_bytes", lambda device: 2**40)
        assert _strategy.column_block_bytes("cuda", 123) == 2**40 // 8


# ----------------------------------------------------------------------------- convolutions


@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(max_examples=6, deadline=None)
@given(config=conv_configs(), n=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_conv_under_strategy(strategy, config, n, seed):
    d, kwargs, spatial = config
    torch.manual_seed(seed)
    X = torch.randn((n, kwargs["in_channels"], *spatial), generator=seeded(seed), dtype=torch.float64)
    model = _head(CONV[d](**kwargs).double(), X)
    y = torch.randint(0, 3, (n,), generator=seeded(seed + 1))
    _check_exact(model, X, y, strategy, kflr=kwargs["groups"] == 1, what=f"conv{d}d {kwargs}")


TRANSPOSED = [
    (1, dict(in_channels=2, out_channels=3, kernel_size=3, stride=2, padding=1, output_padding=1), (4,)),
    (2, dict(in_channels=2, out_channels=4, kernel_size=(2, 3), stride=(1, 2), groups=2, dilation=(2, 1)), (3, 3)),
    (3, dict(in_channels=2, out_channels=2, kernel_size=2, stride=1, padding=(0, 1, 0)), (2, 3, 2)),
]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", range(len(TRANSPOSED)))
def test_conv_transpose_under_strategy(strategy, case):
    d, kwargs, spatial = TRANSPOSED[case]
    torch.manual_seed(case)
    X = torch.randn((2,) + (kwargs["in_channels"],) + spatial, dtype=torch.float64)
    model = _head(CONV_T[d](**kwargs).double(), X)
    _check_exact(model, X, torch.tensor([2, 0]), strategy, kflr=kwargs.get("groups", 1) == 1, what=f"{kwargs}")


# ----------------------------------------------------------------------------- pooling


class First(nn.Module):
    """``x[0]`` of a pooling with ``return_indices=True``."""

    def forward(self, pair):
        return pair[0]


def _pool(kind: str, d: int, kwargs: dict) -> nn.Module:
    if kind == "max":
        return getattr(nn, f"MaxPool{d}d")(**kwargs)
    if kind == "avg":
        return getattr(nn, f"AvgPool{d}d")(**kwargs)
    return getattr(nn, f"Adaptive{kind.split('_')[1].capitalize()}Pool{d}d")(**kwargs)


POOLS = [
    ("max", dict(kernel_size=2)),
    ("max", dict(kernel_size=3, stride=2, padding=1, ceil_mode=True)),
    ("max", dict(kernel_size=2, stride=1, dilation=2)),
    ("max", dict(kernel_size=2, return_indices=True)),
    ("avg", dict(kernel_size=2)),
    ("avg", dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)),
    ("adaptive_max", dict(output_size=2)),
    ("adaptive_avg", dict(output_size=1)),
]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("case", range(len(POOLS)), ids=[f"{k}-{i}" for i, (k, _) in enumerate(POOLS)])
def test_pooling_under_strategy(strategy, d, case):
    kind, kwargs = POOLS[case]
    torch.manual_seed(10 * d + case)
    size = (5, 6, 4)[:d] if d < 3 else (4, 5, 4)
    X = torch.randn((2, 2) + size, dtype=torch.float64)
    layers = [CONV[d](2, 3, 2, padding=1), nn.Tanh(), _pool(kind, d, kwargs)]
    if kwargs.get("return_indices"):
        layers.append(First())
    model = _head(nn.Sequential(*layers).double(), X)
    _check_exact(model, X, torch.tensor([1, 2]), strategy, what=f"{kind}pool{d}d {kwargs}")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_max_pool_ties_follow_autograd(strategy):
    """Ties (equal values in a window; overlapping windows): the same winner as PyTorch's
    own max-pool backward, which the oracle differentiates (curvlib uses PyTorch's
    max-pool kernel and its backward under both strategies, so the indices are its)."""
    X = torch.randint(0, 2, (3, 2, 6, 6), generator=seeded(3)).double()
    model = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1), nn.Conv2d(2, 2, 2), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8, 3)).double()
    _check_exact(model, X, torch.tensor([0, 1, 2]), strategy, what="ties")


# ----------------------------------------------------------------------------- a 3c3d-like model


def small_3c3d() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1),
        nn.Conv2d(4, 5, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1),
        nn.Flatten(), nn.Linear(20, 6), nn.ReLU(), nn.Linear(6, 4),
    ).double()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_3c3d_like_exact_extensions(strategy):
    torch.manual_seed(0)
    model, X = small_3c3d(), torch.randn(3, 3, 8, 8, dtype=torch.float64)
    _check_exact(model, X, torch.tensor([0, 3, 1]), strategy, what="3c3d-like")


MC = ["DiagGGNMC", "BatchDiagGGNMC", "SqrtGGNMC", "KFAC", "KFRA"]


@pytest.mark.parametrize("name", MC)
def test_3c3d_like_mc_and_kfra_agree_across_strategies(name):
    """The Monte-Carlo extensions draw the same samples under both strategies (same
    generator), so their results agree to rounding; KFRA (exact recursion) likewise."""
    torch.manual_seed(1)
    model, X, y = small_3c3d(), torch.randn(3, 3, 8, 8, dtype=torch.float64), torch.tensor([2, 0, 1])
    if name == "KFRA":  # KFRA: Linear/activation chains only
        model, X = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4)).double(), torch.randn(3, 5, dtype=torch.float64)
    results = {}
    for strategy in STRATEGIES:
        with curvlib.strategy(strategy):
            ext = getattr(extensions, name)(**({} if name == "KFRA" else {"generator": seeded(7)}))
            results[strategy] = curvature(model, nn.CrossEntropyLoss(), [ext])(X, y)[ext.name]
    a, b = results["batched"], results["looped"]
    for key in a:
        for x, z in zip(a[key] if isinstance(a[key], list) else [a[key]], b[key] if isinstance(b[key], list) else [b[key]]):
            assert torch.allclose(x, z, rtol=1e-10, atol=1e-12), f"{name}[{key}]"


# ----------------------------------------------------------------------------- kernels per call


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func).split(".")[1]] += 1
        return func(*args, **(kwargs or {}))


def _backward_kernels(classes: int, strategy: str) -> int:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8, classes))
    X, y = torch.randn(4, 3, 12, 12), torch.randint(0, classes, (4,), generator=seeded(0))
    f = curvature(model, nn.CrossEntropyLoss(), [extensions.DiagGGNExact(), extensions.KFLR()], chunk_size=None)
    with curvlib.strategy(strategy):
        f(X, y)
        counter = _Counter()
        with counter:
            f(X, y)
    return sum(v for k, v in counter.calls.items()
               if k == "convolution_backward" or (k.startswith("max_pool") and k.endswith("backward")))


def test_batched_kernels_per_call_do_not_grow_with_columns():
    """Under "batched" each conv/max-pool site runs its backward kernels a fixed number
    of times per chunk, whatever the number of columns; "looped" runs them per column
    (which is what makes this test able to fail). The per-sample method is fixed to the
    batch-as-groups kernel (``convolution_backward``): by shape, the folded columns
    could switch a site between it and ``bmm``, one kernel either way."""
    with override(conv_method="conv"):
        assert _backward_kernels(3, "batched") == _backward_kernels(9, "batched")
        assert _backward_kernels(9, "looped") > _backward_kernels(3, "looped")


# ----------------------------------------------------------------------------- batch norm (eval)


def _eval_bn(bn: nn.Module, seed: int) -> nn.Module:
    gen = seeded(seed)
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(bn.num_features, generator=gen, dtype=torch.float64))
        bn.running_var.copy_(torch.rand(bn.num_features, generator=gen, dtype=torch.float64) + 0.5)
        bn.weight.copy_(torch.randn(bn.num_features, generator=gen, dtype=torch.float64))
        bn.bias.copy_(torch.randn(bn.num_features, generator=gen, dtype=torch.float64))
    return bn


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("d", [0, 1, 2, 3])
def test_batchnorm_columns_under_strategy(strategy, d):
    """Eval-mode BatchNorm's all-columns read-off (``Σ_v`` in one product with ``x̂``)
    for every exact extension; ``d = 0``: BatchNorm1d on ``[N, C]``."""
    torch.manual_seed(d)
    if d == 0:
        X = torch.randn(3, 4, dtype=torch.float64)
        body = nn.Sequential(nn.Linear(4, 3), _eval_bn(nn.BatchNorm1d(3).double(), d), nn.Tanh())
    else:
        X = torch.randn((3, 2) + (4, 3, 3)[:d], dtype=torch.float64)
        bn = getattr(nn, f"BatchNorm{d}d")(3).double()
        body = nn.Sequential(CONV[d](2, 3, 2, padding=1), _eval_bn(bn, d), nn.Tanh())
    model = _head(body.double().eval(), X).eval()
    _check_exact(model, X, torch.tensor([0, 2, 1]), strategy, kflr=False, what=f"bn{d}d")
