"""Smoke tests of the benchmark's sequence problems: they build, a backward runs,
and the peers' per-sample gradients agree with curvlib's ``BatchGrad`` on a few samples
(the Opacus copies' gradients mapped back by ``opacus_to_original``)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import problems as P  # noqa: E402
import run as R  # noqa: E402
from oracles.on_device import DEVICE  # noqa: E402


def _build(name: str) -> P.Problem:
    """The benchmark problem on the test device; built on CPU as ``benchmarks/run.py`` does (its CPU
    generators draw the same data for every device), then placed."""
    with torch.device("cpu"):
        return P.PROBLEMS[name](device=str(DEVICE))


def _few(problem: P.Problem, n: int) -> P.Problem:
    return P.Problem(problem.model, problem.lossfn, problem.X[:n], problem.y[:n])


@pytest.mark.parametrize("name, out_shape", [("gpt", (32, 256, 64)), ("gpt-v16", (32, 16, 64)), ("lstm", (64, 10))])
def test_problem_builds_and_backward_runs(name, out_shape):
    problem = _build(name)
    with torch.no_grad():
        assert tuple(problem.model(problem.X).shape) == out_shape
    P.METHODS["backward"](_few(problem, 2))()
    assert all(p.grad is not None for p in problem.model.parameters())


@pytest.mark.parametrize("name, peer", [
    pytest.param("gpt", "vmap(grad)", marks=pytest.mark.slow),  # ~9 s: torch's MHA fallback under vmap
    ("gpt", "opacus"), ("lstm", "vmap(grad)"), ("lstm", "opacus"),
])
def test_peer_per_sample_gradients_match_batchgrad(name, peer):
    pytest.importorskip("opacus")
    problem = _few(_build(name), 3)
    ref = P.METHODS["BatchGrad"](problem)()
    out = P.METHODS[peer](problem)()
    info = P.INFO[peer]
    out = info.post(problem, out) if info.post else out
    assert list(out) == list(ref)  # same names, same order
    assert R.compare(out, ref) == "ok"


def test_exact_ggn_family_skipped_beyond_max_columns():
    gpt = _build("gpt")
    why = R.too_many_columns(gpt, "DiagGGNExact", 1024)
    assert why is not None and "C = 16384" in why and "[256, 64]" in why
    assert R.too_many_columns(gpt, "BatchGrad", 1024) is None
    assert R.too_many_columns(gpt, "backpack:KFLR", 1024) is not None
    assert R.too_many_columns(gpt, "DiagGGNExact[chunk_size=10]", 1024) is not None
    assert R.too_many_columns(_build("gpt-v16"), "KFLR", 1024) is None


def test_first_call_time_limit_interrupts_a_hopeless_method():
    import time

    with pytest.raises(R.FirstCallTimeout):
        with R._time_limit(0.2):
            for _ in range(100):
                time.sleep(0.05)
    with R._time_limit(5.0):  # a call within the limit is untouched, and the timer is cleared
        pass
    time.sleep(0.01)


def test_aten_ops_counts_operator_calls():
    """The op count is exact on a known sequence, counts the backward's operators too, and
    reports (does not raise) a method that fails under the dispatch mode."""
    x = torch.randn(3, 4)
    assert R.aten_ops(lambda: (x + 1).mul(2).sum()) == 3
    w = torch.randn(4, 2, requires_grad=True)
    forward_only = R.aten_ops(lambda: (x @ w).tanh().sum())
    assert R.aten_ops(lambda: (x @ w).tanh().sum().backward()) > forward_only

    def broken():
        raise RuntimeError("no")

    assert R.aten_ops(broken).startswith("n/a")
    assert R.op_counts(lambda: float((x + 1).sum()) + bool(x.max() > 0)) == (6, 2)  # add sum max gt + two reads


def test_run_reports_aten_ops(tmp_path):
    """``run.py`` writes an ``aten ops`` column per method (``--no-count-ops`` leaves it empty)."""
    out = tmp_path / "res"
    code = R.main(["--problems", "mlp", "--methods", "backward", "BatchGrad", "--rounds", "1", "--min-rounds", "1",
                   "--no-memory", "--no-plot", "--sweep-classes", "--out", str(out)])
    assert code == 0
    md = (out / "results-cpu.md").read_text()
    assert "aten ops" in md
    rows = [line for line in md.splitlines() if line.startswith("| mlp | BatchGrad |")]
    assert rows and int(rows[-1].split("|")[8]) > int(
        [line for line in md.splitlines() if line.startswith("| mlp | backward |")][-1].split("|")[8])
    assert "host syncs" in md and int(rows[-1].split("|")[9]) == 1  # the class-index range check


def test_gpu_sizes_on_request_only():
    """The GPU sizes build with their batch and width, and stay out of the CPU default."""
    assert not set(P.GPU_PROBLEMS) & set(P.DEFAULT_PROBLEMS)
    sizes = {"mlp-1024": (1024, 784), "3c3d-256": (256, 3, 32, 32), "resnet-128": (128, 3, 32, 32),
             "allcnnc-96": (128, 3, 32, 32)}
    for name, shape in sizes.items():
        model, _, X, y = P.PROBLEMS[name](device=str(DEVICE))
        assert tuple(X.shape) == shape and y.shape[0] == shape[0]
    wide = P.PROBLEMS["allcnnc-96"](device=str(DEVICE)).model
    assert max(m.out_channels for m in wide.modules() if isinstance(m, torch.nn.Conv2d)) == 192


@pytest.mark.parametrize("name, package, out_shape", [
    ("gpt2-hf", "transformers", (32, 256, 64)), ("gpt2-hf-v16", "transformers", (32, 16, 64)),
    ("vit-timm", "timm", (32, 10)), ("vit-timm-fwd", "timm", (32, 10)),
])
def test_zoo_problems_build_on_request(name, package, out_shape):
    """The Hugging Face / timm problems build from configs (nothing downloaded), a backward
    runs, and they stay out of the CPU default (optional packages)."""
    pytest.importorskip(package)
    assert name in P.ZOO_PROBLEMS and name not in P.DEFAULT_PROBLEMS
    problem = _build(name)
    with torch.no_grad():
        assert tuple(problem.model(problem.X).shape) == out_shape
    P.METHODS["backward"](_few(problem, 2))()
    assert all(p.grad is not None for p in problem.model.parameters() if p.requires_grad)
