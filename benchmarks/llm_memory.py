"""Peak memory and time of curvlib's methods on a language model (issue 23): ``gpt2-small``.

    python benchmarks/llm_memory.py                                    # this tree, every method
    python benchmarks/llm_memory.py --methods DiagGGNMC KFAC[max_factor_dim=4096] --rounds 2
    git archive b0adc77 src | tar -x -C /tmp/before                    # another tree as well:
    python benchmarks/llm_memory.py --tree before=/tmp/before/src --tree after=src

Each measurement runs in a fresh Python process (``memory_knobs.spawn``: ``PYTHONPATH`` is
the tree's ``src``), one at a time:

* **peak memory**: the process builds the problem (``problems.PROBLEMS``, default
  ``gpt2-small``: 163 M parameters, N=4, T=128, vocab 50257), pays curvlib's lazy imports
  (``run.prewarm``), calls the method once (tracing included) and reports ``ru_maxrss``;
  shown is the difference to a process that only builds the problem: the peak above the
  built model. ``backward`` is a plain ``lossfn(model(X), y).backward()``.
* **time**: another process sets the method and a backward up, calls each once untimed
  (tracing, allocator warm-up), then alternates ``--rounds`` timed calls of each; the
  ratio is the method's median over the backward's median in that process.

A method refused by curvlib (``CurvatureError``, before any work) is reported with the
first line of its message and the seconds until it was raised. Writes
``llm-memory-<problem>.md`` and ``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from memory_knobs import spawn  # noqa: E402

#: Methods: ``backward`` or an extension, optionally with keyword options in brackets.
METHODS = ("backward", "BatchL2Grad", "SumGradSquared", "Variance", "DiagGGNMC", "BatchGrad", "KFAC",
           "KFAC[max_factor_dim=4096]")


def _runner(problem, method: str):
    """A zero-argument callable doing ``method`` once on ``problem``."""
    from problems import backward

    if method == "backward":
        return backward(problem)
    from curvlib import curvature, extensions

    name, _, options = re.fullmatch(r"(\w+)(\[(.*)\])?", method).group(1, 2, 3)
    kwargs = dict((k, int(v)) for k, v in (o.split("=") for o in options.split(","))) if options else {}
    ext = getattr(extensions, name)(**kwargs)
    model, lossfn, X, y = problem
    f = curvature(model, lossfn, [ext])
    return lambda: f(X, y)[ext.name]


def _child_memory(job: dict) -> dict:
    import resource

    import torch
    from problems import PROBLEMS
    from run import prewarm

    prewarm()
    problem = PROBLEMS[job["problem"]](seed=job["seed"])
    out = {}
    if job["method"] is not None:
        torch.manual_seed(job["seed"])
        start = time.perf_counter()
        try:
            result = _runner(problem, job["method"])()
            del result
        except ValueError as err:  # CurvatureError: refused
            out["refused"] = str(err).splitlines()[0][:400]
        out["seconds"] = time.perf_counter() - start
    out["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    return out


def _child_time(job: dict) -> dict:
    import torch
    from problems import PROBLEMS
    from run import prewarm

    prewarm()
    problem = PROBLEMS[job["problem"]](seed=job["seed"])
    runs = {"backward": _runner(problem, "backward"), job["method"]: _runner(problem, job["method"])}
    torch.manual_seed(job["seed"])
    first = {}
    for label, run in runs.items():  # untimed: tracing and the allocator's first requests
        start = time.perf_counter()
        run()
        first[label] = time.perf_counter() - start
    times: dict = {label: [] for label in runs}
    for _ in range(job["rounds"]):
        for label, run in runs.items():
            start = time.perf_counter()
            run()
            times[label].append(time.perf_counter() - start)
    med = {label: statistics.median(t) for label, t in times.items()}
    return {"ms": {k: 1e3 * v for k, v in med.items()}, "first_ms": {k: 1e3 * v for k, v in first.items()},
            "ratio": med[job["method"]] / med["backward"]}


def measure(src: str, problem: str, method: str, args) -> dict:
    """Memory above the built model (MiB) and time / backward of ``method`` with the tree ``src``."""
    job = {"problem": problem, "seed": args.seed, "mode": "memory", "method": None}
    base = spawn(src, job, args.threads, script=__file__)
    mem = spawn(src, {**job, "method": method}, args.threads, script=__file__)
    print(f"{method}: {json.dumps(mem)[:300]}", file=sys.stderr, flush=True)
    row = {"method": method, "base_mib": base.get("peak_mib"), **mem}
    if "peak_mib" in mem and "peak_mib" in base:
        row["above_mib"] = mem["peak_mib"] - base["peak_mib"]
    if "refused" not in mem and "error" not in mem and args.rounds > 0:
        tim = spawn(src, {**job, "mode": "time", "method": method, "rounds": args.rounds}, args.threads,
                    script=__file__)
        print(f"{method} time: {json.dumps(tim)[:300]}", file=sys.stderr, flush=True)
        row.update({k: tim[k] for k in ("ratio", "ms", "first_ms", "error") if k in tim})
    return row


def markdown(problem: str, rows: dict, trees: list) -> str:
    """One table: per tree, peak MiB above the model, its ratio to backward's, time / backward."""
    head = "| method | " + " | ".join(f"{t}: MiB above model | {t}: / backward's | {t}: time / backward"
                                      for t in trees) + " |"
    lines = [f"#### {problem}", "", head, "|---|" + "---:|---:|---:|" * len(trees)]
    methods = list(dict.fromkeys(m for t in trees for m in rows[t]))
    for m in methods:
        cells = []
        for t in trees:
            r = rows[t].get(m, {})
            ref = rows[t].get("backward", {}).get("above_mib")
            if "refused" in r:
                cells += [f"refused in {r['seconds']:.2f} s: {r['refused'][:150]}", "", ""]
                continue
            mib = r.get("above_mib")
            cells += ["" if mib is None else f"{mib:.0f}", "" if mib is None or not ref else f"{mib / ref:.2f}",
                      "" if r.get("ratio") is None else f"{r['ratio']:.2f}"]
        lines.append(f"| `{m}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--problem", default="gpt2-small")
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--tree", action="append", default=None, metavar="LABEL=SRC")
    parser.add_argument("--rounds", type=int, default=3, help="timed calls of each (0: memory only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "cpu"))
    args = parser.parse_args(argv)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    if args.child is not None:
        job = json.loads(args.child)
        print(json.dumps(_child_memory(job) if job["mode"] == "memory" else _child_time(job)))
        return 0
    trees = dict(t.split("=", 1) for t in (args.tree or [f"this={os.path.join(os.path.dirname(HERE), 'src')}"]))
    rows = {t: {m: measure(src, args.problem, m, args) for m in args.methods} for t, src in trees.items()}
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"llm-memory-{args.problem}")
    with open(stem + ".json", "w") as f:
        json.dump({"problem": args.problem, "trees": trees, "rows": rows}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(args.problem, rows, list(trees)) + "\n")
    print(markdown(args.problem, rows, list(trees)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
