"""The cost of the GGN and Hessian families on tiny language models, as ratios to a plain
``loss.backward()`` in the same run.

    python benchmarks/hessian_cost.py [--models gpt2 llama] [--sweep K] [--extensions ...]
        [--repeats 3] [--out benchmarks/results/cpu/hessian-cost.md]

The problems are the ecosystem sweep's (``tests/oracles/ecosystem.py``: transformers causal
LMs from a tiny config, one layer, float64, random weights); ``--models`` takes model types or
full sweep names, ``--sweep K`` adds every K-th causal LM of the sweep that runs in float64.
Per extension: the first call (trace, plan and evaluate, a fresh ``curvature`` object) and the
best of ``--repeats`` later calls, the extensions' calls interleaved (a machine whose speed
drifts slows them alike), each divided by the best of ``--repeats`` plain backward passes
(forward included). The summary gives each model's Hessian diagonals over its GGN diagonal.
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

MODELS = ["gpt2", "llama"]
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


def extension_seconds(prob, names, repeats: int):
    """``{name: (first call, best later call)}`` in seconds, or ``{name: error}`` for an
    extension that fails; the later calls of all extensions interleaved."""
    first, later, calls = {}, {}, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            f = curvature(prob.model, prob.lossfn, [getattr(E, name)()], output=prob.output)
            t = time.perf_counter()
            try:
                f(prob.X, prob.y)
            except Exception as exc:  # noqa: BLE001 - reported in the table
                first[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
                continue
            first[name], later[name], calls[name] = time.perf_counter() - t, float("inf"), f
        for _ in range(repeats):
            for name, f in calls.items():
                t = time.perf_counter()
                f(prob.X, prob.y)
                later[name] = min(later[name], time.perf_counter() - t)
    return {name: (first[name], later[name]) if name in later else first[name] for name in names}


def measure(name: str, names, repeats: int):
    """Rows ``(extension, first / backward, later / backward, later seconds)`` (or the error),
    and the backward."""
    prob = ecosystem.build(name if "/" in name else f"transformers/causal_lm/{name}")
    backward = backward_seconds(prob, repeats)
    rows = []
    for ext, got in extension_seconds(prob, names, repeats).items():
        if isinstance(got, str):
            rows.append((ext, got))
            print(f"{name:12s} {ext:18s} {got}", flush=True)
            continue
        first, later = got
        rows.append((ext, first / backward, later / backward, later))
        print(f"{name:12s} {ext:18s} first {first / backward:8.1f}x  later {later / backward:8.1f}x  "
              f"({later * 1e3:.1f} ms; backward {backward * 1e3:.2f} ms)", flush=True)
    return prob, backward, rows


def sweep_models(every: int) -> list:
    """Every ``every``-th causal LM of the sweep that runs in float64 (model types)."""
    picked = [n for n in ecosystem.names("transformers") if n.split("/")[1] == "causal_lm"][::every]
    return [n.split("/")[2] for n in picked if ecosystem.eligible_problem(n)[1] is not None]


def _summary(results) -> list:
    """Per model, DiagHessian and BatchDiagHessian over DiagGGNExact (later calls)."""
    lines = ["## Hessian diagonals over the GGN diagonal (later calls)", "",
             "| model | DiagGGNExact (ms) | DiagHessian / DiagGGNExact | BatchDiagHessian / DiagGGNExact |",
             "|---|---:|---:|---:|"]
    ratios = []
    for model, rows in results:
        ms = {r[0]: r[3] for r in rows if len(r) == 4}
        if "DiagGGNExact" not in ms:
            continue
        g = ms["DiagGGNExact"]
        cells = [f"{ms[e] / g:.1f}" if e in ms else "-" for e in ("DiagHessian", "BatchDiagHessian")]
        ratios += [ms[e] / g for e in ("DiagHessian", "BatchDiagHessian") if e in ms]
        lines.append(f"| {model} | {g * 1e3:.1f} | {cells[0]} | {cells[1]} |")
    if ratios:
        ratios.sort()
        lines += ["", f"{len(ratios)} ratios: median {ratios[len(ratios) // 2]:.1f}, largest {ratios[-1]:.1f}, "
                      f"{sum(r <= 5 for r in ratios)} within 5x.", ""]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=MODELS)
    parser.add_argument("--sweep", type=int, default=0, help="add every K-th causal LM of the sweep")
    parser.add_argument("--extensions", nargs="+", default=EXTENSIONS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    models = list(args.models) + ([m for m in sweep_models(args.sweep) if m not in args.models] if args.sweep else [])
    lines = [f"# Hessian-family cost on tiny language models ({datetime.date.today()})", "",
             f"`python benchmarks/hessian_cost.py {' '.join(argv if argv is not None else sys.argv[1:])}`; "
             f"{platform.machine()} {platform.processor() or ''}, "
             f"{os.cpu_count()} cores (shared), one torch thread, torch {torch.__version__}. Ratios to a plain "
             "forward + `loss.backward()` in the same run; later = best of "
             f"{args.repeats} calls after the first, the extensions' calls interleaved.", ""]
    results, body = [], []
    for model in models:
        try:
            prob, backward, rows = measure(model, args.extensions, args.repeats)
        except Exception as exc:  # noqa: BLE001 - a model that does not build: reported
            body += [f"## {model}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", ""]
            continue
        results.append((model, rows))
        n = sum(p.numel() for p in prob.model.parameters() if p.requires_grad)
        body += [f"## {prob.notes}, {n} parameters, backward {backward * 1e3:.2f} ms", "",
                 "| extension | first call / backward | later call / backward | later call (ms) |",
                 "|---|---:|---:|---:|"]
        body += [f"| {r[0]} | {r[1]:.1f} | {r[2]:.1f} | {r[3] * 1e3:.1f} |" if len(r) == 4 else f"| {r[0]} | {r[1]} | | |"
                 for r in rows] + [""]
    lines += _summary(results) + body
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
