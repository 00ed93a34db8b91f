"""Time curvlib's extensions against a plain backward pass and against peer libraries.

    python benchmarks/run.py                       # the whole suite (CPU: about 12 minutes)
    python benchmarks/run.py --problems mlp 3c3d --methods BatchGrad "backpack:BatchGrad"
    python benchmarks/run.py --device cuda --out benchmarks/results/cuda

For every problem (:data:`problems.PROBLEMS`), every method (:data:`problems.METHODS`;
peers are skipped with a printed reason when their package is missing) is set up
once and called ``--warmup`` times (the first call, which for curvlib includes
tracing and planning, is reported as "first call"; peers' values are checked
against curvlib's there). Then come the timed rounds: each round calls every
method once, in a freshly shuffled order, so that drifts in machine load hit all
methods alike; the number of rounds is ``--rounds``, lowered to fit ``--budget``
seconds per problem (never below ``--min-rounds``). Reported per method: the median
time and its ratio to the median of ``"backward"`` (``zero_grad`` +
``lossfn(model(X), y).backward()``) over the same rounds; next to ``[N, *p]``- and
``[C, N, *p]``-sized results the physical bound (backward + writing that many
floats once, timed in the same rounds). Then, unless ``--no-memory``, each
method's peak memory: a fresh process per method (forked from a server that has
only imported the libraries) builds the problem, sets the method up and calls it
once; reported is its ``ru_maxrss`` (CUDA: ``torch.cuda.max_memory_allocated``)
minus that of a baseline process that only builds the problem. Then a sweep over
the number of classes C on the MLP for the exact quantities (``--sweep-classes``).
Methods that refuse (``CurvatureError``, a peer's ``NotImplementedError``, ...) are
reported, not fatal. Writes ``results-<device>.json``, ``results-<device>.md`` and
``results-<device>.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import signal
import statistics
import sys
import time
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from problems import (
    DEFAULT_METHODS,
    INFO,
    METHODS,
    PEER_PACKAGES,
    DEFAULT_PROBLEMS,
    GPU_PROBLEMS,
    PROBLEMS,
    outputs_per_sample,
)

HERE = os.path.dirname(os.path.abspath(__file__))

#: Peer ratios quoted in issue 5 (this machine's CPU, 2 threads, torch 2.13), for reference.
ISSUE_PEERS = {
    ("mlp", "BatchGrad"): "BP 14.6, func 16.2, Opacus 34.8",
    ("mlp", "BatchL2Grad"): "BP 2.7",
    ("mlp", "SumGradSquared"): "BP 2.7",
    ("mlp", "Variance"): "BP 3.4",
    ("mlp", "DiagGGNExact"): "BP 4.2",
    ("mlp", "DiagGGNMC"): "BP 3.8",
    ("mlp", "DiagHessian"): "BP 4.5",
    ("mlp", "KFAC"): "BP 4.8",
    ("mlp", "KFLR"): "BP 6.9",
    ("mlp", "KFRA"): "BP 5.5",
    ("3c3d", "BatchGrad"): "BP 4.3, func 2.1, Opacus 3.1",
    ("3c3d", "BatchL2Grad"): "BP 1.8",
    ("3c3d", "SumGradSquared"): "BP 4.0",
    ("3c3d", "Variance"): "BP 6.9",
    ("3c3d", "DiagGGNExact"): "BP 9.8",
    ("3c3d", "DiagGGNMC"): "BP 2.4",
    ("3c3d", "BatchDiagGGNExact"): "BP 10.7",
    ("3c3d", "DiagHessian"): "BP 10.2",
    ("3c3d", "KFAC"): "BP 3.2, CL(MC) 2.4",
    ("3c3d", "KFLR"): "BP 6.2, CL(type-2) 7.5",
}
#: Absolute caps from issue 5 (ratio to backward), on top of "0.8x the fastest peer".
CAPS = {"BatchL2Grad": (1.5, ("mlp", "3c3d")), "SumGradSquared": (1.5, ("mlp", "3c3d")),
        "Variance": (1.5, ("mlp", "3c3d")), "DiagGGNMC": (2.0, None), "KFAC": (2.0, None)}
#: Issue 11's caps for one problem (override CAPS there): KFAC/KFLR <= 3x a backward on the GPT.
PROBLEM_CAPS = {("gpt", "KFAC"): 3.0, ("gpt", "KFLR"): 3.0, ("gpt-v16", "KFAC"): 3.0, ("gpt-v16", "KFLR"): 3.0}
#: Quantities that backpropagate every one of the C output columns per sample (the exact GGN
#: family): skipped when C > --max-columns (a GPT's logits [V, T] give C = V*T columns).
ALL_COLUMNS = ("DiagGGNExact", "BatchDiagGGNExact", "DiagHessian", "BatchDiagHessian", "KFLR", "KFRA",
               "SqrtGGNExact")
#: The exact quantities swept over the number of classes.
SWEEP = ("DiagGGNExact", "BatchDiagGGNExact", "KFLR", "SqrtGGNExact", "DiagHessian")
SHORT = {"backpack": "BP", "torch.func": "func", "opacus": "Opacus", "curvlinops": "CL"}


# --------------------------------------------------------------------------- environment


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: str) -> dict[str, object]:
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
    for pkg in PEER_PACKAGES.values():
        try:
            from importlib.metadata import version

            env[pkg] = version(pkg)
        except Exception:  # noqa: BLE001 - not installed
            env[pkg] = None
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


def _why(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:160]


def _missing_package(err: ImportError) -> str:
    name = (getattr(err, "name", None) or str(err)).split(".")[0]
    pkg = PEER_PACKAGES.get(name, name)
    return f"skipped: {name} not installed (pip install --no-deps {pkg})"


def kfra_dense_bytes(problem, element_size: int = 4) -> int:
    """Bytes of the largest dense ``[d, d]`` matrix KFRA forms (``d`` = a layer's output numel per sample)."""
    sizes = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: sizes.append(out[:1].numel()))
             for m in problem.model.modules() if isinstance(m, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d))]
    try:
        with torch.no_grad():
            problem.model(problem.X[:1])
    finally:
        for h in hooks:
            h.remove()
    return max(sizes, default=0) ** 2 * element_size


