"""Compiled against eager curvlib on one problem, with TF32 on and off, against a float64 twin.

    python benchmarks/compiled_check.py --device cuda --problem 3c3d-256

Where ``compile=True`` and eager differ on a GPU, this script says which side is off: each
float32 result (eager, compiled; TF32 allowed or not) is compared with the same extension in
float64 (eager, no TF32), relative error = max|a - b| / max|b| over the whole result. Prints one line per (extension, TF32, mode).
"""

from __future__ import annotations

import argparse
import time

import torch

import problems
from curvlib import curvature, extensions


def _rel(a: dict, b: dict) -> float:
    num = max(float((a[k].double() - b[k].double()).abs().max()) for k in b)
    den = max(float(b[k].double().abs().max()) for k in b)
    return num / den


def _tf32(on: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--problem", default="3c3d-256")
    parser.add_argument("--extensions", nargs="+", default=["BatchGrad", "DiagGGNExact"])
    args = parser.parse_args()
    build = problems.PROBLEMS.get(args.problem) or problems.GPU_PROBLEMS[args.problem]
    for name in args.extensions:
        ext = getattr(extensions, name)
        _tf32(False)
        model, lossfn, X, y = build(device=args.device, dtype=torch.float64)
        reference = curvature(model, lossfn, [ext()])(X, y)[ext().name]
        for tf32 in (True, False):
            _tf32(tf32)
            model, lossfn, X, y = build(device=args.device, dtype=torch.float32)
            for compile_ in (False, True):
                start = time.perf_counter()
                got = curvature(model, lossfn, [ext()], compile=compile_)(X, y)[ext().name]
                seconds = time.perf_counter() - start
                print(f"{args.problem} {name:14s} tf32={tf32!s:5s} compiled={compile_!s:5s} "
                      f"rel vs float64 {_rel(got, reference):.2e}  first call {seconds:.1f} s", flush=True)


if __name__ == "__main__":
    main()
