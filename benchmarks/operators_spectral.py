"""The ``eigen`` and ``trace`` parts of ``operators.py``: each library's largest eigenvalue and
trace estimators on the GGN and the Hessian, in one process per problem (``child_spectral``).

Every method is called once, whole (set-up of its operator included, as a user would call it),
timed against the median of three plain backwards in the same process. Products are counted
where the library does not say: a wrapper around the operator's product (curvlinops through
SciPy, hessian-eigenthings' ``matvec``) or around PyHessian's ``hessian_vector_product``.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time

import numpy as np
import scipy.sparse.linalg
import torch

import operators as bench

try:  # peers are optional: a missing one's rows say so
    import curvlinops
except ImportError:
    curvlinops = None
try:
    import hessian_eigenthings
except ImportError:
    hessian_eigenthings = None


class Counted:
    """``fn`` that counts the columns it was called on (``[P]`` one, ``[P, K]`` K)."""

    def __init__(self, fn):
        self.fn, self.columns = fn, 0

    def __call__(self, v, *rest):
        self.columns += 1 if isinstance(v, (list, tuple)) or v.ndim == 1 else v.shape[1]
        return self.fn(v, *rest)


def counted_scipy(A) -> tuple:
    """``A`` (a SciPy ``LinearOperator``) with its columns counted."""
    matmat = Counted(lambda M: A.matmat(M.reshape(A.shape[1], -1)))
    op = scipy.sparse.linalg.LinearOperator(A.shape, dtype=A.dtype, matvec=lambda v: matmat(v[:, None]).ravel(),
                                            matmat=matmat)
    return op, matmat


def _start(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(size)


def reference_eigenvalue(A_curvlib, seed: int) -> dict:
    """The converged largest eigenvalue: ARPACK on curvlib's operator, ``tol=1e-9``."""
    op, count = counted_scipy(A_curvlib.to_scipy())
    start = time.perf_counter()
    value = scipy.sparse.linalg.eigsh(op, k=1, which="LA", tol=1e-9, v0=_start(op.shape[0], seed),
                                      return_eigenvectors=False)[0]
    return {"value": float(value), "matvecs": count.columns, "s": time.perf_counter() - start}


def exact_trace(problem, kind: str) -> float:
    """``tr A`` from curvlib's exact diagonal (``DiagGGNExact`` / ``DiagHessian``)."""
    from curvlib import curvature
    from curvlib.extensions import DiagGGNExact, DiagHessian

    ext = {"GGN": DiagGGNExact, "Hessian": DiagHessian}[kind]()
    diag = curvature(problem.model, problem.lossfn, [ext])(problem.X, problem.y)[ext.name]
    return float(sum(d.double().sum() for d in diag.values()))


LIBRARY_OPERATOR = {"curvlib": "curvlib", "curvlinops": "curvlinops", "pyhessian": "pyhessian[batch]",
                    "eigenthings": "eigenthings"}


def handles(problem, kind: str, libraries) -> dict:
    """Each library's operator for ``kind``, set up once (timed: ``setup_s``); PyHessian: Hessian only."""
    out = {}
    for library in libraries:
        if library == "pyhessian" and kind != "Hessian":
            continue
        start = time.perf_counter()
        try:
            handle = bench.operator(problem, f"{LIBRARY_OPERATOR[library]}:{kind}", None).handle
            out[library] = {"handle": handle, "setup_s": time.perf_counter() - start}
        except Exception as err:  # reported on every row of the library
            out[library] = {"error": bench._why(err)}
    return out


@contextlib.contextmanager
def counting(library: str, A):
    """Count the products of ``A`` (a library's handle) while inside; yields the counter."""
    if library == "pyhessian":
        module = sys.modules["pyhessian.hessian"]  # the package's name ``hessian`` is the class
        original = module.hessian_vector_product
        module.hessian_vector_product = count = Counted(original)
        try:
            yield count
        finally:
            module.hessian_vector_product = original
    elif library == "eigenthings":
        A.matvec = count = Counted(type(A).matvec.__get__(A))
        try:
            yield count
        finally:
            del A.matvec
    else:
        yield Counted(None)