def method_quantity(method: str) -> str:
    """The curvlib extension a method computes: ``INFO``'s quantity, else the name before ``[``."""
    info = INFO.get(method)
    return (info.quantity if info is not None and info.quantity else method.split("[")[0].split(":")[-1])


def too_many_columns(problem, method: str, max_columns: int) -> str | None:
    """The skip reason when ``method`` backpropagates all ``C`` output columns and ``C > max_columns``."""
    # curvlinops' type-2 backpropagates V columns with the positions summed, not V*T: not bounded here.
    if method_quantity(method) not in ALL_COLUMNS or method.startswith("curvlinops:"):
        return None
    with torch.no_grad():
        shape = tuple(problem.model(problem.X[:1]).shape[1:])
    columns = math.prod(shape)
    if columns <= max_columns:
        return None
    return (f"skipped: backpropagates all C = {columns} output columns per sample (output {list(shape)}) "
            f"> --max-columns {max_columns}")


def result_bytes(problem, method: str, element_size: int = 4) -> int:
    """Bytes of a method's result when it is ``[N, *p]`` or ``[C, N, *p]``; 0 otherwise."""
    size = INFO[method].size if method in INFO else ""
    if not size:
        return 0
    total = problem.X.shape[0] * sum(p.numel() for p in problem.model.parameters() if p.requires_grad)
    if size == "CN":
        total *= outputs_per_sample(problem)
    return total * element_size


# --------------------------------------------------------------------------- checks


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, dict):
        out = list(out.values())
    flat = []
    for v in out:
        flat += _flat(v) if isinstance(v, (list, tuple, dict)) else [v]
    return flat


def compare(out, ref) -> str:
    """"ok" when every tensor agrees to float32 tolerance, else "differs (...)"."""
    a, b = _flat(out), _flat(ref)
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return "differs (layout)"
    # Scale per tensor, floored at 1e-4 of the largest entry overall: a quantity that is zero
    # in exact arithmetic (e.g. the gradient of an attention key bias) is round-off in both.
    floor = 1e-4 * max((y.abs().max().item() for y in b if y.numel()), default=1.0)
    worst = 0.0
    for x, y in zip(a, b):
        scale = max(y.abs().max().item() if y.numel() else 0.0, floor) or 1.0
        worst = max(worst, (x.detach() - y.detach()).abs().max().item() / scale)
    return "ok" if worst < 1e-3 else f"differs (rel {worst:.1e})"


