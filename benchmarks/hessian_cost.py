"""The cost of the GGN and Hessian families on tiny language models, as ratios to a plain
``loss.backward()`` in the same run.

    python benchmarks/hessian_cost.py [--models gpt2 llama] [--extensions ...] [--repeats 3]
        [--out benchmarks/results/cpu/hessian-cost.md]

The problems are the ecosystem sweep's (``tests/oracles/ecosystem.py``: transformers causal
LMs from a tiny config, one layer, float64, random weights). Per extension: the first call
(trace, plan and evaluate, a fresh ``curvature`` object) and the best of ``--repeats`` later
calls, each divided by the best of ``--repeats`` plain backward passes (forward included).
One torch thread.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

import torchvision_shim  # noqa: E402  (before transformers imports torchvision)

torchvision_shim.install()

from curvlib import curvature, extensions as E  # noqa: E402
from oracles import ecosystem  # noqa: E402
from oracles.zoo_reference import forward  # noqa: E402

MODELS = {"gpt2": "transformers/causal_lm/gpt2", "llama": "transformers/causal_lm/llama"}
EXTENSIONS = ["BatchGrad", "DiagGGNExact", "SqrtGGNExact", "DiagHessian", "BatchDiagHessian"]


def backward_seconds(prob, repeats: int) -> float:
    """Best of ``repeats`` plain forward + ``loss.backward()``."""
    best = float("inf")
    for _ in range(repeats + 1):
        t = time.perf_counter()
        prob.lossfn(forward(prob.model, prob.X, prob.output), prob.y).backward()
        best = min(best, time.perf_counter() - t)
    for p in prob.model.parameters():
        p.grad = None
    return best


def extension_seconds(prob, name: str, repeats: int):
    """``(first call, best later call)`` of one extension, in seconds."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f = curvature(prob.model, prob.lossfn, [getattr(E, name)()], output=prob.output)
        t = time.perf_counter()
        f(prob.X, prob.y)
        first = time.perf_counter() - t
        later = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            f(prob.X, prob.y)
            later = min(later, time.perf_counter() - t)
    return first, later


def measure(model: str, names, repeats: int):
    """Rows ``(extension, first / backward, later / backward, later seconds)`` and the backward."""
    prob = ecosystem.build(MODELS[model])
    backward = backward_seconds(prob, repeats)
    rows = []
    for name in names:
        first, later = extension_seconds(prob, name, repeats)
        rows.append((name, first / backward, later / backward, later))
        print(f"{model:6s} {name:18s} first {first / backward:8.1f}x  later {later / backward:8.1f}x  "
              f"({later * 1e3:.1f} ms; backward {backward * 1e3:.2f} ms)", flush=True)
    return prob, backward, rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--extensions", nargs="+", default=EXTENSIONS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    lines = [f"# Hessian-family cost on tiny language models ({datetime.date.today()})", "",
             f"`python benchmarks/hessian_cost.py`; {platform.machine()} {platform.processor() or ''}, "
             f"{os.cpu_count()} cores (shared), one torch thread, torch {torch.__version__}. Ratios to a plain "
             "forward + `loss.backward()` in the same run; later = best of "
             f"{args.repeats} calls after the first.", ""]
    for model in args.models:
        prob, backward, rows = measure(model, args.extensions, args.repeats)
        n = sum(p.numel() for p in prob.model.parameters() if p.requires_grad)
        lines += [f"## {prob.notes}, {n} parameters, backward {backward * 1e3:.2f} ms", "",
                  "| extension | first call / backward | later call / backward | later call (ms) |",
                  "|---|---:|---:|---:|"]
        lines += [f"| {e} | {a:.1f} | {b:.1f} | {s * 1e3:.1f} |" for e, a, b, s in rows] + [""]
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