def eigen_method(A, library: str, algorithm: str, tol: float, seed: int, same_matvecs: int):
    """The largest eigenvalue of ``A`` (``library``'s handle) by ``algorithm``: (value, products)."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if library == "curvlib":
        from curvlib.operators.eigen import lanczos

        pairs = lanczos(A, k=1, which="largest", tol=tol, generator=gen)
        return float(pairs.values[0]), pairs.num_matvecs
    if library == "curvlinops":
        op, count = counted_scipy(A.to_scipy())
        value = scipy.sparse.linalg.eigsh(op, k=1, which="LA", tol=tol, v0=_start(op.shape[0], seed),
                                          return_eigenvectors=False)[0]
        return float(value), count.columns
    with counting(library, A) as count:
        if library == "pyhessian":
            value = A.eigenvalues(maxIter=100, tol=tol, top_n=1)[0][0]
        elif algorithm == "power":
            value = hessian_eigenthings.power_iteration_one(A, max_iter=100, tol=tol, seed=seed)[0]
        else:  # Lanczos without a stopping rule: at curvlib's number of products
            result = hessian_eigenthings.lanczos(A, k=1, max_iter=max(2, same_matvecs), which="LA", seed=seed)
            value = result.eigenvalues[0]
    return float(value), count.columns


def trace_method(A, library: str, estimator: str, matvecs: int, seed: int):
    """``A``'s trace by ``library``'s ``estimator`` with ``matvecs`` products: (estimate, products)."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if library == "curvlib":
        from curvlib.operators import estimators

        fn = {"hutchinson": estimators.hutchinson_trace, "hutch++": estimators.hutchpp_trace,
              "xtrace": estimators.xtrace}[estimator]
        est = fn(A, matvecs, generator=gen)
        return float(est.value), est.num_matvecs
    if library == "curvlinops":
        fn = {"hutchinson": curvlinops.hutchinson_trace, "hutch++": curvlinops.hutchpp_trace,
              "xtrace": curvlinops.xtrace}[estimator]
        return float(fn(A, matvecs)), matvecs
    with counting(library, A) as count:
        if library == "pyhessian":
            # tol -inf: never stops early (its test |mean − previous| / (previous + 1e-6) < tol is
            # negative, so below 0, once the running mean is negative)
            value = float(np.mean(A.trace(maxIter=matvecs, tol=float("-inf"))))
        elif estimator == "hutchinson":
            value = hessian_eigenthings.hutchinson(A, num_samples=matvecs, seed=seed).estimate
        else:
            value = hessian_eigenthings.hutch_plus_plus(A, num_matvecs=matvecs, seed=seed).estimate
    return float(value), count.columns


def _timed(fn, reference: float):
    start = time.perf_counter()
    try:
        value, products = fn()
    except Exception as err:  # a refusal or a peer's failure: reported
        return {"error": bench._why(err), "s": time.perf_counter() - start}
    seconds = time.perf_counter() - start
    return {"value": value, "matvecs": products, "s": seconds, "rel_error": abs(value - reference) / abs(reference)}


def _backward_seconds(problem) -> float:
    import problems

    run = problems.backward(problem)
    run()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _kind_rows(problem, kind: str, job: dict) -> dict:
    """The eigen and trace rows of one matrix: every method of ``job`` on set-up operators."""
    libraries = dict.fromkeys(m.split(":")[0] for m in job["eigen"] + job["trace"])
    ops = handles(problem, kind, libraries)
    rows = {"setup_s": {k: v.get("setup_s") for k, v in ops.items()}, "eigen": {}, "trace": {}}
    curvlib_op = ops["curvlib"]["handle"]
    if "eigen" in job["parts"]:
        rows["eigen_reference"] = ref = reference_eigenvalue(curvlib_op, job["seed"])
        same = 20
        for method in job["eigen"]:
            library, algorithm = method.split(":")
            if library not in ops:
                continue
            if "error" in ops[library]:
                rows["eigen"][method] = {"error": ops[library]["error"]}
                continue
            A = ops[library]["handle"]
            rows["eigen"][method] = r = _timed(
                lambda: eigen_method(A, library, algorithm, job["eig_tol"], job["seed"], same), ref["value"])
            same = r.get("matvecs", same) if method == "curvlib:lanczos" else same
            problem.model.zero_grad(set_to_none=True)
    if "trace" in job["parts"]:
        rows["trace_exact"] = exact = exact_trace(problem, kind)
        for method in job["trace"]:
            library, estimator = method.split(":")
            if library not in ops:
                continue
            if "error" in ops[library]:
                rows["trace"][method] = {"error": ops[library]["error"]}
                continue
            A = ops[library]["handle"]
            runs = [_timed(lambda: trace_method(A, library, estimator, job["trace_matvecs"], job["seed"] + k), exact)
                    for k in range(job["trace_seeds"])]
            ok = [r for r in runs if "error" not in r]
            rows["trace"][method] = runs[0] if len(ok) < len(runs) else {
                "matvecs": ok[0]["matvecs"], "s": statistics.median(r["s"] for r in ok),
                "rel_error": statistics.mean(r["rel_error"] for r in ok), "errors": [r["rel_error"] for r in ok]}
            problem.model.zero_grad(set_to_none=True)
    return rows


def child_spectral(job: dict) -> dict:
    """One process per problem: the backward's time, then per kind the eigen and trace rows."""
    from run import prewarm

    prewarm()
    problem = bench.build(job["problem"], job)
    out = {"backward_s": _backward_seconds(problem), "kinds": {}}
    with bench.peer_mode():
        for kind in job["kinds"]:
            out["kinds"][kind] = _kind_rows(problem, kind, job)
    return out