# --------------------------------------------------------------------------- timing


class FirstCallTimeout(Exception):
    """A method's setup and first call took longer than ``--first-call-timeout``."""


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise :class:`FirstCallTimeout` in the main thread after ``seconds`` (SIGALRM; 0 or
    no SIGALRM: no limit). Torch's kernels are short, so the signal lands between them."""
    if not seconds or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum, frame):
        raise FirstCallTimeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)



class _AtenCounter(TorchDispatchMode):
    """Counts the aten operator calls that reach the dispatcher (views and factories
    included), a device-independent proxy for a GPU's kernel-launch overhead, and among
    them the host reads of a device value (``aten._local_scalar_dense``: ``.item()``,
    ``float(t)``, ``bool(t)``), each a sync that stalls a GPU's launch queue."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        self.syncs += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def op_counts(run) -> tuple[int | str, int | str]:
    """``(aten operator calls, host syncs)`` of one call of ``run`` (untimed, after warm-up)."""
    counter = _AtenCounter()
    try:
        with counter:
            out = run()
    except Exception as err:  # noqa: BLE001 - a method that does not run under a dispatch mode
        return "n/a (" + _why(err)[:40] + ")", ""
    del out
    return counter.calls, counter.syncs


def aten_ops(run) -> int | str:
    """Aten operator calls of one call of ``run`` (untimed, after warm-up)."""
    return op_counts(run)[0]


def bench_problem(name: str, methods: list[str], args, bar=None, build_kwargs: dict | None = None) -> list[dict]:
    """Rows ``{problem, method, median_ms, ratio, first_call_ms, times_ms, check}`` for one problem."""
    problem = PROBLEMS[name](device=args.device, seed=args.seed, **(build_kwargs or {}))
    label = name if not build_kwargs else f"{name}[{','.join(f'{k}={v}' for k, v in build_kwargs.items())}]"
    now = _timer(args.device)
    runs, first, status, checks, ops, syncs = {}, {}, {}, {}, {}, {}
    refs: dict[str, object] = {}
    for m in methods:
        if bar is not None:
            bar.set_description(f"{label}: setup {m}"[:48])
        nbytes = result_bytes(problem, m)
        if nbytes > args.max_result_gb * 2**30:
            status[m] = f"skipped: result {nbytes / 2**30:.1f} GiB > --max-result-gb {args.max_result_gb}"
            continue
        columns = too_many_columns(problem, m, args.max_columns)
        if columns is not None:
            status[m] = columns
            continue
        if m == "backpack:KFRA" and kfra_dense_bytes(problem) > args.max_result_gb * 2**30:
            # BackPACK builds it and runs out of memory (the process is killed, nothing to catch).
            status[m] = (f"skipped: BackPACK's KFRA forms a dense {kfra_dense_bytes(problem) / 2**30:.0f} GiB "
                         "matrix at a convolution output (out of memory)")
            continue
        try:
            with _time_limit(args.first_call_timeout):
                runs[m] = METHODS[m](problem)
                torch.manual_seed(args.seed)
                t0 = now()
                out = runs[m]()
                first[m] = now() - t0
        except FirstCallTimeout:
            status[m] = f"skipped: setup and first call did not finish in --first-call-timeout {args.first_call_timeout:g} s"
        except ImportError as err:
            status[m] = _missing_package(err)
        except Exception as err:  # noqa: BLE001 - a refusal (CurvatureError) or a peer's limitation
            status[m] = "refused: " + _why(err)
        if m in status:
            runs.pop(m, None)
            continue
        info = INFO.get(m)
        if info is not None and info.check:
            if info.library == "curvlib":
                refs[info.quantity] = out
            elif info.quantity in refs:
                try:
                    checks[m] = compare(info.post(problem, out) if info.post else out, refs[info.quantity])
                except Exception as err:  # noqa: BLE001 - a layout the check does not understand
                    checks[m] = "differs (" + _why(err)[:60] + ")"
        del out
        if first[m] < args.slow_s:
            for _ in range(args.warmup - 1):
                runs[m]()
        ops[m], syncs[m] = op_counts(runs[m]) if args.count_ops else ("", "")
    refs.clear()
    methods = [m for m in methods if m in runs]
    per_round = sum(first[m] for m in methods)
    rounds = max(args.min_rounds, min(args.rounds, int(args.budget / max(per_round, 1e-9))))
    if bar is not None:
        bar.total += rounds * len(methods)
        bar.set_description(f"{label}: {rounds} rounds"[:48])
        bar.refresh()
    times: dict[str, list[float]] = {m: [] for m in methods}
    order = list(methods)
    rng = random.Random(args.seed)
    for _ in range(rounds):
        rng.shuffle(order)
        for m in order:
            t0 = now()
            out = runs[m]()
            times[m].append(now() - t0)
            del out
            if bar is not None:
                bar.update(1)
    ref = statistics.median(times["backward"])
    rows = []
    for m in methods:
        med = statistics.median(times[m])
        rows.append({
            "problem": label, "method": m, "median_ms": 1e3 * med, "ratio": med / ref,
            "first_call_ms": 1e3 * first[m], "rounds": rounds, "check": checks.get(m, ""), "aten_ops": ops.get(m, ""),
            "host_syncs": syncs.get(m, ""),
            "times_ms": [round(1e3 * t, 4) for t in times[m]],
        })
    for m, why in status.items():
        rows.append({"problem": label, "method": m, "refused": why})
    return rows


# --------------------------------------------------------------------------- memory


def _peak_child(name: str, method: str | None, device: str, seed: int, kwargs: dict) -> float:
    """In a fresh process: build the problem (and run ``method`` once); peak memory in MiB."""
    import resource

    warnings.filterwarnings("ignore")
    prewarm()  # curvlib's lazy imports (fx, fake tensors) are paid here, in baseline and method alike
    problem = PROBLEMS[name](device=device, seed=seed, **kwargs)
    cuda = device.startswith("cuda")
    if method is not None:
        torch.manual_seed(seed)
        out = METHODS[method](problem)()
        del out
    if cuda:
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def peak_memory(name: str, methods: list[str], args, bar=None, build_kwargs=None) -> dict[str, object]:
    """``method -> peak MiB above the baseline process`` (or an error string)."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "curvlib", "problems"] + [lib for lib in PEER_PACKAGES])
    kwargs = build_kwargs or {}

    def one(method):
        with ctx.Pool(1) as pool:
            return pool.apply(_peak_child, (name, method, args.device, args.seed, kwargs))

    base = one(None)
    out: dict[str, object] = {}
    for m in methods:
        if bar is not None:
            bar.set_description(f"{name}: memory {m}"[:48])
        try:
            out[m] = one(m) - base
        except Exception as err:  # noqa: BLE001
            out[m] = "failed: " + _why(err)
        if bar is not None:
            bar.update(1)
    return out


