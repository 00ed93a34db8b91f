"""One ecosystem-sweep case: a problem of ``oracles.ecosystem`` checked group by group.

``run_case(name, variant, groups, limit)`` builds the problem, says whether it is eligible
(``ecosystem.eligibility``), times a plain backward and a first and a second ``first_order``
call, then runs
``zoo_checks.check_problem`` per group and classifies each result:

* ``exact``: every quantity agrees with the float64 oracle (``detail`` the max rel. error);
* ``refused``: curvlib raised ``CurvatureError`` / ``CurvatureTypeError``;
* ``wrong``: values off the oracle (``zoo_checks.Wrong``);
* ``crash``: curvlib raised any other exception;
* ``oracle``: the brute force itself failed (not curvlib's result);
* ``timeout``: still running after ``limit`` seconds.
"""

from __future__ import annotations

import signal
import time
import warnings
from typing import Any, Dict, List

from oracles import ecosystem, zoo_checks
from curvlib import CurvatureError, curvature
from curvlib.extensions import (KFLR, BatchDiagGGNExact, BatchDiagHessian, BatchGrad, BatchL2Grad, DiagGGNExact,
                                DiagHessian, SumGradSquared, Variance)

OUTCOMES = ["exact", "refused", "wrong", "crash", "oracle", "timeout"]

# the extensions zoo_checks.check_problem runs per group (those one call can share)
EXTENSIONS = {
    "first_order": lambda: [BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()],
    "ggn": lambda: [DiagGGNExact(), BatchDiagGGNExact()],
    "kflr": lambda: [KFLR(kfac_approx="expand")],
    "hessian": lambda: [DiagHessian(), BatchDiagHessian()],
}


def shared_run(groups: List[str]):
    """A stand-in for ``zoo_checks.run`` that traces once per problem: the first call runs
    every group's extensions in one ``curvature`` call and later calls read its result; if that
    call raises, each group runs its own extensions (the exception is then the group's)."""
    plain, cache = zoo_checks.run, {}

    def run(prob, extensions, **kw):
        if kw or any(g not in EXTENSIONS for g in groups):
            return plain(prob, extensions, **kw)
        key = id(prob.model)
        if key not in cache:
            try:
                cache[key] = plain(prob, [e for g in groups for e in EXTENSIONS[g]()])
            except Exception:  # noqa: BLE001 - the group's own call below raises what is its
                cache[key] = None
        return plain(prob, extensions) if cache[key] is None else cache[key]

    return run


def _first_line(e: BaseException, limit: int = 300) -> str:
    lines = [s for s in str(e).strip().splitlines() if s.strip()]
    return (lines[0] if lines else "")[:limit]


def classify(e: BaseException) -> Dict[str, str]:
    """``{"outcome", "detail"}`` for an exception raised by a check."""
    if isinstance(e, zoo_checks.Wrong):
        return {"outcome": "wrong", "detail": _first_line(e)}
    if isinstance(e, CaseTimeout):
        return {"outcome": "timeout", "detail": f"in {zoo_checks.PHASE[0]}"}
    if zoo_checks.PHASE[0] == "oracle":
        return {"outcome": "oracle", "detail": f"{type(e).__name__}: {_first_line(e)}"}
    kind = "refused" if isinstance(e, CurvatureError) else "crash"
    return {"outcome": kind, "detail": f"{type(e).__name__}: {_first_line(e)}"}


class CaseTimeout(BaseException):
    """Raised by the alarm; a BaseException, so that no ``except Exception`` fallback inside a
    model, a builder or an oracle swallows it."""


def _alarm(signum, frame):
    raise CaseTimeout("still running after the time limit")


def check_group(prob, group: str, limit: int) -> Dict[str, Any]:
    """One group on one problem: ``{"outcome", "detail", "seconds"}``."""
    zoo_checks.PHASE[0] = "curvlib"
    t = time.perf_counter()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(limit)
    try:
        errs = zoo_checks.check_problem(prob, group)
        nums = [v for v in errs.values() if isinstance(v, float)]
        res = {"outcome": "exact", "detail": f"{max(nums):.1e}" if nums else ""}
    except (Exception, CaseTimeout) as e:  # noqa: BLE001 - classified for the report
        res = classify(e)
    finally:
        signal.alarm(0)
    res["seconds"] = round(time.perf_counter() - t, 2)
    return res


def _backward_seconds(prob) -> float:
    """Seconds of a plain forward + ``loss.backward()`` (the second of two, gradients cleared)."""
    from oracles.zoo_reference import forward

    for _ in range(2):
        t = time.perf_counter()
        prob.lossfn(forward(prob.model, prob.X, prob.output), prob.y).backward()
        seconds = time.perf_counter() - t
    for p in prob.model.parameters():
        p.grad = None
    return seconds


def call_times(prob, limit: int) -> Dict[str, Any]:
    """Seconds of a plain forward + backward and of the first (trace + plan + evaluate) and
    second call of the first-order extensions; ``None`` where the call fails."""
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(limit)
    out = {"backward_s": None, "first_call_s": None, "second_call_s": None}
    prob = prob.computed if prob.computed is not None else prob
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out["backward_s"] = round(_backward_seconds(prob), 4)
            f = curvature(prob.model, prob.lossfn, [BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()],
                          output=prob.output)
            for key in ("first_call_s", "second_call_s"):
                t = time.perf_counter()
                f(prob.X, prob.y)
                out[key] = round(time.perf_counter() - t, 3)
    except (Exception, CaseTimeout):  # noqa: BLE001 - the first_order group reports why
        pass
    finally:
        signal.alarm(0)
    return out


def run_case(name: str, variant: str, groups: List[str], limit: int = 120) -> Dict[str, Any]:
    """Eligibility, call times and every group's outcome for one (problem, variant)."""
    res: Dict[str, Any] = {"name": name, "variant": variant, "groups": {}}
    t = time.perf_counter()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(limit)
    try:
        res["ineligible"], prob = ecosystem.eligible_problem(name, variant)
    except CaseTimeout:
        res["ineligible"], prob = f"build: still building after {limit} s", None
    finally:
        signal.alarm(0)
    res["build_s"] = round(time.perf_counter() - t, 2)
    if res["ineligible"] is not None:
        return res
    res["notes"] = prob.notes
    res["params"] = sum(p.numel() for p in prob.model.parameters() if p.requires_grad)
    if variant == "direct":
        res.update(call_times(prob, limit))
    zoo_checks.run = shared_run(groups)  # this process runs one case: no restore needed
    for group in groups:
        res["groups"][group] = check_group(prob, group, limit)
    return res
