"""DP-SGD's clipped gradient on an FSDP2-sharded model: curvlib against Opacus' FSDP ghost clipping.

    python benchmarks/fsdp_dp_sgd.py [--world 2] [--width 1024] [--depth 8] [--batch 16] [--reps 5]
        [--out benchmarks/results/cpu/fsdp-dp-sgd.md]

Every rank (a fresh gloo process on CPU, one thread) builds the same float32 MLP (``depth``
``Linear(width, width)`` + ``tanh`` layers and a 10-way head) twice and shards both per layer and
at the root (the second with Opacus' ``FSDP2Wrapper``, which does the same for these layers), with
gradients summed over the ranks (``set_gradient_divide_factor(1.0)``, a plain SUM). One step of each, on the
rank's own micro-batch of ``batch`` samples, gives the clipped sum
$\\sum_n \\min(1, C / \\lVert g_n \\rVert)\\, g_n$ in the model's sharded ``.grad``:

* curvlib: ``curvature(model, CrossEntropyLoss(reduction="sum"), [BatchL2Grad()])`` for the
  per-sample norms $\\lVert g_n \\rVert^2$, then one backward of the reweighted loss
  $\\sum_n c_n \\ell_n$ through FSDP (``examples/dp_sgd.py``'s ghost way);
* Opacus: ``GradSampleModuleFastGradientClippingFSDP`` (ghost clipping), its first backward
  giving the norms through hooks, then its second backward of the reweighted loss
  (``DPTensorFastGradientClipping.backward``'s two passes, without the optimizer's noise).

Per rank and method: the step's median wall time over ``reps`` steps after one to warm up, and
the step's own peak memory above the memory just before it (``VmHWM`` reset through
``/proc/self/clear_refs``; allocations above 128 KiB mapped and unmapped one by one). The two
clipped gradients are compared (largest relative difference over the parameters). Figures are
rank 0's.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

MAX_NORM = 1.0


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def _call_peak(fn) -> float:
    """MiB the call ``fn()`` holds at its peak above the resident memory just before it."""
    before = _status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    fn()
    return _status_mib("VmHWM") - before


def _summing(model: nn.Module) -> None:
    """FSDP averages the gradient over the ranks by default: DP-SGD's clipped *sum* instead (a plain
    SUM: gloo has no ``PREMUL_SUM``, which FSDP would use for a float32 factor)."""
    for m in model.modules():
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def _clip(sq_norms) -> torch.Tensor:
    """$c_n = \\min(1, C / (\\lVert g_n \\rVert + 10^{-6}))$, Opacus' clipping factor."""
    return (MAX_NORM / (sq_norms.sqrt() + 1e-6)).clamp(max=1.0)


def _curvlib_step(model, X, y):
    from curvlib import curvature
    from curvlib.extensions import BatchL2Grad

    f = curvature(model, nn.CrossEntropyLoss(reduction="sum"), [BatchL2Grad()])
    per_sample = nn.CrossEntropyLoss(reduction="none")

    def step():
        sq = torch.stack(list(f(X, y)["batch_l2"].values())).sum(0)
        (_clip(sq) * per_sample(model(X), y)).sum().backward()

    return step


def _opacus_step(model, X, y):
    from opacus.grad_sample.grad_sample_module_fast_gradient_clipping_fsdp import (
        GradSampleModuleFastGradientClippingFSDP)

    gsm = GradSampleModuleFastGradientClippingFSDP(model, batch_first=True, loss_reduction="sum",
                                                   max_grad_norm=MAX_NORM)
    per_sample = nn.CrossEntropyLoss(reduction="none")

    def step():
        losses = per_sample(gsm(X), y)
        losses.sum().backward(retain_graph=True)  # (the hooks' per-sample norms)
        model.zero_grad(set_to_none=True)
        coeff = gsm.get_clipping_coef()
        gsm.disable_hooks()
        (coeff * losses).sum().backward()
        gsm.enable_hooks()

    return step


def _measure(step, model, reps: int):
    model.zero_grad(set_to_none=True)
    step()  # (warm-up: plans, caches)
    times = []
    for _ in range(reps):
        model.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    dist.barrier()
    peak = _call_peak(step)
    return statistics.median(times), peak


def _rank(rank: int, world: int, port: int, args: dict, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    from opacus.utils.fsdp_utils import FSDP2Wrapper
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    width, depth, n = args["width"], args["depth"], args["batch"]
    layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    theirs = FSDP2Wrapper(copy.deepcopy(model))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(model)
    _summing(model)
    _summing(theirs)
    params_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    g = torch.Generator().manual_seed(rank)
    X, y = torch.randn(n, width, generator=g), torch.randint(0, 10, (n,), generator=g)
    rows = []
    for name, net, make in (("curvlib", model, _curvlib_step), ("Opacus (ghost, FSDP)", theirs, _opacus_step)):
        seconds, peak = _measure(make(net, X, y), net, args["reps"])
        rows.append({"method": name, "seconds": seconds, "peak_mib": peak})
    ours = dict(model.named_parameters())
    diff = 0.0
    for key, p in theirs.named_parameters():  # (after the peak's step: the same batch on both)
        a, b = ours[key.removeprefix("_module.")].grad.full_tensor(), p.grad.full_tensor()
        diff = max(diff, float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)))
    if rank == 0:
        Path(out).write_text(json.dumps({"world": world, **args, "params_mib": params_mib, "rows": rows,
                                         "max_rel_diff": diff}))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report(res: dict) -> str:
    lines = [
        "# DP-SGD's clipped gradient on an FSDP2-sharded model: curvlib and Opacus",
        "",
        f"`python benchmarks/fsdp_dp_sgd.py --world {res['world']} --width {res['width']} --depth {res['depth']} "
        f"--batch {res['batch']} --reps {res['reps']}` (CPU, gloo, one thread per rank, float32; rank 0's figures).",
        "",
        f"Model: {res['depth']} x `Linear({res['width']}, {res['width']})` + tanh and a 10-way head, "
        f"{res['params_mib']:.1f} MiB of parameters, sharded per layer and at the root over {res['world']} ranks. "
        f"Micro-batch: {res['batch']} samples per rank; clipping norm {MAX_NORM}. One step: the per-sample "
        "norms, then one backward of the reweighted loss into the sharded `.grad`.",
        "",
        "| method | step, median (s) | step's peak above before (MiB) |",
        "|---|---:|---:|",
    ]
    for r in res["rows"]:
        lines.append(f"| {r['method']} | {r['seconds']:.3f} | {r['peak_mib']:.1f} |")
    lines += [
        "",
        f"The two clipped gradients agree to {res['max_rel_diff']:.1e} (largest difference relative to the "
        "largest entry, per parameter, float32).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/cpu/fsdp-dp-sgd.md")
    a = parser.parse_args()
    import torch.multiprocessing as mp

    raw = a.out + ".json"
    args = {"width": a.width, "depth": a.depth, "batch": a.batch, "reps": a.reps}
    # every allocation above 128 KiB its own mapping, returned at once when freed (glibc otherwise
    # raises the threshold and keeps freed pages resident, which later peaks reuse unseen)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
    mp.start_processes(_rank, args=(a.world, _free_port(), args, raw), nprocs=a.world, start_method="spawn")
    res = json.loads(Path(raw).read_text())
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    Path(a.out).write_text(report(res))
    sys.stdout.write(report(res))


if __name__ == "__main__":
    main()