# --------------------------------------------------------------------------- reports


def _ok(r: dict) -> bool:
    return "refused" not in r


def _index(rows: list[dict]) -> dict[tuple, dict]:
    return {(r["problem"], r["method"]): r for r in rows}


def _bound_for(idx, problem: str, method: str) -> float | None:
    size = INFO[method].size if method in INFO else ""
    r = idx.get((problem, {"N": "bound:BatchGrad", "CN": "bound:SqrtGGNExact"}.get(size, "")))
    return r["ratio"] if r is not None and _ok(r) else None


def _num(v: float | None) -> str:
    return "" if v is None else f"{v:.2f}"


def _mem(r: dict | None) -> str:
    v = None if r is None else r.get("peak_mib")
    return f"{v:.0f}" if isinstance(v, (int, float)) else ""


def markdown_full(rows: list[dict]) -> str:
    idx = _index(rows)
    lines = ["| problem | method | median ms | ratio to backward | bound | peak MiB | first call ms | aten ops | "
             "host syncs | check |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['problem']} | {r['method']} | {r['refused']} | | | | | | | |")
            continue
        b = _bound_for(idx, r["problem"], r["method"]) if not r["method"].startswith("bound") else None
        lines.append(
            f"| {r['problem']} | {r['method']} | {r['median_ms']:.2f} | {r['ratio']:.2f} | "
            f"{_num(b)} | {_mem(r)} | {r['first_call_ms']:.1f} | {r.get('aten_ops', '')} | "
            f"{r.get('host_syncs', '')} | {r.get('check', '')} |"
        )
    return "\n".join(lines)


