"""Gradient-noise monitoring during training (in the spirit of Cockpit), from one curvlib call per step.

What it shows. An MLP trains on scikit-learn's digits with SGD; every step one
``curvature(model, nn.CrossEntropyLoss(), [Variance(), BatchL2Grad(),
DiagGGNExact()])`` call gives the gradient used for the update *and* the
instruments below, per layer ``L`` (a module owning parameters):

* signal-to-noise ratio of the mini-batch gradient,

      SNR_L = ‖ḡ_L‖² / (tr Σ_L / N),

  ``ḡ = (1/N) Σ_n ∇ℓ_n`` the batch gradient (``qs["grad"]``), ``Σ_L`` the
  empirical covariance (1/N-normalised) of the per-sample gradients
  ``∇ℓ_n`` restricted to the layer's parameters, so ``tr Σ_L / N`` is the
  variance of ḡ as an estimate of the expected gradient. With
  ``reduction="mean"`` curvlib's (BackPACK's) ``variance`` is that of the
  ``g_n = ∇ℓ_n / N``, hence ``tr Σ_L = N² Σ_{p∈L} Σ variance[p]`` and
  ``SNR_L = ‖ḡ_L‖² / (N Σ_{p∈L} Σ variance[p])``. SNR ≫ 1: the batch
  gradient is reliable; SNR ≪ 1: noise dominates (a larger batch or a smaller
  step pays off);
* curvature, the trace of the layer's diagonal GGN of the mean loss,
  ``tr G_L = Σ_{p∈L} Σ diag_ggn_exact[p]``;
* the distribution of per-sample gradient norms over the whole model,
  ``‖∇ℓ_n‖ = N · sqrt(Σ_p batch_l2[p][n])``, as quantiles per step.

Run (needs scikit-learn and matplotlib)::

    python examples/noise_monitor.py               # ~10 s
    python examples/noise_monitor.py --quick       # about 10 s on one CPU core
    python examples/noise_monitor.py --out DIR     # default figures/

The figure ``noise_monitor.png`` has four panels over training steps: loss
and test accuracy; the SNR per layer; tr diag GGN per layer; the 5/25/50/75/95%
quantiles of the per-sample gradient norms.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Dict, List

import torch
from torch import Tensor, nn

from curvlib import curvature
from curvlib.extensions import BatchL2Grad, DiagGGNExact, Variance

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def require(module: str, what: str):
    """Import an optional dependency or exit with a message saying how to get it."""
    try:
        return __import__(module)
    except ImportError:
        sys.exit(f"{what} needs `{module}`: pip install scikit-learn matplotlib  (or pip install -e '.[examples]')")


def load_digits(seed: int = 0):
    """scikit-learn's digits, pixels in [0, 1]: ``X [N, 64]``, ``y [N]``, 60/40 train/test split."""
    require("sklearn", "the digits data")
    from sklearn.datasets import load_digits as _load
    from sklearn.model_selection import train_test_split

    d = _load()
    X, y = torch.tensor(d.data, dtype=torch.float32) / 16.0, torch.tensor(d.target)
    return train_test_split(X, y, test_size=0.4, random_state=seed, stratify=y)


def layer_of(name: str) -> str:
    """``"2.weight" -> "2"``: the module owning the parameter."""
    return name.rpartition(".")[0] or name


def layer_statistics(qs: Dict, n: int) -> Dict[str, Dict[str, float]]:
    """Per layer: ``snr`` and ``tr_ggn`` (see the module docstring), from a ``reduction="mean"`` call's result."""
    stats: Dict[str, Dict[str, float]] = {}
    for name, g in qs["grad"].items():
        s = stats.setdefault(layer_of(name), {"signal": 0.0, "var": 0.0, "tr_ggn": 0.0})
        s["signal"] += float(g.pow(2).sum())
        s["var"] += float(qs["variance"][name].sum())
        s["tr_ggn"] += float(qs["diag_ggn_exact"][name].sum())
    return {k: {"snr": s["signal"] / (n * s["var"]), "tr_ggn": s["tr_ggn"]} for k, s in stats.items()}


