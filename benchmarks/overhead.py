"""Per-call overhead of ``curvature(...)(X, y)`` on a model too small for the math to matter.

    python benchmarks/overhead.py                                      # this tree
    git archive 35f488a src | tar -x -C /tmp/before                    # compare with another tree:
    python benchmarks/overhead.py --tree before=/tmp/before/src --tree after=src

Model: ``Linear(10, 10) - ReLU - Linear(10, 3)``, ``N = 8``, ``CrossEntropyLoss()``,
one torch thread (at this size threads only add noise). In a fresh process per tree
(``PYTHONPATH`` = the tree's ``src``), every method is set up and called 50 times,
then timed in ``--rounds`` shuffled rounds of ``--inner`` calls each; reported is the
median time per call (µs) and its ratio to the median of a plain
``zero_grad(); lossfn(model(X), y).backward()`` in the same process. Trees alternate,
``--repeats`` times; the median over processes is shown, and the spread (max/min of the
per-process medians) as the noise. With ``--stages`` the time of each stage of the
call is reported as well (wrappers around curvlib's functions, this tree only).

Writes ``overhead-cpu.md`` and ``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from memory_knobs import spawn  # noqa: E402

METHODS = ("loss+grad", "BatchGrad", "SumGradSquared", "DiagGGNExact", "DiagGGNMC", "KFLR", "KFAC",
           "SqrtGGNExact", "DiagHessian")


def _problem():
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 3))
    return model, nn.CrossEntropyLoss(), torch.randn(8, 10), torch.randint(0, 3, (8,))


def _runs(methods):
    from curvlib import curvature, extensions

    model, lossfn, X, y = _problem()

    def backward():
        model.zero_grad(set_to_none=True)
        lossfn(model(X), y).backward()

    runs = {"backward": backward}
    for m in methods:
        f = curvature(model, lossfn, [] if m == "loss+grad" else [getattr(extensions, m)()])
        runs[m] = lambda f=f: f(X, y)
    return runs


def _child_time(job: dict) -> dict:
    runs = _runs(job["methods"])
    for run in runs.values():
        for _ in range(50):
            run()
    times = {m: [] for m in runs}
    order, rng = list(runs), random.Random(0)
    for _ in range(job["rounds"]):
        rng.shuffle(order)
        for m in order:
            run = runs[m]
            t0 = time.perf_counter()
            for _ in range(job["inner"]):
                run()
            times[m].append((time.perf_counter() - t0) / job["inner"])
    us = {m: 1e6 * statistics.median(v) for m, v in times.items()}
    return {"us": us, "ratio": {m: v / us["backward"] for m, v in us.items()}}


#: (module, function) pairs timed by ``--stages`` (those missing in a tree are skipped).
STAGES = [("curvlib._transform.entry", f) for f in (
    "forward_with_probes", "_loss_and_site_gradients", "first_order", "second_order", "check_second_order",
    "refuse_mixing", "_auto_chunk_size")] + [
    ("curvlib._plan.budget", "check_roots"), ("curvlib.losses", "check_targets"),
    ("curvlib.losses", "curvature_at"), ("curvlib._plan.arguments", "parameter_values")]


def _child_stages(job: dict) -> dict:
    """Seconds per call spent in each of :data:`STAGES` (wrapped where they are looked up)."""
    import importlib

    spent: dict = {}
    for modname, fname in STAGES:
        try:
            mod = importlib.import_module(modname)
        except ImportError:  # a tree without it
            continue
        if hasattr(mod, fname):
            setattr(mod, fname, _timed(getattr(mod, fname), fname, spent))
    out = {}
    for m, run in _runs(job["methods"]).items():
        for _ in range(50):
            run()
        spent.clear()
        t0 = time.perf_counter()
        for _ in range(job["inner"] * job["rounds"]):
            run()
        calls = job["inner"] * job["rounds"]
        out[m] = {"total": 1e6 * (time.perf_counter() - t0) / calls,
                  **{k: 1e6 * v / calls for k, v in spent.items()}}
    return {"stages_us": out}


def _timed(fn, name: str, spent: dict):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0

    return wrapper


def _child(job: dict) -> None:
    import torch

    torch.set_num_threads(1)
    out = _child_stages(job) if job.get("stages") else _child_time(job)
    print(json.dumps(out))


def markdown(per_tree: dict, methods: list) -> str:
    trees = list(per_tree)
    head = "| method | " + " | ".join(f"{t} µs/call | {t} ratio | {t} spread" for t in trees)
    head += "".join(f" | {t} − {trees[0]} µs | ratio {t} / {trees[0]}" for t in trees[1:]) + " |"
    lines = [head, "|---|" + "---:|" * (3 * len(trees) + 2 * (len(trees) - 1))]
    for m in ["backward"] + list(methods):
        cells, us = [], {}
        for t in trees:
            runs = per_tree[t]
            vals = [r["us"][m] for r in runs]
            us[t] = statistics.median(vals)
            ratio = statistics.median(r["ratio"][m] for r in runs)
            cells += [f"{us[t]:.0f}", f"{ratio:.2f}", f"{max(vals) / min(vals):.2f}"]
        for t in trees[1:]:
            cells += [f"{us[t] - us[trees[0]]:+.0f}", f"{us[t] / us[trees[0]]:.2f}"]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_stages(stages: dict) -> str:
    names = [f for _, f in STAGES if any(f in v for v in stages.values())]
    lines = ["| method | total | " + " | ".join(names) + " |", "|---|" + "---:|" * (len(names) + 1)]
    for m, v in stages.items():
        lines.append(f"| {m} | {v['total']:.0f} | " + " | ".join(f"{v[n]:.0f}" if n in v else "" for n in names) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tree", action="append", default=None, metavar="LABEL=SRC")
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--repeats", type=int, default=5, help="processes per tree (trees alternate)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--inner", type=int, default=40, help="calls per timed block")
    parser.add_argument("--stages", action="store_true", help="also time the stages of a call (per tree)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    if args.child is not None:
        _child(json.loads(args.child))
        return 0
    trees = dict(t.split("=", 1) for t in (args.tree or [f"this={os.path.join(ROOT, 'src')}"]))
    job = {"methods": args.methods, "rounds": args.rounds, "inner": args.inner}
    per_tree: dict = {t: [] for t in trees}
    for _ in range(args.repeats):
        for t, src in trees.items():
            r = spawn(src, job, None, script=__file__)
            if "error" in r:
                raise SystemExit(f"{t}: {r['error']}")
            per_tree[t].append(r)
            print(f"{t}: " + ", ".join(f"{m} {v:.0f}" for m, v in r["us"].items()), file=sys.stderr, flush=True)
    text = (f"Per-call time of a tiny MLP (10-10-3, N = 8, CrossEntropyLoss, 1 torch thread): median µs "
            f"per call over {args.repeats} processes per tree ({args.rounds} rounds of {args.inner} calls each), "
            "ratio = time / plain backward in the same process, spread = max / min of the per-process "
            "medians. Trees: " + ", ".join(f"{t} = `{s}`" for t, s in trees.items()) + ".\n\n"
            + markdown(per_tree, args.methods))
    stages = {}
    if args.stages:
        for t, src in trees.items():
            r = spawn(src, {**job, "stages": True}, None, script=__file__)
            if "error" in r:
                raise SystemExit(f"{t} (stages): {r['error']}")
            stages[t] = r["stages_us"]
            text += f"\n\nStages of one call, µs ({t}; wrappers add about 0.3 µs each):\n\n" + markdown_stages(stages[t])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "overhead-cpu.md"), "w") as fh:
        fh.write(text + "\n")
    with open(os.path.join(args.out, "overhead-cpu.json"), "w") as fh:
        json.dump({"args": vars(args), "trees": trees, "runs": per_tree, "stages": stages}, fh, indent=0)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
