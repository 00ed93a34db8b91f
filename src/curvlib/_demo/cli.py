"""``python -m curvlib``'s command line: options, the columns' legend, argument checks."""

from __future__ import annotations

import argparse
import os
from typing import Callable, List, Optional, Sequence

import torch

__all__ = ["COLUMNS", "device_of", "parser", "selected"]


def parser(rounds: int) -> argparse.ArgumentParser:
    """The demo's argument parser (``rounds``: the default number of timed rounds)."""
    parser = argparse.ArgumentParser(
        prog="python -m curvlib",
        description=(
            "Run every curvlib extension (or those named) on a tiny seeded CNN in float64, "
            "check each result against a brute-force torch.func/autograd reference, time each "
            "extension against a plain loss.backward(), and save a PNG summary."
        ),
        epilog=COLUMNS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default="cpu", help="torch device to run on (default: cpu; e.g. cuda)")
    parser.add_argument(
        "--extensions", nargs="+", metavar="NAME", default=None,
        help="extension classes to run (default: all), e.g. BatchGrad DiagGGNExact KFAC",
    )
    parser.add_argument(
        "--out", default=os.path.join("figures", "curvlib_demo.png"),
        help="where the PNG summary goes (default: figures/curvlib_demo.png; needs matplotlib)",
    )
    parser.add_argument("--no-plot", action="store_true", help="write no figure")
    parser.add_argument("--rounds", type=int, default=rounds, help=f"timed rounds (default {rounds})")
    return parser


COLUMNS = """\
columns of the per-parameter tables:
  quantity   the extension class and, in brackets, its result key in the dict f(X, y) returns
  layout     the result's shape for this parameter ("2 factors [B] [A]": Kronecker factors;
             "callable": a block product V [K, *p] -> [K, *p])
  norm       Frobenius norm of the result (of its factors; of its product with a seeded V)
  max |dev|  largest absolute deviation from the brute-force reference; "unchecked" where
             there is no exact one (Monte-Carlo estimates, Kronecker approximations)
timings: median of interleaved rounds, each extension alone, relative to loss.backward()."""


def device_of(name: str) -> torch.device:
    """``--device``, refused clearly when torch does not know it or it is not available."""
    try:
        device = torch.device(name)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as err:
        raise SystemExit(f"--device {name!r} cannot be used here: {err}") from None
    if device.type == "meta":
        raise SystemExit("--device meta holds no values to check; use cpu or cuda")
    return device


def selected(exported: Callable[[], List[type]], names: Optional[Sequence[str]]) -> List[type]:
    """The exported extension classes, or those named (an unknown name is a clear error)."""
    classes = exported()
    if names is None:
        return classes
    by_name = {c.__name__: c for c in classes}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown extension(s) {unknown}; known: {sorted(by_name)}")
    return [by_name[n] for n in names]
