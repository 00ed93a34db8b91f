"""Memory per rank of curvlib on an FSDP2-sharded model, against the unsharded model.

    python benchmarks/fsdp_memory.py [--world 2] [--width 1024] [--depth 8] [--batch 16]
        [--out benchmarks/results/cpu/fsdp-memory.md]

Every rank (a fresh gloo process on CPU, one thread) builds the same float32 MLP (``depth``
``Linear(width, width)`` + ``tanh`` layers and a 10-way head), shards it with ``fully_shard``
per layer and at the root, and runs ``curvature(model, CrossEntropyLoss(), [ext])`` on its own
micro-batch of ``batch`` samples, once to warm up and once measured; then the same on an
unsharded copy with the same micro-batch, aggregated over the ranks (``process_group=``: what a
rank of plain data parallelism holds). Per
rank and method: the model's resident memory (``VmRSS`` after building it, above the process
before), and the call's own peak above the memory just before it (``VmHWM`` reset through
``/proc/self/clear_refs``; allocations above 128 KiB mapped and unmapped one by one,
``MALLOC_MMAP_THRESHOLD_``, so that a peak does not hide in pages an earlier call left
resident), and the part of it the call returns (its results' local shards). Figures are rank 0's.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

METHODS = ("BatchL2Grad", "DiagGGNMC", "KFAC")


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


def _result_mib(results: dict) -> float:
    """MiB of the results a rank keeps: a DTensor's local shard, a plain tensor whole."""
    def mib(v) -> float:
        if isinstance(v, dict):
            return sum(mib(x) for x in v.values())
        if isinstance(v, (list, tuple)):
            return sum(mib(x) for x in v)
        if isinstance(v, torch.Tensor):
            t = v.to_local() if hasattr(v, "to_local") else v
            return t.numel() * t.element_size() / 2**20
        return 0.0

    return mib(results)


def _extension(name: str):
    from curvlib import extensions

    return extensions.KFAC(max_factor_dim=256) if name == "KFAC" else getattr(extensions, name)()


def _rank(rank: int, world: int, port: int, args: dict, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    from torch.distributed.fsdp import fully_shard

    from curvlib import curvature

    torch.manual_seed(0)
    width, depth, n = args["width"], args["depth"], args["batch"]
    before = _status_mib("VmRSS")
    layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    plain = copy.deepcopy(model)
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(model)
    sharded_mib = _status_mib("VmRSS") - before  # (both models: the plain one is subtracted below)
    params_mib = sum(p.numel() * p.element_size() for p in plain.parameters()) / 2**20
    g = torch.Generator().manual_seed(rank)
    X, y = torch.randn(n, width, generator=g), torch.randint(0, 10, (n,), generator=g)
    def fsdp_backward(m):
        nn.CrossEntropyLoss()(m(X), y).backward()

    fsdp_backward(model)  # (warm-up; the measured backward's gradients replace these)
    model.zero_grad(set_to_none=True)
    backward_mib = _call_peak(lambda: fsdp_backward(model))
    model.zero_grad(set_to_none=True)
    rows = []
    for method in METHODS:
        ext = _extension(method)
        f_sharded = curvature(model, nn.CrossEntropyLoss(), [ext])
        f_plain = curvature(plain, nn.CrossEntropyLoss(), [_extension(method)], process_group=dist.group.WORLD)
        results_mib = _result_mib(f_sharded(X, y))
        sharded = _call_peak(lambda: f_sharded(X, y))
        f_plain(X, y)
        unsharded = _call_peak(lambda: f_plain(X, y))
        rows.append({"method": method, "sharded_call_mib": sharded, "unsharded_call_mib": unsharded,
                     "sharded_results_mib": results_mib})
    local_mib = sum(p.to_local().numel() * p.element_size() for p in model.parameters()) / 2**20
    if rank == 0:
        Path(out).write_text(json.dumps({"world": world, **args, "params_mib": params_mib, "shard_mib": local_mib,
                                         "fsdp_backward_mib": backward_mib,
                                         "rss_both_models_mib": sharded_mib, "rows": rows}))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report(res: dict) -> str:
    lines = [
        "# curvlib on an FSDP2-sharded model: memory per rank",
        "",
        f"`python benchmarks/fsdp_memory.py --world {res['world']} --width {res['width']} --depth {res['depth']} "
        f"--batch {res['batch']}` (CPU, gloo, one thread per rank, float32; rank 0's figures).",
        "",
        f"Model: {res['depth']} x `Linear({res['width']}, {res['width']})` + tanh and a 10-way head, "
        f"{res['params_mib']:.1f} MiB of parameters; each rank holds a shard of {res['shard_mib']:.1f} MiB "
        f"between calls. Micro-batch: {res['batch']} samples per rank.",
        "",
        "| method | sharded: call's peak above before (MiB) | of which its returned results (MiB) | peak less results (MiB) "
        "| unsharded (DDP), same micro-batch (MiB) | sharded / unsharded | x world (target <= 1.2) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    world = res["world"]
    for r in res["rows"]:
        base, kept = r["unsharded_call_mib"], r.get("sharded_results_mib", float("nan"))
        ratio = f"{r['sharded_call_mib'] / base:.2f}" if base >= 1 else "n/a (reused pages)"
        scaled = f"{r['sharded_call_mib'] / base * world:.2f}" if base >= 1 else "n/a"
        lines.append(f"| {r['method']} | {r['sharded_call_mib']:.1f} | {kept:.1f} | {r['sharded_call_mib'] - kept:.1f} "
                     f"| {base:.1f} | {ratio} | {scaled} |")
    if "fsdp_backward_mib" in res:
        lines += ["", f"FSDP's own forward and `loss.backward()` on the same sharded model and micro-batch peak at "
                      f"{res['fsdp_backward_mib']:.1f} MiB above before (its sharded `.grad`, {res['shard_mib']:.1f} MiB, "
                      "included): the floor of any call that gathers layer by layer and returns a sharded gradient."]
    lines += [
        "",
        "A sharded call gathers each parameter (one all-gather) when its layer's forward reads it and "
        "drops it when the layer is done; what autograd saves of it for the backward is kept as its name "
        "and gathered again when the backward reads it. The summed results of parameters sharded along "
        "their rows (all of them here) are reduce-scattered into the rank's rows: the first-order ones "
        "as each layer's are read during the backward (without Variance or batch slices), a "
        "second-order diagonal of one column (the Monte-Carlo GGN's with one sample) as each layer's is "
        "read during that column's backward, other second-order results and Kronecker factors one at a "
        "time after the call. So the peak holds the parameters of the layers being computed, the rank's "
        "shards of its results, one layer's buffer and the local results reduced after the call (the "
        "Kronecker factors here). Between calls a rank holds its shard only. The "
        "target: 1/world of the unsharded call's memory plus the micro-batch's activations (under 1 MiB "
        "here), within 20%: `sharded / unsharded x world <= 1.2`.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", default="benchmarks/results/cpu/fsdp-memory.md")
    a = parser.parse_args()
    import torch.multiprocessing as mp

    raw = a.out + ".json"
    args = {"width": a.width, "depth": a.depth, "batch": a.batch}
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
