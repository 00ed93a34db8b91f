"""curvlib's whole-network operators (``curvlib.operators``) against the libraries that offer the
same products: GGN- and Hessian-vector products, the top eigenvalue and the trace.

    python benchmarks/operators.py                      # mlp, 3c3d, gpt2-small (N=1, T=32); eigen, trace on mlp, 3c3d
    python benchmarks/operators.py --quick              # mlp only, fewer rounds: 25 s (load 3)
    python benchmarks/operators.py --problems 3c3d --parts products --rounds 5
    python benchmarks/operators.py --device cuda --out benchmarks/results/cuda
    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/operators.py --parts products --no-time   # allocations' peaks

Peers (optional, each skipped with the reason when missing; ``pip install --no-deps``):
curvlinops 3.0.1 (``GGNLinearOperator``, ``HessianLinearOperator``, its trace estimators; its
top eigenvalue through ``scipy.sparse.linalg.eigsh(A.to_scipy())``, the route it documents),
PyHessian 0.1 (``pyhessian.hessian``: ``dataloader_hv_product``, single-batch products through
the graph it keeps, ``eigenvalues`` (power iteration), ``trace`` (Hutchinson); Hessian only)
and hessian-eigenthings 1.0.0a5 (``GGNOperator``, ``HessianOperator``, ``power_iteration_one``,
``lanczos``, ``hutchinson``, ``hutch_plus_plus``).

Measured on 2 shared cores: the products 8 min (load 3-4), eigen and trace 6.4 min (load 3; 20 at load 6):
about 15 min in all. Three parts, each in processes forked after the imports (CUDA: fresh ones, ``memory_knobs.spawn``):

* **products** (``--parts products``): one product ``A @ v`` with a seeded random ``v [P]`` in
  the peer's own format. *Memory*: one process per (problem, method) builds the problem and the
  operator, resets the high-water mark and makes the first product; the call's peak above the
  RSS just before it, over a plain backward's measured the same way (``call / backward``), and
  what the set-up holds above the built problem (PyHessian's single-batch mode keeps the
  double-backward graph). *Time*: one process per problem sets every method up, makes one
  untimed call each, checks every peer's product against curvlib's (``‖a − b‖ / ‖b‖``), then
  ``--rounds`` rounds calling every method once in a freshly shuffled order; the median over the
  median plain backward (``lossfn(model(X), y).backward()``: a forward and a backward).
* **eigen**: the largest eigenvalue, each library's method with its own stopping rule set to the
  target ``--eig-tol`` (1e-3): curvlib's ``lanczos(tol=)`` (relative residual), eigsh's ``tol``
  (relative accuracy), PyHessian's ``tol`` (relative change), hessian-eigenthings'
  ``power_iteration_one(tol=)`` and its ``lanczos`` at the number of products curvlib's took.
  The error is against a converged reference (ARPACK on curvlib's operator, ``tol=1e-9``); the
  time is the whole call's over the backward's in the same process; ``matvecs`` counts products.
* **trace**: ``--trace-matvecs`` products each (equal budgets): Hutchinson, Hutch++ and XTrace
  where a library has them; the error against the exact trace (the sum of curvlib's
  ``DiagGGNExact`` / ``DiagHessian``).

``gpt2-small`` is ``problems.gpt`` at GPT-2-small size (12 blocks, d 768, vocab 50257) with
``--gpt-n`` sequences of ``--gpt-t`` tokens; eigen and trace run on ``--spectral-problems``
(default mlp and 3c3d: a GPT-2-small product takes seconds here). Forward-mode AD has no rule for
``nn.TransformerEncoderLayer``'s fused fast path nor for CPU flash attention, so the peers run
with ``torch.backends.mha.set_fastpath_enabled(False)`` and ``sdpa_kernel(SDPBackend.MATH)``
(curvlib traces the model and needs neither; without them curvlinops' and hessian-eigenthings'
GGN raise ``NotImplementedError``). Writes ``operators-<date>.md`` and ``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from memory_knobs import spawn  # noqa: E402

KINDS = ("GGN", "Hessian")
#: Product methods: ``<library>:<kind>``; PyHessian has no GGN.
PRODUCTS = ("backward", "curvlib:GGN", "curvlinops:GGN", "eigenthings:GGN", "curvlib:Hessian",
            "curvlinops:Hessian", "pyhessian:Hessian", "pyhessian[batch]:Hessian", "eigenthings:Hessian")
#: Eigenvalue methods per kind (``eigen`` part).
EIGEN = ("curvlib:lanczos", "curvlinops:eigsh", "pyhessian:power", "eigenthings:power", "eigenthings:lanczos")
#: Trace estimators per kind (``trace`` part).
TRACE = ("curvlib:hutchinson", "curvlib:hutch++", "curvlib:xtrace", "curvlinops:hutchinson",
         "curvlinops:hutch++", "curvlinops:xtrace", "pyhessian:hutchinson", "eigenthings:hutchinson",
         "eigenthings:hutch++")
#: A peer's product agrees with curvlib's below this relative difference (float32).
AGREE_TOL = 1e-3


def build(name: str, job: dict):
    """The problem ``name`` (``problems.PROBLEMS``, or ``gpt2-small`` with N and T of the job)."""
    import problems

    if name == "gpt2-small":
        return problems.gpt(job["device"], vocab=50257, n=job["gpt_n"], length=job["gpt_t"], d=768, heads=12,
                            hidden=3072, layers=12)
    return problems.PROBLEMS[name](device=job["device"])


def peer_mode():
    """The switches forward-mode AD needs in the peers (module doc)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.backends.mha.set_fastpath_enabled(False)
    return sdpa_kernel([SDPBackend.MATH])