def per_sample_norms(qs: Dict, n: int) -> Tensor:
    """``[N]``: ``‖∇ℓ_n‖ = N sqrt(Σ_p batch_l2[p][n])`` (the mean's 1/N undone)."""
    return n * torch.stack(list(qs["batch_l2"].values())).sum(0).sqrt()


def train(args) -> Dict[str, List]:
    """SGD on digits, one curvlib call per step; return the logged series."""
    X_tr, X_te, y_tr, y_te = load_digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
    f = curvature(model, nn.CrossEntropyLoss(), [Variance(), BatchL2Grad(), DiagGGNExact()])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    log: Dict[str, List] = {"step": [], "loss": [], "acc_step": [], "acc": [], "layers": [], "norms": []}
    gen, step = torch.Generator().manual_seed(0), 0
    for _ in range(args.epochs):
        for idx in torch.randperm(len(X_tr), generator=gen).split(args.batch):
            qs = f(X_tr[idx], y_tr[idx])
            for name, p in model.named_parameters():
                p.grad = qs["grad"][name]  # the step uses curvlib's gradient: no second backward
            opt.step()
            log["step"].append(step)
            log["loss"].append(float(qs["loss"]))
            log["layers"].append(layer_statistics(qs, len(idx)))
            log["norms"].append(torch.quantile(per_sample_norms(qs, len(idx)), torch.tensor(QUANTILES)).tolist())
            step += 1
        with torch.no_grad():
            log["acc_step"].append(step)
            log["acc"].append(float((model(X_te).argmax(1) == y_te).float().mean()))
    return log


def plot(log: Dict[str, List], path: str) -> None:
    require("matplotlib", "the figure")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = log["step"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True)
    ax = axes[0, 0]
    ax.plot(steps, log["loss"], lw=0.8, label="training loss (batch)")
    ax.set_ylabel("loss")
    ax2 = ax.twinx()
    ax2.plot(log["acc_step"], log["acc"], "o-", color="tab:green", label="test accuracy")
    ax2.set_ylabel("test accuracy")
    ax.set_title("loss and accuracy")
    for key, ax, title in (("snr", axes[0, 1], "SNR = ‖ḡ‖² / (tr Σ / N) per layer"),
                           ("tr_ggn", axes[1, 0], "tr diag GGN per layer")):
        for layer in log["layers"][0]:
            ax.semilogy(steps, [s[layer][key] for s in log["layers"]], lw=0.9, label=f"layer {layer}")
        ax.set_title(title)
        ax.legend(fontsize=8)
    ax = axes[1, 1]
    q = torch.tensor(log["norms"])
    ax.fill_between(steps, q[:, 0], q[:, 4], alpha=0.2, label="5-95%")
    ax.fill_between(steps, q[:, 1], q[:, 3], alpha=0.4, label="25-75%")
    ax.plot(steps, q[:, 2], lw=1, label="median")
    ax.set_yscale("log")
    ax.set_title("per-sample gradient norm ‖∇ℓ_n‖ (BatchL2Grad)")
    ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.suptitle("gradient noise while training an MLP on digits (curvlib, one call per step)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (under a minute on 2 cores)")
    parser.add_argument("--out", default="figures", help="folder for the PNG (created if missing)")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.2)
    args = parser.parse_args(argv)
    args.epochs = args.epochs or (3 if args.quick else 20)
    require("matplotlib", "the figure")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    log = train(args)
    last = log["layers"][-1]
    print(f"{len(log['step'])} steps in {time.perf_counter() - t0:.1f}s; final test accuracy {log['acc'][-1]:.3f}")
    for layer, s in last.items():
        print(f"  layer {layer}: SNR {s['snr']:.3g}, tr diag GGN {s['tr_ggn']:.3g}")
    path = os.path.join(args.out, "noise_monitor.png")
    plot(log, path)
    print(f"figure saved to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