def summary(rows: list[dict]) -> list[dict]:
    """One entry per (problem, curvlib extension): ratio, bound, peers, target, verdict."""
    idx = _index(rows)
    problems = list(dict.fromkeys(r["problem"] for r in rows))
    out = []
    for p in problems:
        for m, info in INFO.items():
            if info.library != "curvlib" or (p, m) not in idx:
                continue
            r = idx[(p, m)]
            peers = {}
            for pm, pinfo in INFO.items():
                if pinfo.quantity == m and pinfo.library not in ("curvlib", "bound") and (p, pm) in idx:
                    peers[pm] = idx[(p, pm)]
            entry = {"problem": p, "quantity": m, "row": r, "peers": peers,
                     "bound": _bound_for(idx, p, m), "issue": ISSUE_PEERS.get((p, m), "")}
            valid = [q["ratio"] for q in peers.values() if _ok(q) and not q.get("check", "").startswith("differs")]
            target = None
            if valid:
                target = 0.8 * min(valid)
            if target is not None and entry["bound"] is not None and target < entry["bound"]:
                target = 1.25 * entry["bound"]
            cap = (PROBLEM_CAPS[(p, m)], None) if (p, m) in PROBLEM_CAPS else CAPS.get(m)
            if cap is not None and (cap[1] is None or p in cap[1]):
                target = cap[0] if target is None else min(target, cap[0])
            entry["target"] = target
            if not _ok(r):
                entry["meets"] = "refused"
            elif target is None:
                entry["meets"] = "no peer"
            else:
                entry["meets"] = "yes" if r["ratio"] <= target else f"no ({r['ratio'] / target:.2f}x)"
            bp = peers.get(f"backpack:{m}")
            cm, bm = (r.get("peak_mib") if _ok(r) else None), (bp.get("peak_mib") if bp and _ok(bp) else None)
            entry["memory"] = ("" if not isinstance(cm, (int, float)) or not isinstance(bm, (int, float))
                               else ("≤ BP" if cm <= bm + 2 else f"> BP ({cm:.0f}/{bm:.0f})"))
            out.append(entry)
    return out


def markdown_summary(entries: list[dict]) -> str:
    lines = ["| problem | extension | curvlib | bound | peers (this run) | target | issue's peers | meets | memory | MiB curvlib/BP |",
             "|---|---|---:|---:|---|---:|---|---|---|---|"]
    for e in entries:
        r = e["row"]
        cur = f"{r['ratio']:.2f}" if _ok(r) else r["refused"].split(":")[0]
        peers = []
        for pm, q in e["peers"].items():
            lib = SHORT.get(INFO[pm].library, INFO[pm].library)
            tag = pm.split(":", 1)[1] if INFO[pm].library == "curvlinops" else ""
            name = f"{lib}{'(' + tag.split('(')[1] if '(' in tag else ''}"
            if _ok(q):
                val = f"{q['ratio']:.2f}" + (" ≠" if q.get("check", "").startswith("differs") else "")
            else:
                val = q["refused"].split(":")[0]
            peers.append(f"{name} {val}")
        bp = e["peers"].get(f"backpack:{e['quantity']}")
        mem = f"{_mem(r)}/{_mem(bp) if bp else ''}"
        lines.append(
            f"| {e['problem']} | {e['quantity']} | {cur} | {_num(e['bound'])} | "
            f"{', '.join(peers)} | {_num(e['target'])} | {e['issue']} | "
            f"{e['meets']} | {e['memory']} | {mem} |"
        )
    return "\n".join(lines)


def markdown_sweep(rows: list[dict], classes: list[int]) -> str:
    idx = _index(rows)
    methods = list(dict.fromkeys(r["method"] for r in rows if r["method"] != "backward"))
    head = "| method | " + " | ".join(f"C={c} ratio (ms)" for c in classes)
    head += f" | time C={classes[-1]} / C={classes[0]} | linear would be |"
    lines = [head, "|---|" + "---:|" * (len(classes) + 2)]
    b = [idx.get((f"mlp[classes={c}]", "backward")) for c in classes]
    lines.append("| backward | " + " | ".join(f"1.00 ({x['median_ms']:.2f})" if x else "" for x in b)
                 + f" | {b[-1]['median_ms'] / b[0]['median_ms']:.2f} | |" if b[0] and b[-1] else "")
    for m in methods:
        cells, ms = [], []
        for c in classes:
            r = idx.get((f"mlp[classes={c}]", m))
            if r is None or not _ok(r):
                cells.append("" if r is None else r["refused"].split(":")[0])
                ms.append(None)
            else:
                cells.append(f"{r['ratio']:.2f} ({r['median_ms']:.2f})")
                ms.append(r["median_ms"])
        growth = f"{ms[-1] / ms[0]:.2f}" if ms[0] and ms[-1] else ""
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {growth} | {classes[-1] / classes[0]:.0f} |")
    return "\n".join(lines)