# --------------------------------------------------------------------------- operators


class Operator:
    """A library's operator with one interface: ``matvec(v [P]) -> [P]`` in its own format
    (``native``: the call timed), ``flat`` turns its result into ``[P]`` for the checks."""

    def __init__(self, native, flat=lambda r: r, handle=None):
        self.native, self.flat, self.handle = native, flat, handle


def params_of(model):
    return [p for p in model.parameters() if p.requires_grad]


def operator(problem, method: str, v):
    """``method`` (``<library>:<kind>``) set up on ``problem`` for the vector ``v [P]``."""
    import torch

    library, kind = method.split(":")
    model, lossfn, X, y = problem
    params = params_of(model)
    if library == "curvlib":
        from curvlib.operators import GGN, Hessian

        A = {"GGN": GGN, "Hessian": Hessian}[kind](model, lossfn, (X, y))
        return Operator(lambda: A @ v, handle=A)
    if library == "curvlinops":
        from curvlinops import GGNLinearOperator, HessianLinearOperator

        cls = {"GGN": GGNLinearOperator, "Hessian": HessianLinearOperator}[kind]
        A = cls(model, lossfn, params, [(X, y)], check_deterministic=False, num_data=X.shape[0])
        return Operator(lambda: A @ v, handle=A)
    if library == "eigenthings":
        import hessian_eigenthings as he

        if kind == "GGN":
            A = he.GGNOperator(model, [(X, y)], he.supervised_forward, he.supervised_loss_of_output(lossfn))
        else:
            A = he.HessianOperator(model, [(X, y)], he.supervised_loss(lossfn))
        return Operator(lambda: A.matvec(v), handle=A)
    if library.startswith("pyhessian"):
        from pyhessian import hessian
        from pyhessian.utils import hessian_vector_product

        vs = None if v is None else [t.view_as(p) for t, p in zip(torch.split(v, [p.numel() for p in params]), params)]
        flat = lambda r: torch.cat([t.reshape(-1) for t in r])  # noqa: E731
        if library == "pyhessian[batch]":  # the graph of one backward kept, each product a backward of it
            h = hessian(model, lossfn, data=(X, y), cuda=X.is_cuda)
            return Operator(lambda: hessian_vector_product(h.gradsH, h.params, vs), flat, h)
        h = hessian(model, lossfn, dataloader=[(X, y)], cuda=X.is_cuda)
        return Operator(lambda: h.dataloader_hv_product(vs)[1], flat, h)
    raise ValueError(f"unknown method {method!r}")


def setup(problem, method: str, v):
    """A zero-argument callable doing ``method`` once, and the flattener of its result."""
    import problems

    if method == "backward":
        return problems.backward(problem), None
    op = operator(problem, method, v)
    return op.native, op.flat


# --------------------------------------------------------------------------- children


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1]) / 2**10


