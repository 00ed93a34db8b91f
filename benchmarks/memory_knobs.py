"""Peak memory and time of the memory knobs (``chunk_size``, ``batch_chunk_size``).

    python benchmarks/memory_knobs.py                                  # this tree, all problems
    python benchmarks/memory_knobs.py --problems mlp resnet --extensions SqrtGGNExact
    git archive 35f488a src | tar -x -C /tmp/before                    # compare with another tree:
    python benchmarks/memory_knobs.py --tree before=/tmp/before/src --tree after=src

For every problem (:data:`problems.PROBLEMS`), extension and knob setting
(:data:`CONFIGS`) the knobs must not raise peak memory above the unchunked call's
(``chunk_size=None``, no ``batch_chunk_size``). Each measurement runs in a fresh
Python process whose ``PYTHONPATH`` is the tree's ``src`` (so several trees, e.g.
before and after a change, are measured by the same script):

* **peak memory**: the process builds the problem, sets the transform up, calls it
  once and reports ``ru_maxrss``; shown is the difference to a baseline process that
  only builds the problem (both pay curvlib's lazy imports first, as in ``run.py``).
  Trees alternate per setting, ``--memory-repeats`` times; the median is shown.
* **time**: one process per (problem, extension, tree) sets every setting and a plain
  ``lossfn(model(X), y).backward()`` up, calls each once (checking the result against
  the unchunked one for deterministic extensions), then times shuffled rounds (up to
  ``--rounds``, within ``--budget`` seconds, at least one). Ratio = median time /
  median backward time in the same process. Trees alternate, ``--time-repeats``
  times; the median ratio is shown.

Writes ``memory-knobs-<device>.md`` and ``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: Knob settings: label -> keyword arguments of ``curvature``. The first is the reference.
CONFIGS = {
    "unchunked": {"chunk_size": None},
    "chunk_size=auto": {"chunk_size": "auto"},
    "chunk_size=1": {"chunk_size": 1},
    "chunk_size=2": {"chunk_size": 2},
    "chunk_size=10": {"chunk_size": 10},
    "batch_chunk_size=1": {"chunk_size": None, "batch_chunk_size": 1},
    "batch_chunk_size=4": {"chunk_size": None, "batch_chunk_size": 4},
    "batch_chunk_size=8": {"chunk_size": None, "batch_chunk_size": 8},
    "auto, batch_chunk_size=8": {"chunk_size": "auto", "batch_chunk_size": 8},
    "chunk_size=1, batch_chunk_size=8": {"chunk_size": 1, "batch_chunk_size": 8},
    "chunk_size=10, batch_chunk_size=4": {"chunk_size": 10, "batch_chunk_size": 4},
}
EXTENSIONS = ("SqrtGGNExact", "SqrtGGNMC")
DETERMINISTIC = ("SqrtGGNExact",)


# --------------------------------------------------------------------------- child processes


def _setup(problem, ext: str, options: dict):
    from curvlib import curvature, extensions

    model, lossfn, X, y = problem
    f = curvature(model, lossfn, [getattr(extensions, ext)()], **options)
    key = getattr(extensions, ext)().name
    return lambda: f(X, y)[key]


def _child_memory(job: dict) -> dict:
    """Build the problem (and call the transform once); ``ru_maxrss`` in MiB."""
    import resource

    import torch
    from problems import PROBLEMS
    from run import prewarm

    prewarm()
    problem = PROBLEMS[job["problem"]](seed=job["seed"])
    if job.get("options") is not None:
        torch.manual_seed(job["seed"])
        out = _setup(problem, job["ext"], job["options"])()
        del out
    return {"peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10}


def _max_rel_diff(a: dict, b: dict) -> float:
    scale = max(t.abs().max().item() for t in b.values())
    return max((a[k] - b[k]).abs().max().item() for k in b) / (scale or 1.0)


def _child_time(job: dict) -> dict:
    """Every setting of ``job["configs"]`` and a backward, timed in shuffled rounds."""
    import torch
    from problems import PROBLEMS, backward
    from run import prewarm

    prewarm()
    problem = PROBLEMS[job["problem"]](seed=job["seed"])
    runs = {"backward": backward(problem)}
    first, check, ref = {}, {}, None
    for label in job["configs"]:
        runs[label] = _setup(problem, job["ext"], CONFIGS[label])
        torch.manual_seed(job["seed"])
        t0 = time.perf_counter()
        out = runs[label]()
        first[label] = time.perf_counter() - t0
        if job["ext"] in DETERMINISTIC:
            if ref is None:
                ref = out
            else:
                check[label] = _max_rel_diff(out, ref)
        del out
    del ref
    for label, run in runs.items():  # a second warm-up for the fast ones
        if first.get(label, 0.0) < 1.0:
            run()
    times = {label: [] for label in runs}
    order, rng, start = list(runs), random.Random(job["seed"]), time.perf_counter()
    for i in range(job["rounds"]):
        if i and time.perf_counter() - start > job["budget"]:
            break
        rng.shuffle(order)
        for label in order:
            t0 = time.perf_counter()
            runs[label]()
            times[label].append(time.perf_counter() - t0)
    ref_s = statistics.median(times["backward"])
    return {"backward_ms": 1e3 * ref_s, "rounds": len(times["backward"]), "check": check,
            "ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
            "ratio": {k: statistics.median(v) / ref_s for k, v in times.items()}}


def spawn(src: str, job: dict, threads, script: str = __file__) -> dict:
    """Run ``job`` by ``script --child JOB`` in a fresh interpreter that imports curvlib from
    ``src``; its last line of output (JSON) is the result."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(src), HERE]))
    cmd = [sys.executable, os.path.abspath(script), "--child", json.dumps(job)]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["killed (out of memory?)"])[-1]
        return {"error": f"exit {done.returncode}: {tail[:160]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _child(job: dict) -> None:
    import curvlib

    out = _child_memory(job) if job["mode"] == "memory" else _child_time(job)
    out["curvlib"] = curvlib.__file__
    print(json.dumps(out))


# --------------------------------------------------------------------------- measurements


def measure_memory(trees: dict, problem: str, ext: str, args) -> dict:
    """``tree -> label -> peak MiB above the baseline`` (median over repeats)."""
    job = {"mode": "memory", "problem": problem, "ext": ext, "seed": args.seed, "options": None}
    base = {t: statistics.median(spawn(src, job, args.threads)["peak_mib"] for _ in range(args.memory_repeats))
            for t, src in trees.items()}
    peaks: dict = {t: {} for t in trees}
    for label in args.configs:
        samples: dict = {t: [] for t in trees}
        for _ in range(args.memory_repeats):
            for t, src in trees.items():  # trees alternate
                r = spawn(src, {**job, "options": CONFIGS[label]}, args.threads)
                samples[t].append(r.get("peak_mib", r.get("error")))
                _progress(f"memory {problem} {ext} {label} {t}: {samples[t][-1]}")
        for t in trees:
            ok = [v - base[t] for v in samples[t] if isinstance(v, float)]
            peaks[t][label] = {"mib": statistics.median(ok) if ok else None, "samples": ok,
                               "error": next((v for v in samples[t] if isinstance(v, str)), None)}
    return peaks


def measure_time(trees: dict, problem: str, ext: str, args) -> dict:
    """``tree -> label -> {ratio, ms, check}`` (median over repeats)."""
    job = {"mode": "time", "problem": problem, "ext": ext, "seed": args.seed, "configs": list(args.configs),
           "rounds": args.rounds, "budget": args.budget}
    runs: dict = {t: [] for t in trees}
    for _ in range(args.time_repeats):
        for t, src in trees.items():
            runs[t].append(spawn(src, job, args.threads))
            _progress(f"time {problem} {ext} {t}: " + json.dumps(runs[t][-1].get("ratio", runs[t][-1]))[:200])
    out: dict = {}
    for t in trees:
        ok = [r for r in runs[t] if "ratio" in r]
        out[t] = {label: {"ratio": statistics.median(r["ratio"][label] for r in ok) if ok else None,
                          "ms": statistics.median(r["ms"][label] for r in ok) if ok else None,
                          "check": max((r["check"].get(label, 0.0) for r in ok), default=None)}
                  for label in args.configs}
        out[t]["backward"] = {"ms": statistics.median(r["backward_ms"] for r in ok) if ok else None,
                              "rounds": [r["rounds"] for r in ok], "errors": [r["error"] for r in runs[t] if "error" in r]}
    return out


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- report


def _f(v, fmt: str = "{:.2f}") -> str:
    return "" if v is None else fmt.format(v)


def markdown(results: list, trees: list) -> str:
    """One table per (problem, extension): per tree peak MiB, peak / unchunked, time / backward."""
    blocks = []
    for r in results:
        mem, tim = r["memory"], r["time"]
        head = "| setting | " + " | ".join(
            f"{t} MiB | {t} / unchunked | {t} time / backward" for t in trees)
        head += " | " + " | ".join(f"MiB {t} / {trees[0]}" for t in trees[1:])
        head += " | " + " | ".join(f"time {t} / {trees[0]}" for t in trees[1:]) + " |"
        lines = [f"#### {r['problem']}, {r['ext']} (backward {_f(tim[trees[-1]]['backward']['ms'])} ms)", "",
                 head, "|---|" + "---:|" * (3 * len(trees) + 2 * (len(trees) - 1))]
        for label in r["configs"]:
            cells = []
            for t in trees:
                m, u = mem[t][label]["mib"], mem[t]["unchunked"]["mib"]
                ratio = tim[t][label]["ratio"]
                bad = mem[t][label]["error"] if m is None else ""
                cells += [_f(m, "{:.0f}") or bad, _f(m / u if m is not None and u else None), _f(ratio)]
            for t in trees[1:]:
                a, b = mem[t][label]["mib"], mem[trees[0]][label]["mib"]
                cells.append(_f(a / b if a is not None and b else None))
            for t in trees[1:]:
                a, b = tim[t][label]["ratio"], tim[trees[0]][label]["ratio"]
                cells.append(_f(a / b if a is not None and b else None))
            lines.append(f"| `{label}` | " + " | ".join(cells) + " |")
        checks = {t: max((tim[t][c]["check"] or 0.0 for c in r["configs"]), default=0.0) for t in trees}
        if r["ext"] in DETERMINISTIC:
            lines += ["", "largest relative difference to the unchunked result: "
                      + ", ".join(f"{t} {v:.1e}" for t, v in checks.items())]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def main(argv=None) -> int:
    from problems import DEFAULT_PROBLEMS, PROBLEMS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--problems", nargs="+", default=list(DEFAULT_PROBLEMS), choices=list(PROBLEMS))
    parser.add_argument("--extensions", nargs="+", default=list(EXTENSIONS))
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--tree", action="append", default=None, metavar="LABEL=SRC",
                        help="a curvlib source tree to measure (repeatable; default: this=<repo>/src); "
                             "ratios between trees are taken against the first")
    parser.add_argument("--memory-repeats", type=int, default=2)
    parser.add_argument("--time-repeats", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--budget", type=float, default=60.0, help="seconds of timed rounds per process")
    parser.add_argument("--no-time", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    if args.child is not None:
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        _child(json.loads(args.child))
        return 0
    if "unchunked" not in args.configs:
        args.configs = ["unchunked"] + args.configs
    trees = dict(t.split("=", 1) for t in (args.tree or [f"this={os.path.join(ROOT, 'src')}"]))
    t_start, results = time.perf_counter(), []
    for problem in args.problems:
        for ext in args.extensions:
            results.append({"problem": problem, "ext": ext, "configs": args.configs,
                            "memory": measure_memory(trees, problem, ext, args),
                            "time": ({t: {c: {"ratio": None, "ms": None, "check": None} for c in args.configs}
                                      | {"backward": {"ms": None}} for t in trees}
                                     if args.no_time else measure_time(trees, problem, ext, args))})
    return _write(results, trees, args, time.perf_counter() - t_start)


def _write(results: list, trees: dict, args, elapsed: float) -> int:
    import platform

    import torch

    header = (f"Memory knobs: peak MiB above a process that only built the problem (median of "
              f"{args.memory_repeats} fresh processes), time / plain backward (median of {args.time_repeats} "
              f"processes, up to {args.rounds} rounds each). torch {torch.__version__}, Python "
              f"{platform.python_version()}, {os.cpu_count()} logical cores, {torch.get_num_threads()} torch threads, "
              f"CPU, float32. Trees: " + ", ".join(f"{t} = `{s}`" for t, s in trees.items())
              + f". Whole run: {elapsed / 60:.1f} min.")
    text = header + "\n\n" + markdown(results, list(trees))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "memory-knobs-cpu.md"), "w") as fh:
        fh.write(text + "\n")
    with open(os.path.join(args.out, "memory-knobs-cpu.json"), "w") as fh:
        json.dump({"args": vars(args), "trees": trees, "results": results}, fh, indent=0)
    print(text)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.exit(main())