def plot(entries: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    problems = list(dict.fromkeys(e["problem"] for e in entries))
    libs = ["curvlib", "backpack", "torch.func", "opacus", "curvlinops"]
    colors = {"curvlib": "tab:blue", "backpack": "tab:orange", "torch.func": "tab:green",
              "opacus": "tab:red", "curvlinops": "tab:purple"}
    fig, axes = plt.subplots(len(problems), 1, figsize=(11, 2.6 * len(problems)), squeeze=False)
    for ax, p in zip(axes[:, 0], problems):
        es = [e for e in entries if e["problem"] == p]
        width = 0.8 / len(libs)
        for i, e in enumerate(es):
            bars = {"curvlib": e["row"]}
            for pm, q in e["peers"].items():
                lib = INFO[pm].library
                if lib not in bars or (_ok(q) and (not _ok(bars[lib]) or q["ratio"] < bars[lib]["ratio"])):
                    bars[lib] = q
            for j, lib in enumerate(libs):
                r = bars.get(lib)
                if r is not None and _ok(r):
                    ax.bar(i - 0.4 + (j + 0.5) * width, r["ratio"], width, color=colors[lib],
                           label=lib if i == 0 or lib not in ax.get_legend_handles_labels()[1] else None)
            if e["bound"] is not None:
                ax.hlines(e["bound"], i - 0.45, i + 0.45, colors="k", linestyles="dotted",
                          label="bound" if "bound" not in ax.get_legend_handles_labels()[1] else None)
            if e["target"] is not None:
                ax.hlines(e["target"], i - 0.45, i + 0.45, colors="tab:gray", linewidth=1,
                          label="target" if "target" not in ax.get_legend_handles_labels()[1] else None)
        ax.set_yscale("log")
        ax.axhline(1.0, color="k", linewidth=0.5)
        ax.set_xticks(range(len(es)))
        ax.set_xticklabels([e["quantity"] for e in es], rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("time / backward")
        ax.set_title(p, fontsize=9, loc="left")
        ax.legend(fontsize=6, ncol=7, loc="upper left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", nargs="+", default=list(DEFAULT_PROBLEMS), choices=list(PROBLEMS),
                        help="default: the CPU set; also " + ", ".join(GPU_PROBLEMS) + " (issue 12's GPU sizes)")
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=list(METHODS),
                        help="methods to time ('backward' is always added: it is the reference); "
                             "default: every curvlib extension, every peer, the bounds")
    parser.add_argument("--rounds", type=int, default=30, help="at most this many timed rounds per problem")
    parser.add_argument("--min-rounds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=45.0,
                        help="seconds of timed rounds per problem (rounds are lowered to fit, down to --min-rounds)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per method before the rounds")
    parser.add_argument("--slow-s", type=float, default=0.3, help="no further warm-up when the first call took longer")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch.get_num_threads())")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-result-gb", type=float, default=1.5,
                        help="skip methods whose [N, *p] / [C, N, *p] result is larger (GiB)")
    parser.add_argument("--max-columns", type=int, default=1024,
                        help="skip the exact GGN family (every output column backpropagated) when a sample's "
                             "output has more entries (the GPT's [V, T] logits: 16384)")
    parser.add_argument("--first-call-timeout", type=float, default=180.0,
                        help="skip a method whose setup and first call take longer (seconds; 0: no limit)")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-method peak-memory processes")
    parser.add_argument("--no-count-ops", dest="count_ops", action="store_false",
                        help="skip counting each method's aten operator calls (one untimed call under a dispatch mode)")
    parser.add_argument("--sweep-classes", type=int, nargs="*", default=[10, 20, 50, 100],
                        help="numbers of classes for the MLP sweep of the exact quantities (none: no sweep)")
    parser.add_argument("--sweep-rounds", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for JSON, markdown and PNG")
    parser.add_argument("--json", default=None, help="also write the JSON here")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 1 or args.min_rounds < 1:
        parser.error("--rounds, --min-rounds and --warmup must be at least 1")
    from tqdm import tqdm

    threads_source = "default torch.get_num_threads()"
    if args.threads is not None:
        torch.set_num_threads(args.threads)
        threads_source = "--threads"
    methods = ["backward"] + [m for m in args.methods if m != "backward"]
    env = environment(args.device)
    t_start = time.perf_counter()
    header = [
        f"torch {env['torch']}, curvlib {env['curvlib']}, python {env['python']}; peers: "
        + ", ".join(f"{pkg} {env[pkg] or 'not installed'}" for pkg in PEER_PACKAGES.values()),
        f"CPU: {env['cpu']} ({env['cpu_count']} logical cores), torch threads: {env['threads']} ({threads_source})",
    ]
    if env["load_average_1min_at_start"] is not None:
        header.append(f"load average (1 min) at start: {env['load_average_1min_at_start']:.2f}")
    if "gpu" in env:
        header.append(f"GPU: {env['gpu']}")
    header.append(f"device {args.device}, float32, up to {args.rounds} rounds (budget {args.budget:.0f} s per problem, "
                  f"at least {args.min_rounds}) after {args.warmup} warm-up call(s), shuffled order per round")
    print("\n".join(header), flush=True)

    prewarm()
    rows: list[dict] = []
    sweep_rows: list[dict] = []
    bar = tqdm(total=0, unit="call", dynamic_ncols=True, file=sys.stderr)
    for name in args.problems:
        prob_rows = bench_problem(name, methods, args, bar)
        if not args.no_memory:
            ok = [r["method"] for r in prob_rows if _ok(r)]
            bar.total += len(ok)
            mem = peak_memory(name, ok, args, bar)
            for r in prob_rows:
                if r["method"] in mem:
                    r["peak_mib"] = mem[r["method"]]
        rows += prob_rows
    classes = args.sweep_classes or []
    if classes:
        sweep_methods = ["backward"] + [m for m in METHODS if INFO[m].quantity in SWEEP
                                        and INFO[m].library in ("curvlib", "backpack")]
        sargs = argparse.Namespace(**{**vars(args), "rounds": args.sweep_rounds, "min_rounds": min(args.min_rounds, args.sweep_rounds)})
        for c in classes:
            sweep_rows += bench_problem("mlp", sweep_methods, sargs, bar, {"classes": c})
    bar.close()
    elapsed = time.perf_counter() - t_start

    entries = summary(rows)
    tag = args.device.replace(":", "")
    os.makedirs(args.out, exist_ok=True)
    md = ["\n".join(header), f"whole run: {elapsed / 60:.1f} min", "", "### Summary (ratio = time / plain backward, same rounds)", "",
          markdown_summary(entries), "", "### All methods", "", markdown_full(rows)]
    if classes:
        md += ["", "### Exact quantities vs number of classes C (MLP 784-128-128-C, N=128)", "",
               markdown_sweep(sweep_rows, classes)]
    text = "\n".join(md)
    print("\n" + text)
    paths = {"md": os.path.join(args.out, f"results-{tag}.md"), "json": os.path.join(args.out, f"results-{tag}.json"),
             "png": os.path.join(args.out, f"results-{tag}.png")}
    with open(paths["md"], "w") as fh:
        fh.write(text + "\n")
    payload = {"environment": env, "args": vars(args), "elapsed_s": elapsed, "results": rows, "sweep": sweep_rows,
               "summary": [{k: v for k, v in e.items() if k not in ("row", "peers")} for e in entries]}
    for path in filter(None, [paths["json"], args.json]):
        with open(path, "w") as fh:
            json.dump(payload, fh, indent=0)
    if not args.no_plot:
        try:
            plot(entries, paths["png"], f"{env['cpu'] if 'gpu' not in env else env['gpu']}, torch {env['torch']}, "
                 f"{env['threads']} threads, {args.device}")
        except ImportError as err:
            print(f"no plot: {err} (pip install matplotlib)")
            paths.pop("png")
    print("\nwrote " + ", ".join(paths.values()) + (f", {args.json}" if args.json else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
