"""The ecosystem sweep: every architecture of transformers, timm, torchvision (and PEFT) built tiny
and checked against float64 brute force, bare and behind a one-line wrapper.

    python benchmarks/ecosystem_sweep.py [--libraries transformers timm torchvision peft]
        [--groups first_order ggn kflr hessian] [--only SUBSTRING] [--limit K] [--timeout 120]
        [--jobs 1] [--out benchmarks/results/cpu/ecosystem-sweep.md]

The problems are ``tests/oracles/ecosystem.py``'s (random weights from config objects, nothing
downloaded); each (problem, variant) runs in a fresh forked process (``oracles.ecosystem_checks
.run_case``) with ``--timeout`` seconds per group and a hard limit for the whole process. Writes
the Markdown report (``benchmarks/ecosystem_report.py``) and the raw results as JSON beside it
(same name, ``.json``). ``--only`` keeps names containing the substring, ``--limit`` the first
K per library.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import torchvision_shim  # noqa: E402  (before transformers, timm, torchvision import it)

torchvision_shim.install()

from oracles import ecosystem, ecosystem_checks  # noqa: E402
from ecosystem_report import write_report  # noqa: E402


def preload(libraries):
    """Import the libraries once in this process, so that every forked case starts warm."""
    for mod in ("transformers", "transformers.models.auto.modeling_auto", "timm", "torchvision.models", "peft"):
        try:
            __import__(mod)
        except ImportError:
            pass
    if "transformers" in libraries:
        from transformers import CONFIG_MAPPING  # noqa: F401  (resolves the lazy config table)
    if "timm" in libraries:
        ecosystem.names("timm")  # caches timm's family table
    if "peft" in libraries or "transformers" in libraries:
        # one traced call (ATen front end) loads torch's tracing modules before any fork
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ecosystem_checks.call_times(ecosystem.build("peft/lora_gpt2", "wrapped"), 120)


MEMORY_GB = [8]  # address-space limit of each case's process (--memory-gb)


def _child(conn, name, variant, groups, limit):
    import resource  # POSIX only, as the fork itself

    cap = MEMORY_GB[0] * 2**30
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))  # a brute force past it fails alone, not the machine
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    try:
        import transformers  # optional dependency: quiet its config warnings

        transformers.logging.set_verbosity_error()
    except ImportError:
        pass
    try:
        conn.send(ecosystem_checks.run_case(name, variant, groups, limit))
    except BaseException as e:  # noqa: BLE001 - reported as the case's crash
        conn.send({"name": name, "variant": variant, "groups": {},
                   "ineligible": f"sweep: {type(e).__name__}: {str(e)[:200]}"})
    conn.close()


def _hard_limit(groups, limit):
    return limit * (len(groups) + 2) + 60


def _finish(task, proc, conn, groups, killed):
    name, variant = task
    res = conn.recv() if not killed and conn.poll() else None
    if res is None:
        res = {"name": name, "variant": variant, "ineligible": None, "groups": {
            g: {"outcome": "timeout", "detail": "process killed at the hard limit" if killed
                else f"process died (exit code {proc.exitcode})", "seconds": None} for g in groups}}
    return res


def run_all(tasks, groups, limit, jobs, log):
    """Run every ``(name, variant)`` in a forked process, ``jobs`` at a time."""
    ctx = mp.get_context("fork")
    pending, active, results = list(tasks), [], []
    while pending or active:
        while pending and len(active) < jobs:
            task = pending.pop(0)
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(child, *task, groups, limit))
            proc.start()
            child.close()
            active.append((task, proc, parent, time.time()))
        time.sleep(0.05)
        for item in list(active):
            task, proc, conn, started = item
            ready = conn.poll()
            killed = not ready and proc.is_alive() and time.time() - started > _hard_limit(groups, limit)
            if ready or killed or not proc.is_alive():
                if killed:
                    proc.kill()
                res = _finish(task, proc, conn, groups, killed)
                proc.join(5)
                res["wall_s"] = round(time.time() - started, 1)
                results.append(res)
                active.remove(item)
                log(res)
    return results


def _log(res, partial=None):
    if partial:
        with open(partial, "a") as fh:
            fh.write(json.dumps(res) + "\n")
    cells = " ".join(f"{g}={r['outcome']}" for g, r in res["groups"].items())
    print(f"{res['name']}\t{res['variant']}\t{res.get('ineligible') or cells}\t{res.get('wall_s')}s", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--libraries", nargs="+", default=ecosystem.LIBRARIES, choices=ecosystem.LIBRARIES)
    ap.add_argument("--groups", nargs="+", default=["first_order", "ggn", "kflr"])
    ap.add_argument("--variants", nargs="+", default=ecosystem.VARIANTS, choices=ecosystem.VARIANTS)
    ap.add_argument("--float64-experts", action="store_true",
                    help="check a float32-only model on its float64 experts path (transformers' batched_mm or "
                         "eager) at the float64 tolerance, instead of its float32 original against that path")
    ap.add_argument("--only", nargs="+", default=None, help="the classes whose name holds one of these strings")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=120)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--memory-gb", type=float, default=8, help="address-space limit per case (default 8)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu", "ecosystem-sweep.md"))
    ap.add_argument("--resume", action="store_true",
                    help="keep <out>.partial.jsonl and skip the cases it has")
    ap.add_argument("--interleave", action="store_true",
                    help="take the classes round-robin over libraries and mappings (a stopped run samples each)")
    ap.add_argument("--note", default="", help="a paragraph for the report's header (e.g. what a stopped run covers)")
    ap.add_argument("--report-from", default=None, metavar="JSONL",
                    help="only write the report from the cases a (possibly stopped) run logged, <out>.partial.jsonl")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    MEMORY_GB[0] = args.memory_gb
    ecosystem.TWIN[0] = "float64" if args.float64_experts else "float32"  # (the forked cases inherit it)
    partial = os.path.splitext(args.out)[0] + ".partial.jsonl"
    if args.report_from:
        with open(args.report_from) as fh:
            results = [json.loads(line) for line in fh if line.strip()]
        return _write(args, argv, results, None)
    names = []
    for lib in args.libraries:
        some = [n for n in ecosystem.names(lib) if args.only is None or any(o in n for o in args.only)]
        names += some[: args.limit] if args.limit else some
    preload(args.libraries)
    names = _round_robin(names) if args.interleave else names
    tasks = [(n, v) for n in names for v in args.variants]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    done = []
    if args.resume and os.path.exists(partial):
        with open(partial) as fh:
            done = [json.loads(line) for line in fh if line.strip()]
        tasks = [t for t in tasks if t not in {(r["name"], r["variant"]) for r in done}]
    else:
        open(partial, "w").close()
    t = time.time()
    results = run_all(tasks, args.groups, args.timeout, args.jobs, lambda r: _log(r, partial))
    _write(args, argv, done + results, round(time.time() - t))


def _round_robin(names):
    """``names`` reordered one library/mapping at a time."""
    by = {}
    for n in names:
        parts = n.split("/")
        by.setdefault("/".join(parts[:2]) if parts[0] == "transformers" else parts[0], []).append(n)
    out, lists = [], list(by.values())
    while any(lists):
        out += [lst.pop(0) for lst in lists if lst]
    return out


def _write(args, argv, results, wall_s):
    meta = {"command": "python benchmarks/ecosystem_sweep.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "groups": args.groups,
            "timeout_s": args.timeout, "wall_s": wall_s, "cases": len(results), "versions": _versions(),
            "note": args.note}
    with open(os.path.splitext(args.out)[0] + ".json", "w") as fh:
        json.dump({"meta": meta, "results": results}, fh, indent=1)
    write_report(args.out, meta, results)
    print(f"wrote {args.out} ({len(results)} cases, {meta['wall_s']} s)")


def _versions():
    out = {"torch": torch.__version__}
    for mod in ("transformers", "timm", "torchvision", "peft"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a library not installed
            out[mod] = None
    return out


if __name__ == "__main__":
    main()
