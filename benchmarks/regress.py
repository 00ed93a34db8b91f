"""Is this tree slower than a committed one? Time / backward of both, side by side, in the same rounds.

    python benchmarks/regress.py                          # the working tree against HEAD
    python benchmarks/regress.py --against 70af9ec --out benchmarks/results/cpu/regress-<date>.md
    python benchmarks/regress.py --problems 3c3d --methods DiagGGNExact BatchDiagGGNExact --rounds 9

``--against REF``'s ``src/`` is copied out of git (``git archive``, into a temporary folder
removed at the end; nothing in the repository changes). Two worker processes, one importing
curvlib from each tree (``PYTHONPATH=<tree>/src``), build the same problems (this tree's
:mod:`problems`, same seed) and set up the same methods. Then come the timed rounds: each
round times every (tree, method) pair once in a freshly shuffled order, one at a time (a
sample repeats the call up to :data:`MIN_SAMPLE_S`), so that drifts in machine load hit both
trees alike. A ratio is a tree's median time over the median of ``backward`` in the same
rounds (both trees' backwards pooled: it is the same torch code). A method whose ratio grew
by more than ``--threshold`` (15%) is timed again for ``--confirm-rounds`` rounds (both
trees, that method and ``backward`` only) and flagged only if it is slower in those too.
Exit status 1 if any method is flagged, else 0.

Problems: the quick ones of ``run.py`` (:data:`QUICK`); methods: every curvlib extension
of ``run.py`` that fits (the same ``--max-result-gb`` / ``--max-columns`` skips). One torch
thread by default: on a shared machine a second thread mostly adds waiting.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: The problems of ``run.py`` whose whole set of curvlib extensions takes a few minutes on 2 CPU cores.
QUICK = ("mlp", "3c3d", "transformer")
#: A timed sample repeats a method's call until it takes about this long (seconds).
MIN_SAMPLE_S = 0.05
#: Reply lines of a worker start with this (anything else it prints is passed through to stderr).
TAG = "@@regress "


# --------------------------------------------------------------------------- worker


def _worker(args) -> int:
    """Serve ``setup`` / ``time`` requests (one JSON line each) for the curvlib on ``sys.path``."""
    import torch

    sys.path.insert(0, HERE)
    torch.set_num_threads(args.threads)
    import curvlib
    from problems import METHODS, PROBLEMS
    from run import result_bytes, too_many_columns

    runs: dict = {}
    reply = lambda obj: print(TAG + json.dumps(obj), flush=True)  # noqa: E731
    reply({"curvlib": os.path.abspath(curvlib.__file__)})
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "setup":
            runs.clear()
            problem = PROBLEMS[req["problem"]](seed=0)
            status = {}
            for m in req["methods"]:
                status[m] = _setup(m, problem, runs, METHODS, args, result_bytes, too_many_columns)
            reply({"status": status})
        elif req["op"] == "time":
            run, calls = runs[req["method"]]
            t0 = time.perf_counter()
            for _ in range(calls):
                run()
            reply({"s": (time.perf_counter() - t0) / calls})
    return 0


def _setup(m, problem, runs, methods, args, result_bytes, too_many_columns) -> str:
    """``"ok"`` with ``runs[m]`` set up, called once and warmed up, or why not."""
    if m not in methods:
        return "missing"
    if result_bytes(problem, m) > args.max_result_gb * 2**30:
        return f"skipped (result > {args.max_result_gb} GiB)"
    if too_many_columns(problem, m, args.max_columns) is not None:
        return f"skipped (> {args.max_columns} output columns)"
    try:
        run = methods[m](problem)
        for _ in range(1 + args.warmup):
            t0 = time.perf_counter()
            run()
    except Exception as err:  # noqa: BLE001 - a refusal (CurvatureError) or an error of the old tree
        return "refused: " + (str(err).splitlines() or [type(err).__name__])[0][:80]
    # (calls per sample: at least MIN_SAMPLE_S, so that a millisecond call is not one time slice)
    runs[m] = (run, max(1, math.ceil(MIN_SAMPLE_S / max(time.perf_counter() - t0, 1e-6))))
    return "ok"


class Worker:
    """A worker process importing curvlib from ``src`` (first on ``PYTHONPATH``)."""

    def __init__(self, label: str, src: str, args):
        self.label = label
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--threads", str(args.threads),
               "--warmup", str(args.warmup), "--max-result-gb", str(args.max_result_gb),
               "--max-columns", str(args.max_columns)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=HERE)
        where = self.read()["curvlib"]
        if not where.startswith(os.path.abspath(src) + os.sep):
            raise SystemExit(f"{label}: the worker imported curvlib from {where}, not from {src}")

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(TAG):
                return json.loads(line[len(TAG):])
            sys.stderr.write(line)
        raise SystemExit(f"{self.label}: the worker ended (exit status {self.proc.wait()})")

    def ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


# --------------------------------------------------------------------------- timing


def time_rounds(workers: dict, methods: list, rounds: int) -> dict:
    """``{(tree, method): [seconds per round]}``, every pair once per round in shuffled order."""
    pairs = [(t, m) for t in workers for m in methods]
    times = {p: [] for p in pairs}
    for _ in range(rounds):
        random.shuffle(pairs)
        for tree, m in pairs:
            times[(tree, m)].append(workers[tree].ask(op="time", method=m)["s"])
    return times


def ratios(times: dict, trees, methods) -> dict:
    """``{(tree, method): median / median of backward}``; the backward (plain torch, the same in
    both trees) is pooled over the trees, so that its own noise (a few ms on the MLP) does not
    shift one tree's ratios against the other's."""
    base = statistics.median([t for tree in trees for t in times[(tree, "backward")]])
    return {(tree, m): statistics.median(times[(tree, m)]) / base for tree in trees for m in methods}


def compare_problem(problem: str, workers: dict, methods: list, args) -> list:
    """Rows ``(problem, method, before, after, flagged)`` (ratios; ``str`` where a tree has none)."""
    status = {tree: w.ask(op="setup", problem=problem, methods=["backward"] + methods)["status"]
              for tree, w in workers.items()}
    both = [m for m in methods if all(status[t][m] == "ok" for t in workers)]
    print(f"{problem}: {len(both)} methods in both trees, {args.rounds} rounds", file=sys.stderr, flush=True)
    r = ratios(time_rounds(workers, ["backward"] + both, args.rounds), workers, both)
    slower = [m for m in both if r[("after", m)] > (1 + args.threshold) * r[("before", m)]]
    confirmed = set()
    if slower and args.confirm_rounds:
        print(f"{problem}: confirming {', '.join(slower)}", file=sys.stderr, flush=True)
        again = ratios(time_rounds(workers, ["backward"] + slower, args.confirm_rounds), workers, slower)
        confirmed = {m for m in slower if again[("after", m)] > (1 + args.threshold) * again[("before", m)]}
    else:
        confirmed = set(slower)
    rows = []
    for m in methods:
        before = r[("before", m)] if m in both else status["before"][m]
        after = r[("after", m)] if m in both else status["after"][m]
        rows.append((problem, m, before, after, m in confirmed))
    return rows


def table(rows: list, ref: str, threshold: float) -> str:
    """The markdown table of :func:`compare_problem`'s rows."""
    lines = [f"| problem | method | before ({ref}) | after (this tree) | after / before | flag (> {1 + threshold:.2f}) |",
             "|---|---|---:|---:|---:|---|"]
    for problem, m, before, after, flagged in rows:
        if isinstance(before, float) and isinstance(after, float):
            lines.append(f"| {problem} | {m} | {before:.2f} | {after:.2f} | {after / before:.2f} | "
                         f"{'SLOWER' if flagged else ''} |")
        else:
            show = lambda v: f"{v:.2f}" if isinstance(v, float) else v  # noqa: E731
            lines.append(f"| {problem} | {m} | {show(before)} | {show(after)} |  |  |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def checkout(ref: str, into: str) -> str:
    """``ref``'s ``src/`` under ``into`` (``git archive``); returns the commit's short id."""
    sha = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", ref], check=True, capture_output=True,
                         text=True).stdout.strip()
    archive = subprocess.run(["git", "-C", ROOT, "archive", "--format=tar", sha, "src"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return sha


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", default="HEAD", help="the commit to compare with (default: HEAD)")
    p.add_argument("--problems", nargs="+", default=list(QUICK))
    p.add_argument("--methods", nargs="+", default=None, help="default: every curvlib extension of run.py")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--confirm-rounds", type=int, default=5, help="rounds that re-time a method found slower")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls after the first")
    p.add_argument("--threshold", type=float, default=0.15, help="flag a ratio grown by more than this share")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-result-gb", type=float, default=1.5)
    p.add_argument("--max-columns", type=int, default=1024)
    p.add_argument("--out", default=None, help="also write the table (markdown) here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        return _worker(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (so that the copy is removed)
    sys.path.insert(0, HERE)
    from problems import FIRST_ORDER, SECOND_ORDER

    methods = args.methods or list(FIRST_ORDER + SECOND_ORDER)
    head = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"], capture_output=True,
                          text=True).stdout.strip()  # (at the start: the tree the workers import)
    tmp = tempfile.mkdtemp(prefix="curvlib-regress-")
    workers = {}
    started = time.time()
    try:
        ref = checkout(args.against, tmp)
        workers = {"before": Worker(f"before ({ref})", os.path.join(tmp, "src"), args),
                   "after": Worker("after (this tree)", os.path.join(ROOT, "src"), args)}
        rows = []
        for problem in args.problems:  # (each problem's table as it is done: a stopped run keeps them)
            rows += compare_problem(problem, workers, methods, args)
            print(table([r for r in rows if r[0] == problem], ref, args.threshold), file=sys.stderr, flush=True)
    finally:
        for w in workers.values():
            w.close()
        shutil.rmtree(tmp, ignore_errors=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    text = (f"`python benchmarks/regress.py --against {args.against}`: this tree ({head}) against {ref}; "
            f"time / backward, medians of {args.rounds} interleaved rounds, {args.threads} torch thread(s), "
            f"load average at the end {load:.2f}, {(time.time() - started) / 60:.1f} min.\n\n"
            + table(rows, ref, args.threshold) + "\n")
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    flagged = [f"{p} {m}" for p, m, _, _, f in rows if f]
    if flagged:
        print(f"slower by more than {args.threshold:.0%}: {', '.join(flagged)}", file=sys.stderr)
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
