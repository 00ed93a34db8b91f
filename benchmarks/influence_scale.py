"""``curvlib.influence`` at scale: memory and time of fitting and scoring on GPT-2-small, and
scores streamed over many training sequences on a CPU.

    python benchmarks/influence_scale.py gpt2-small            # every method, fresh processes
    python benchmarks/influence_scale.py gpt2-small --methods backward scores:jvp
    python benchmarks/influence_scale.py stream --sequences 10000

**gpt2-small** (``problems.gpt2_small``: 163 M parameters, vocabulary 50257, N = 4 sequences of
T = 128 tokens, untied head). Each method runs in a fresh process (``memory_knobs.spawn``), as
``llm_memory.py`` measures: the process builds the problem and the method's inputs (for the
scoring methods, EK-FAC factors loaded from the file the ``fit`` process saved, and 4 query
sequences preconditioned), resets the high-water mark (``/proc/self/clear_refs``), calls the
method once on one training batch and reads ``VmHWM``: ``call_above_mib`` is the call's own peak
above ``VmRSS`` just before it. ``backward`` is a plain ``lossfn(model(X), y).backward()``.
The fit's peak includes the factors it returns: their size is reported beside it, and
``working`` is the peak less the factors. Time: the call's seconds (its first call: tracing
included) over the median of three backwards timed after it in the same process.

Methods: ``backward``; ``fit:ekfac`` (``fit(strategy="ekfac", fisher_type="mc",
max_factor_dim=4096, batch_size=1)``: KFAC's factors on the batch, their eigendecompositions,
the eigenvalue pass one sequence per call); ``scores:gradients`` (each batch's gradients
``[4, P]``), ``scores:gradients-1`` (``batch_size=1``), ``scores:jvp`` (Jacobian-vector products,
``chunk_size=1``), ``scores:jvp-1`` (and ``batch_size=1``), ``self:gradients-1``
(``self_influence(batch_size=1)``). ``--queries FILE``: the preconditioned queries loaded from
``FILE`` (saved there by the first scoring process that finds none) instead of computed in each
process; the call's peak is measured the same way, above what the process holds before it.

**peers**: curvlib and kronfluence side by side, each in a fresh process, on a causal language
model of bias-free Linear layers (``oracles.models.TinyCausalLM`` at d 256, vocabulary 256, T 64;
kronfluence tracks its Linear layers, curvlib gets them as ``params``): EK-FAC with the empirical
Fisher fitted on 256 sequences (batches of 32) and 16 queries scored against them, float32; the
process's peak above one that only built the problem (``ru_maxrss``), and the seconds of fit +
scores (kronfluence writes its factors and scores to a temporary folder).

**stream**: a small GPT (``problems.gpt``: d 64, 2 blocks, vocabulary 256, T 32) and
``--sequences`` training sequences in batches of 64, fitted (EK-FAC, MC) and scored against
16 queries (``scores``, gradients), timed, with the process's peak memory. Writes
``influence-scale-<name>.md`` and ``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from memory_knobs import spawn  # noqa: E402

METHODS = ("backward", "fit:ekfac", "scores:gradients", "scores:gradients-1", "scores:jvp", "scores:jvp-1",
           "self:gradients-1")
MAX_FACTOR_DIM = 4096
QUERIES = 4


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) / 2**10


def _tensor_mib(obj, seen=None) -> float:
    """The bytes of every tensor in a nested dict / tuple, in MiB; a tensor several entries share
    (the fit's weight and bias blocks share their output side's eigenbasis) counted once."""
    import torch
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        key = (obj.data_ptr(), tuple(obj.shape), obj.stride())
        if key in seen:
            return 0.0
        seen.add(key)
        return obj.numel() * obj.element_size() / 2**20
    if isinstance(obj, dict):
        return sum(_tensor_mib(v, seen) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_mib(v, seen) for v in obj)
    return 0.0


def _queries(problem, seed: int):
    import torch
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    X, y = problem.X, problem.y
    return (torch.randint(0, 50257, (QUERIES, X.shape[1]), generator=gen),
            torch.randint(0, 50257, (QUERIES, y.shape[1]), generator=gen))


def _prepared(problem, factors, path, seed: int):
    """The 4 queries preconditioned: loaded from ``path`` if it exists, else computed (and saved
    there when a ``path`` is given)."""
    import torch
    from curvlib import influence

    if path and os.path.exists(path):
        return torch.load(path, weights_only=True)
    prepared = influence.precondition_queries(problem.model, problem.lossfn, factors, _queries(problem, seed))
    if path:
        torch.save(prepared, path)
    return prepared


def _runner(problem, method: str, factors_path: str, seed: int, queries_path=None):
    """``(call, setup_mib)``: a zero-argument callable doing ``method`` once."""
    import torch
    from curvlib import influence
    from problems import backward

    model, lossfn, X, y = problem
    if method == "backward":
        return backward(problem), {}
    if method == "fit:ekfac":
        generator = torch.Generator(device="cpu").manual_seed(seed)
        return (lambda: influence.fit(model, lossfn, (X, y), strategy="ekfac", fisher_type="mc",
                                      generator=generator, max_factor_dim=MAX_FACTOR_DIM, batch_size=1)), {}
    factors = torch.load(factors_path, weights_only=True)
    held = {"factors_mib": _tensor_mib(factors)}
    if method.startswith("self:"):
        return (lambda: influence.self_influence(model, lossfn, factors, (X, y), batch_size=1)), held
    prepared = _prepared(problem, factors, queries_path, seed)
    held["queries_mib"] = _tensor_mib(prepared["blocks"])
    options = {"scores:gradients": {}, "scores:gradients-1": {"batch_size": 1},
               "scores:jvp": {"method": "jvp", "chunk_size": 1},
               "scores:jvp-1": {"method": "jvp", "chunk_size": 1, "batch_size": 1}}[method]
    return (lambda: influence.scores(model, lossfn, factors, prepared, (X, y), **options)), held


def _child_memory(job: dict) -> dict:
    import ctypes
    import gc

    import torch
    from problems import PROBLEMS, backward
    from run import prewarm

    torch.set_num_threads(job["threads"] or torch.get_num_threads())
    prewarm()
    problem = PROBLEMS["gpt2-small"](seed=job["seed"])
    run, out = _runner(problem, job["method"], job["factors"], job["seed"], job.get("queries"))
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    out["rss_before_mib"] = _status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS: the call's own peak next
        f.write("5")
    start = time.perf_counter()
    result = run()
    out["seconds"] = time.perf_counter() - start
    out["call_above_mib"] = _status_mib("VmHWM") - out["rss_before_mib"]
    if job["method"] == "fit:ekfac":
        out["result_mib"] = _tensor_mib(result)
        torch.save(result, job["factors"])
    del result
    reference = backward(problem)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        reference()
        times.append(time.perf_counter() - start)
    out["backward_seconds"] = statistics.median(times)
    out["time_ratio"] = out["seconds"] / out["backward_seconds"]
    return out


def _child_stream(job: dict) -> dict:
    import resource

    import torch
    from curvlib import influence
    from problems import gpt

    torch.set_num_threads(job["threads"] or torch.get_num_threads())
    n, batch = job["sequences"], 64
    problem = gpt(seed=job["seed"], vocab=256, n=n + 16, length=32, d=64, heads=4, hidden=256, layers=2)
    model, lossfn, X, y = problem
    train = [(X[k:min(k + batch, n)], y[k:min(k + batch, n)]) for k in range(0, n, batch)]
    queries = (X[n:], y[n:])
    out = {"sequences": n, "parameters": sum(p.numel() for p in model.parameters())}
    start = time.perf_counter()
    factors = influence.fit(model, lossfn, train, strategy="ekfac", fisher_type="mc",
                            generator=torch.Generator(device="cpu").manual_seed(job["seed"]))
    out["fit_seconds"] = time.perf_counter() - start
    start = time.perf_counter()
    scores = influence.scores(model, lossfn, factors, queries, train)
    out["score_seconds"] = time.perf_counter() - start
    out["scores_shape"] = list(scores.shape)
    out["sequences_per_second"] = n / out["score_seconds"]
    out["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    out["factors_mib"] = _tensor_mib(factors)
    return out


def _peer_problem(seed: int):
    import torch
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from oracles.models import TinyCausalLM

    torch.manual_seed(seed)
    lm = TinyCausalLM(vocab=256, d=256, length=64).eval()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    X, y = torch.randint(0, 256, (272, 64), generator=gen), torch.randint(0, 256, (272, 64), generator=gen)
    return lm, (X[:256], y[:256]), (X[256:], y[256:])


class _Logits:
    """``[N, T, V]`` -> ``[N, V, T]`` (built lazily: torch is imported in the child only)."""

    @staticmethod
    def wrap(lm):
        import torch

        class Logits(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, ids):
                return self.inner(ids).transpose(1, 2)

        return Logits(lm)


def _child_peers(job: dict) -> dict:
    import resource
    import tempfile

    import torch
    from torch import nn

    torch.set_num_threads(job["threads"] or torch.get_num_threads())
    lm, (X, y), queries = _peer_problem(job["seed"])
    tracked = [n for n, m in lm.named_modules() if isinstance(m, nn.Linear)]
    out = {"library": job["library"], "parameters": sum(p.numel() for p in lm.parameters()),
           "tracked": sum(lm.get_submodule(n).weight.numel() for n in tracked)}
    if job["library"] == "none":
        out["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
        return out
    start = time.perf_counter()
    if job["library"] == "kronfluence":
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from oracles.kronfluence_peer import kronfluence_scores
        with tempfile.TemporaryDirectory() as folder:
            kronfluence_scores(lm, (X, y), queries, folder, strategy="ekfac", tracked=tracked, batch_size=32,
                               dtype=torch.float32, self_scores=False)
    else:
        from curvlib import influence
        model, lossfn = _Logits.wrap(lm), nn.CrossEntropyLoss()
        linear = {f"inner.{n}.weight": lm.get_submodule(n).weight for n in tracked}
        train = [(X[k:k + 32], y[k:k + 32]) for k in range(0, 256, 32)]
        factors = influence.fit(model, lossfn, train, strategy="ekfac", fisher_type="empirical", params=linear)
        influence.scores(model, lossfn, factors, queries, train, params=linear)
    out["seconds"] = time.perf_counter() - start
    out["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    return out


def _child(job: dict) -> None:
    modes = {"stream": _child_stream, "peers": _child_peers, "memory": _child_memory}
    out = modes[job["mode"]](job)
    print(json.dumps(out))


def _markdown_gpt(rows: dict) -> str:
    backward = rows.get("backward", {}).get("call_above_mib")
    lines = ["| method | call's peak above before (MiB) | / backward's | held before the call (MiB) | "
             "seconds | time / backward |", "|---|---:|---:|---|---:|---:|"]
    for method, r in rows.items():
        if "error" in r:
            lines.append(f"| `{method}` | {r['error']} | | | | |")
            continue
        peak = r["call_above_mib"]
        held = ", ".join(f"{k[:-4]} {v:.0f}" for k, v in r.items() if k in ("factors_mib", "queries_mib"))
        if "result_mib" in r:
            held = f"returns factors {r['result_mib']:.0f}; working {peak - r['result_mib']:.0f}"
        ratio = f"{peak / backward:.2f}" if backward else ""
        lines.append(f"| `{method}` | {peak:.0f} | {ratio} | {held} | {r['seconds']:.1f} | {r['time_ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", nargs="?", choices=("gpt2-small", "stream", "peers"), default="gpt2-small")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--sequences", type=int, default=10_000)
    ap.add_argument("--factors", default="/tmp/curvlib-influence-gpt2-small-factors.pt")
    ap.add_argument("--queries", default=None, help="a file of preconditioned queries, loaded (or saved once)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu"))
    ap.add_argument("--name", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        _child(json.loads(args.child))
        return 0
    src = os.path.join(ROOT, "src")
    base = {"seed": args.seed, "threads": args.threads}
    if args.what == "peers":
        rows = {lib: spawn(src, {**base, "mode": "peers", "library": lib}, args.threads, script=__file__)
                for lib in ("none", "curvlib", "kronfluence")}
        base_mib = rows["none"].get("peak_mib", 0)
        text = "| library | parameters (tracked) | fit + scores (s) | process peak above the problem (MiB) |\n" \
               "|---|---:|---:|---:|\n"
        for lib in ("curvlib", "kronfluence"):
            r = rows[lib]
            text += (f"| {lib} | {r['parameters']} ({r['tracked']}) | {r['seconds']:.1f} | "
                     f"{r['peak_mib'] - base_mib:.0f} |\n" if "error" not in r else f"| {lib} | {r['error']} | | |\n")
    elif args.what == "stream":
        row = spawn(src, {**base, "mode": "stream", "sequences": args.sequences}, args.threads, script=__file__)
        text = "| sequences | parameters | fit (s) | scores, 16 queries (s) | sequences / s | peak (MiB) | factors (MiB) |\n" \
               "|---:|---:|---:|---:|---:|---:|---:|\n"
        text += (f"| {row['sequences']} | {row['parameters']} | {row['fit_seconds']:.1f} | {row['score_seconds']:.1f} | "
                 f"{row['sequences_per_second']:.0f} | {row['peak_mib']:.0f} | {row['factors_mib']:.1f} |\n"
                 if "error" not in row else f"error: {row['error']}\n")
        rows = row
    else:
        methods = list(args.methods)
        if any(m != "backward" and m != "fit:ekfac" for m in methods) and "fit:ekfac" not in methods \
                and not os.path.exists(args.factors):
            methods.insert(0, "fit:ekfac")  # the scoring methods load its factors
        methods.sort(key=lambda m: (m != "fit:ekfac", METHODS.index(m)))
        rows = {}
        for method in methods:
            rows[method] = spawn(src, {**base, "mode": "memory", "method": method, "factors": args.factors,
                                       "queries": args.queries}, args.threads, script=__file__)
            print(f"{method}: {json.dumps(rows[method])}", file=sys.stderr, flush=True)
        if "backward" in rows:
            rows = {"backward": rows.pop("backward"), **rows}
        text = _markdown_gpt(rows)
    name = args.name or f"influence-scale-{args.what}"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