def _why(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def _vector(problem, job):
    import torch

    size = sum(p.numel() for p in params_of(problem.model))
    gen = torch.Generator().manual_seed(job["seed"])
    return torch.randn(size, generator=gen).to(problem.X.device)


def _cuda_peak_reset(device: str):
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated() / 2**20
    return None


def child_memory(job: dict) -> dict:
    """One process, one method: the first call's own peak, and what the set-up holds."""
    import ctypes
    import gc

    import torch

    from run import prewarm

    prewarm()
    problem = build(job["problem"], job)
    v = _vector(problem, job)
    gc.collect()
    built = _status_mib("VmRSS")
    out = {}
    try:
        with peer_mode():
            run, _ = setup(problem, job["method"], v)
            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            out["setup_above_mib"] = _status_mib("VmRSS") - built
            out["rss_before_mib"] = _status_mib("VmRSS")
            cuda_before = _cuda_peak_reset(job["device"])
            with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS
                f.write("5")
            start = time.perf_counter()
            result = run()
            out["first_s"] = time.perf_counter() - start
            del result
            out["call_above_mib"] = _status_mib("VmHWM") - out["rss_before_mib"]
            if cuda_before is not None:
                out["call_above_mib"] = torch.cuda.max_memory_allocated() / 2**20 - cuda_before
    except Exception as err:  # a refusal or a peer's failure: reported
        out["error"] = _why(err)
    return out


def child_time(job: dict) -> dict:
    """One process, every method of the problem, in shuffled rounds; the peers' agreement."""
    import torch

    from run import prewarm

    prewarm()
    problem = build(job["problem"], job)
    v = _vector(problem, job)
    runs, flats, results, out = {}, {}, {}, {"first_s": {}, "errors": {}, "agree": {}}
    sync = torch.cuda.synchronize if job["device"].startswith("cuda") else (lambda: None)
    with peer_mode():
        for method in job["methods"]:
            try:
                runs[method], flats[method] = setup(problem, method, v)
                start = time.perf_counter()
                r = runs[method]()
                sync()
                out["first_s"][method] = time.perf_counter() - start
                if flats[method] is not None:
                    results[method] = flats[method](r).detach()
                del r
            except Exception as err:
                runs.pop(method, None)
                out["errors"][method] = _why(err)
        for method, r in results.items():
            ref = results.get("curvlib:" + method.split(":")[1])
            if ref is not None and not method.startswith("curvlib"):
                out["agree"][method] = ((r - ref).norm() / ref.norm()).item()
        results.clear()
        times = {m: [] for m in runs}
        order = list(runs)
        rng = random.Random(job["seed"])
        for _ in range(job["rounds"]):
            rng.shuffle(order)
            for method in order:
                start = time.perf_counter()
                runs[method]()
                sync()
                times[method].append(time.perf_counter() - start)
    med = {m: statistics.median(t) for m, t in times.items() if t}
    out["ms"] = {m: 1e3 * t for m, t in med.items()}
    if "backward" in med:
        out["ratio"] = {m: t / med["backward"] for m, t in med.items()}
    return out


HANDLERS = {"memory": "child_memory", "time": "child_time", "spectral": "child_spectral"}


def handler(mode: str):
    import operators_spectral

    return getattr(operators_spectral if mode == "spectral" else sys.modules[__name__], HANDLERS[mode])


def prepare() -> None:
    """Import curvlib and every peer and pay curvlib's one-time costs, before any fork."""
    import importlib

    import operators_spectral  # noqa: F401
    from run import prewarm

    for name in ("curvlinops", "pyhessian", "hessian_eigenthings", "problems"):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    prewarm()


def forked(job: dict) -> dict:
    """``job`` in a child forked from this process: its JSON through a pipe (an exit without one,
    e.g. killed for memory, is reported)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        try:
            text = json.dumps(handler(job["mode"])(job))
        except BaseException as err:  # noqa: BLE001 (reported to the parent)
            text = json.dumps({"error": _why(err)})
        with os.fdopen(write, "w") as f:
            f.write(text)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    return json.loads(text) if text else {"error": f"child exited with status {status} (out of memory?)"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--problems", nargs="+", default=["mlp", "3c3d", "gpt2-small"])
    parser.add_argument("--spectral-problems", nargs="+", default=["mlp", "3c3d"],
                        help="problems of the eigen and trace parts (of --problems or not)")
    parser.add_argument("--parts", nargs="+", default=["products", "eigen", "trace"],
                        choices=["products", "eigen", "trace"])
    parser.add_argument("--methods", nargs="+", default=list(PRODUCTS), help="product methods (PRODUCTS)")
    parser.add_argument("--eigen", nargs="+", default=list(EIGEN), help="eigenvalue methods (EIGEN)")
    parser.add_argument("--trace", nargs="+", default=list(TRACE), help="trace estimators (TRACE)")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of the products")
    parser.add_argument("--gpt-rounds", type=int, default=2, help="timed rounds on gpt2-small")
    parser.add_argument("--gpt-n", type=int, default=1, help="gpt2-small's sequences N")
    parser.add_argument("--gpt-t", type=int, default=32, help="gpt2-small's tokens per sequence T")
    parser.add_argument("--eig-tol", type=float, default=1e-3, help="target relative error of the eigenvalue")
    parser.add_argument("--trace-matvecs", type=int, default=24, help="products per trace estimate")
    parser.add_argument("--trace-seeds", type=int, default=1,
                        help="estimates per trace estimator (seeds): the error is their mean, the time their median")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory processes")
    parser.add_argument("--no-time", action="store_true", help="skip the products' timing processes")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run (< 2 min): mlp only, 2 rounds, 12 products per trace")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--src", default=os.path.join(os.path.dirname(HERE), "src"), help="curvlib's tree")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "cpu"))
    parser.add_argument("--name", default=None, help="output stem (default operators-<date>)")


def _progress(text: str) -> None:
    print(text[:400], file=sys.stderr, flush=True)


def run_parts(args, child) -> dict:
    """Every part's processes, one at a time; ``child(job)`` runs one and returns its JSON."""
    if args.quick:
        args.problems, args.spectral_problems, args.rounds, args.trace_matvecs = ["mlp"], ["mlp"], 2, 12
        args.trace_seeds = 1
    base = {"device": args.device, "seed": args.seed, "gpt_n": args.gpt_n, "gpt_t": args.gpt_t}
    rows: dict = {"products": {}, "spectral": {}}
    if "products" in args.parts:
        for problem in args.problems:
            job = {**base, "problem": problem}
            memory = {}
            if not args.no_memory:
                for method in args.methods:
                    memory[method] = child({**job, "mode": "memory", "method": method})
                    _progress(f"memory {problem} {method}: {json.dumps(memory[method])}")
            rounds = args.gpt_rounds if problem == "gpt2-small" else args.rounds
            timing = {} if args.no_time else child({**job, "mode": "time", "methods": args.methods, "rounds": rounds})
            _progress(f"time {problem}: {json.dumps(timing)}")
            rows["products"][problem] = {"memory": memory, "time": timing}
    spectral_parts = [p for p in args.parts if p in ("eigen", "trace")]
    if spectral_parts:
        for problem in args.spectral_problems:
            job = {**base, "problem": problem, "mode": "spectral", "parts": spectral_parts, "kinds": args.kinds,
                   "eigen": args.eigen, "trace": args.trace, "eig_tol": args.eig_tol,
                   "trace_matvecs": args.trace_matvecs,
                   "trace_seeds": args.trace_seeds}
            rows["spectral"][problem] = child(job)
            _progress(f"spectral {problem}: {json.dumps(rows['spectral'][problem])}")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    add_arguments(parser)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.child is not None:
        job = json.loads(args.child)
        print(json.dumps(handler(job["mode"])(job)))
        return 0
    from operators_report import report

    started = time.perf_counter()
    if args.device == "cpu":  # forked from this process once it has imported everything (fresh heap each)
        sys.path.insert(0, os.path.abspath(args.src))
        prepare()
        rows = run_parts(args, forked)
    else:  # CUDA cannot be forked: a fresh interpreter per job
        rows = run_parts(args, lambda job: spawn(args.src, job, args.threads, script=__file__))
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, args.name or f"operators-{datetime.date.today().isoformat()}")
    meta = {"args": {k: v for k, v in vars(args).items() if k != "child"}, "seconds": time.perf_counter() - started,
            "load": os.getloadavg(), "torch": torch.__version__,
            "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_")}
    with open(stem + ".json", "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=1)
    text = report(meta, rows)
    with open(stem + ".md", "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
