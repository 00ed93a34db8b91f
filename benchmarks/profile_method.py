"""Where does a method's time go? ``torch.profiler`` top operators for one (problem, method).

    python benchmarks/profile_method.py 3c3d DiagGGNExact [--top 8] [--calls 3] [--threads T]

Sets the method up as ``run.py`` does, calls it twice untimed, then profiles
``--calls`` calls and prints the operators with the largest self CPU time
(``--device cuda``: self CUDA time).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from problems import METHODS, PROBLEMS


def top_ops(problem: str, method: str, top: int = 8, calls: int = 3, device: str = "cpu", seed: int = 0):
    """The ``top`` operators by self time: list of ``(name, self_ms_per_call, share, count_per_call)``."""
    run = METHODS[method](PROBLEMS[problem](device=device, seed=seed))
    for _ in range(2):
        run()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            run()
    cuda = device.startswith("cuda")
    events = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    total = sum(getattr(e, attr) for e in events) or 1.0
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    return [(e.key, getattr(e, attr) / 1e3 / calls, getattr(e, attr) / total, e.count / calls) for e in events[:top]]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("problem", choices=list(PROBLEMS))
    parser.add_argument("method", choices=list(METHODS))
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"{args.problem} / {args.method}: top {args.top} operators by self time (ms per call)")
    for name, ms, share, count in top_ops(args.problem, args.method, args.top, args.calls, args.device):
        print(f"  {ms:9.2f} ms  {100 * share:5.1f}%  x{count:<6g} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
