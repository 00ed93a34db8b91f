"""Time curvlib's extensions against a plain backward pass.

    python benchmarks/run.py [--problems mlp 3c3d] [--methods ...] [--rounds R]
                             [--threads T] [--json out.json]

For every problem (:data:`problems.PROBLEMS`), every method
(:data:`problems.METHODS`) is set up once, called ``--warmup`` times (the
first call, which for curvlib includes tracing and planning, is reported
separately as "first call"), then timed in ``R`` rounds: each round calls
every method once, in a freshly shuffled order, so that drifts in machine
load hit all methods alike. Reported per method: the median time over the
rounds and its ratio to the median of ``"backward"`` (``zero_grad`` +
``lossfn(model(X), y).backward()``) over the same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from problems import DEFAULT_METHODS, METHODS, PROBLEMS  # noqa: E402


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: str) -> Dict[str, object]:
    import curvlib

    env = {
        "torch": torch.__version__,
        "curvlib": curvlib.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "device": device,
        "load_average_1min_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def _timer(device: str):
    if device.startswith("cuda"):
        def now() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()
    else:
        now = time.perf_counter
    return now


def prewarm() -> None:
    """Pay curvlib's one-time costs (lazy imports of fx / fake tensors) outside any timing."""
    from curvlib import curvature

    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    curvature(model, torch.nn.CrossEntropyLoss(), [])(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))


def bench_problem(name: str, methods: List[str], rounds: int, warmup: int, device: str, seed: int) -> List[Dict]:
    """Rows ``{problem, method, median_ms, ratio, first_call_ms, times_ms}`` for one problem."""
    problem = PROBLEMS[name](device=device, seed=seed)
    now = _timer(device)
    runs, first, refused = {}, {}, {}
    for m in methods:
        try:
            runs[m] = METHODS[m](problem)
            t0 = now()
            runs[m]()
            first[m] = now() - t0
        except ValueError as err:  # a refusal (CurvatureError): report it, time the rest
            refused[m] = str(err).splitlines()[0][:160]
            runs.pop(m, None)
            continue
        for _ in range(warmup - 1):
            runs[m]()
    methods = [m for m in methods if m not in refused]
    times: Dict[str, List[float]] = {m: [] for m in methods}
    order = list(methods)
    rng = random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        for m in order:
            t0 = now()
            out = runs[m]()
            times[m].append(now() - t0)
            del out
    ref = statistics.median(times["backward"])
    rows = []
    for m in methods:
        med = statistics.median(times[m])
        rows.append({
            "problem": name,
            "method": m,
            "median_ms": 1e3 * med,
            "ratio": med / ref,
            "first_call_ms": 1e3 * first[m],
            "times_ms": [1e3 * t for t in times[m]],
        })
    for m, why in refused.items():
        rows.append({"problem": name, "method": m, "refused": why})
    return rows


def markdown(rows: List[Dict]) -> str:
    bound = {r["problem"]: r["ratio"] for r in rows if r["method"] == "bound:BatchGrad"}
    lines = [
        "| problem | method | median ms | ratio to backward | first call ms |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        if r["method"] == "bound:BatchGrad":
            continue
        if "refused" in r:
            lines.append(f"| {r['problem']} | {r['method']} | refused: {r['refused']} | | |")
            continue
        ratio = f"{r['ratio']:.2f}"
        if r["method"] == "BatchGrad" and r["problem"] in bound:
            ratio += f" (bound {bound[r['problem']]:.2f})"
        lines.append(
            f"| {r['problem']} | {r['method']} | {r['median_ms']:.2f} | {ratio} | {r['first_call_ms']:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=list(METHODS),
                        help="methods to time ('backward' is always added: it is the reference)")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per method before the rounds")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch.get_num_threads())")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results and the environment here")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 1:
        parser.error("--rounds and --warmup must be at least 1")

    threads_source = "default torch.get_num_threads()"
    if args.threads is not None:
        torch.set_num_threads(args.threads)
        threads_source = "--threads"
    methods = ["backward"] + [m for m in args.methods if m != "backward"]
    env = environment(args.device)
    print(f"torch {env['torch']}, curvlib {env['curvlib']}, python {env['python']}")
    print(f"CPU: {env['cpu']} ({env['cpu_count']} logical cores), torch threads: {env['threads']} ({threads_source})")
    if env["load_average_1min_at_start"] is not None:
        print(f"load average (1 min) at start: {env['load_average_1min_at_start']:.2f}")
    if "gpu" in env:
        print(f"GPU: {env['gpu']}")
    print(f"device {args.device}, float32, {args.rounds} rounds after {args.warmup} warm-up call(s), shuffled order per round")
    print()

    prewarm()
    rows: List[Dict] = []
    for name in args.problems:
        rows += bench_problem(name, methods, args.rounds, args.warmup, args.device, args.seed)
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"environment": env, "args": vars(args), "results": rows}, fh, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
