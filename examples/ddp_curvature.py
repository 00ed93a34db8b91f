"""Data-parallel training with DistributedDataParallel, reading curvature each step.

Two gloo processes on 127.0.0.1 (CPU) train a small classifier with DDP. Each
step, every rank also calls ``curvature(..., process_group=WORLD)`` on its own
shard and gets the quantities of the *global* batch: the loss, the gradient
(equal to the gradient DDP averaged), the GGN diagonal and the gradient
variance. Rank 0 prints them.

    python examples/ddp_curvature.py                 # 20 steps; figures/ddp_curvature.png
    python examples/ddp_curvature.py --quick --out DIR   # 6 steps; the PNG into DIR

It stops on its own (and is killed after 120 s at most). The signal-to-noise
ratio printed is ``‖ḡ‖² / (tr Σ / N)`` with ``Σ`` the per-sample gradients'
covariance (see examples/noise_monitor.py). The figure ``ddp_curvature.png``
shows, over steps, the global loss, that SNR, and the mean GGN diagonal per
parameter, all as rank 0 received them from the collective call.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from curvlib import curvature
from curvlib.extensions import DiagGGNExact, Variance

WORLD = 2
LOCAL_BATCH = 32
TIMEOUT_S = 120


def train(rank: int, port: int, steps: int, figure: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    try:
        torch.manual_seed(0)  # the same initial model on every rank (DDP broadcasts rank 0's anyway)
        model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3))
        ddp = DDP(model)
        lossfn = nn.CrossEntropyLoss()
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
        # Built once, on the module DDP wraps; every rank calls it each step (a collective).
        f = curvature(ddp.module, lossfn, [DiagGGNExact(), Variance()], process_group=dist.group.WORLD)

        teacher = torch.randn(10, 3, generator=torch.Generator().manual_seed(1))
        shard = torch.Generator().manual_seed(100 + rank)  # each rank draws its own data
        if rank == 0:
            print(f"{WORLD} ranks x {LOCAL_BATCH} samples; quantities of the global batch of "
                  f"{WORLD * LOCAL_BATCH}")
            print(f"{'step':>4} {'loss':>8} {'|grad-DDP|':>10} "
                  + " ".join(f"{'diagGGN ' + n:>16}" for n, _ in model.named_parameters())
                  + f" {'mean var':>9} {'SNR':>7}")
        log = {"loss": [], "snr": [], "diag": {n: [] for n, _ in model.named_parameters()}}
        for step in range(steps):
            X = torch.randn(LOCAL_BATCH, 10, generator=shard)
            y = (X @ teacher).argmax(1)

            opt.zero_grad()
            lossfn(ddp(X), y).backward()  # DDP averages the ranks' gradients
            qs = f(X, y)                   # global loss, gradient, GGN diagonal, variance

            # With equal local batches, DDP's average is the global batch's gradient.
            dev = max(float((p.grad - qs["grad"][n]).abs().max()) for n, p in model.named_parameters())
            grads = torch.cat([g.flatten() for g in qs["grad"].values()])
            var = torch.cat([v.flatten() for v in qs["variance"].values()])
            n_global = WORLD * LOCAL_BATCH
            # Signal-to-noise of the mini-batch gradient: BackPACK's variance (of the g_n,
            # which carry the 1/N of the mean) times N is the variance of the batch mean.
            snr = float(grads.pow(2).sum() / (n_global * var.sum()))
            if rank == 0:
                log["loss"].append(float(qs["loss"]))
                log["snr"].append(snr)
                for n, d in qs["diag_ggn_exact"].items():
                    log["diag"][n].append(float(d.mean()))
                diag = " ".join(f"{float(d.mean()):16.3e}" for d in qs["diag_ggn_exact"].values())
                print(f"{step:4d} {float(qs['loss']):8.4f} {dev:10.1e} {diag} "
                      f"{float(var.mean()):9.2e} {snr:7.3f}", flush=True)
            assert dev < 1e-5, f"rank {rank}: aggregated gradient differs from DDP's by {dev}"
            opt.step()
        dist.barrier()
        if rank == 0:
            plot(log, figure)
            print(f"figure saved to {figure}")
    finally:
        dist.destroy_process_group()


def plot(log: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = figure(log)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def figure(log: dict):
    """The figure of ``log`` (``{"loss": [...], "snr": [...], "diag": {name: [...]}}``, one entry a step)."""
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    # 800 px wide at 100 dpi, the width of the documentation's column: two panels above, the
    # GGN diagonals below with their legend beside the data, every text at 9 pt or more
    with plt.rc_context({"font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "xtick.labelsize": 9,
                         "ytick.labelsize": 9, "legend.fontsize": 9}):
        fig = plt.figure(figsize=(8, 6.2), layout="constrained")
        top, bottom = fig.subfigures(2, 1, height_ratios=[1, 1])
        loss_ax, snr_ax = top.subplots(1, 2)
        diag_ax = bottom.subplots(1, 1)
        loss_ax.plot(log["loss"], "o-")
        loss_ax.set_title("loss of the global batch")
        snr_ax.semilogy(log["snr"], "o-")
        # plain numbers on the log axis (its default 3.8x10^0 minor labels run into each other)
        snr_ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.3g"))
        snr_ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.2g"))
        snr_ax.set_title("gradient SNR  ‖ḡ‖² / (tr Σ / N)")
        for name, values in log["diag"].items():
            diag_ax.semilogy(values, "o-", label=name)
        diag_ax.set_title("mean diag GGN per parameter")
        diag_ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5), frameon=False)
        for ax in (loss_ax, snr_ax, diag_ax):
            ax.set_xlabel("step")
        fig.suptitle(f"DDP, {WORLD} gloo ranks x {LOCAL_BATCH} samples: the global batch's quantities (rank 0)")
        fig.canvas.draw()  # lay out inside the context: its font sizes
    return fig


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (under a minute on 2 cores)")
    parser.add_argument("--out", default="figures", help="folder for the PNG (created if missing)")
    parser.add_argument("--steps", type=int, default=None, help="default 20 (6 with --quick)")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:  # checked here, used by rank 0
        sys.exit("the figure needs `matplotlib`: pip install matplotlib  (or pip install -e '.[examples]')")
    os.makedirs(args.out, exist_ok=True)
    steps = args.steps or (6 if args.quick else 20)
    figure = os.path.join(args.out, "ddp_curvature.png")
    ctx = mp.start_processes(train, args=(_free_port(), steps, figure), nprocs=WORLD, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                print(f"timed out after {TIMEOUT_S} s", file=sys.stderr)
                return 1
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
