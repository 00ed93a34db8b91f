"""Which front end for which model: torch.fx's symbolic trace against the ATen-level trace, on the zoo.

    python benchmarks/front_end.py [--models gpt2_eager tv_resnet18 ...]

For every model of ``tests/oracles/zoo.py`` (float64, eval mode, tiny configs), bare (dict ``X``,
``output=``) and behind the one-line wrapper of ``oracles.zoo.wrapped``: which front end curvlib
picks (``fx``: torch.fx gave a complete program; ``aten``: it did not), the time of the first
``curvature(...)(X, y)`` call with BatchGrad (trace, plan, evaluate; one torch thread), the same
call with the ATen front end forced (``curvlib._plan.traces.needs_aten`` patched to say yes), and
the largest difference of ``grad_batch`` and ``diag_ggn_exact`` between the two, relative to the
largest entry. Input for the decision in docs/how-it-works.md ("Front end").
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import torchvision_shim  # noqa: E402  (before transformers, timm, torchvision import it)

torchvision_shim.install()

from oracles import zoo  # noqa: E402
from curvlib import curvature  # noqa: E402
from curvlib._plan import traces  # noqa: E402
from curvlib.extensions import BatchGrad, DiagGGNExact  # noqa: E402


def _call(prob, ext, force: bool):
    original, aten = traces.needs_aten, traces.trace_aten_program
    used = []
    traces.trace_aten_program = lambda *a, **k: used.append(1) or aten(*a, **k)
    if force:
        traces.needs_aten = lambda *a: True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = time.perf_counter()
            f = curvature(prob.model, prob.lossfn, [ext], output=prob.output)
            qs = f(prob.X, prob.y)
            first = time.perf_counter() - t
            front = "aten" if used else "fx"
    finally:
        traces.needs_aten, traces.trace_aten_program = original, aten
    return qs, first, front


def _diff(a: dict, b: dict) -> float:
    scale = max(float(v.abs().max()) for v in b.values())
    return max(float((a[k] - v).abs().max()) for k, v in b.items()) / scale


def row(name: str, wrap: bool) -> str:
    prob = zoo.build(name)
    prob = zoo.wrapped(prob) if wrap else prob
    cells = []
    chosen, t_chosen, t_aten, errs = None, 0.0, 0.0, []
    for ext, key in ((BatchGrad(), "grad_batch"), (DiagGGNExact(), "diag_ggn_exact")):
        qs, t, front = _call(prob, ext, force=False)
        qa, ta, _ = _call(prob, ext, force=True)
        if key == "grad_batch":
            chosen, t_chosen, t_aten = front, t, ta
        errs.append(_diff(qs[key], qa[key]))
    cells = [name + (" (wrapped)" if wrap else ""), chosen, f"{t_chosen:.2f}", f"{t_aten:.2f}",
             f"{t_aten / t_chosen:.2f}", f"{max(errs):.1e}"]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=zoo.NAMES)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| model | front end | first call (s) | ATen forced (s) | ratio | max rel. diff |")
    print("|---|---|---:|---:|---:|---:|")
    for name in args.models:
        for wrap in (False, True):
            try:
                print(row(name, wrap), flush=True)
            except Exception as exc:  # noqa: BLE001 - a report: say what failed and go on
                print(f"| {name}{' (wrapped)' if wrap else ''} | failed: {type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:120]} | | | | |", flush=True)


if __name__ == "__main__":
    main()
