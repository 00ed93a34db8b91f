"""KFAC / EKFAC natural gradient (``curvlib.optim.KFACOptimizer``) vs SGD and Adam on digits.

Trains the same MLP on scikit-learn's 8x8 digits with each optimizer (same initial
weights, same mini-batches) and plots training loss and test accuracy per step and per
wall-clock second into ``<out>/natural_gradient.png``.

    python examples/natural_gradient.py            # 400 steps each
    python examples/natural_gradient.py --quick    # 60 steps each, seconds on a CPU

Needs scikit-learn (the data) and matplotlib (the figure).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn

from curvlib.optim import KFACOptimizer


def _require(module: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as err:
        raise SystemExit(f"examples/natural_gradient.py needs {module.split('.')[0]}: pip install "
                         f"{'scikit-learn' if module.startswith('sklearn') else module.split('.')[0]}") from err


def digits(seed: int = 0):
    """Standardised digits ``([N, 64], [N])`` split 1437/360 (train/test), float32."""
    data = _require("sklearn.datasets").load_digits()
    X = torch.tensor(data.data, dtype=torch.float32)
    X = (X - X.mean(0)) / (X.std(0) + 1e-6)
    y = torch.tensor(data.target)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    X, y = X[perm], y[perm]
    return (X[:1437], y[:1437]), (X[1437:], y[1437:])


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))


def _torch_step(opt, model, lossfn):
    def step(X, y):
        opt.zero_grad()
        loss = lossfn(model(X), y)
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def optimizers(model: nn.Module, lossfn):
    """name -> ``step(X, y) -> loss`` for the four methods (hyper-parameters tuned roughly)."""
    yield "SGD", _torch_step(torch.optim.SGD(model.parameters(), lr=0.1), model, lossfn)
    yield "Adam", _torch_step(torch.optim.Adam(model.parameters(), lr=3e-3), model, lossfn)
    for kind in ("kfac", "ekfac"):
        opt = KFACOptimizer(model, lossfn, lr=0.3, damping=1e-2, curvature=kind, kl_clip=1e-2,
                            factor_interval=1, inverse_interval=5, ema_decay=0.9,
                            generator=torch.Generator().manual_seed(0))
        yield kind.upper(), opt.step


def train(name: str, steps: int, batch: int, seed: int = 0) -> dict:
    """One run: per step the batch loss, the elapsed seconds, and (every 10 steps) test accuracy."""
    (Xtr, ytr), (Xte, yte) = digits(seed)
    lossfn = nn.CrossEntropyLoss()
    model = mlp(seed)
    step = dict(optimizers(model, lossfn))[name]
    batches = torch.Generator().manual_seed(seed + 1)
    log = {"loss": [], "time": [], "acc_step": [], "acc": []}
    start = time.perf_counter()
    for t in range(steps):
        idx = torch.randint(0, len(ytr), (batch,), generator=batches)
        log["loss"].append(float(step(Xtr[idx], ytr[idx])))
        log["time"].append(time.perf_counter() - start)
        if t % 10 == 9 or t == steps - 1:
            with torch.no_grad():
                log["acc"].append(float((model(Xte).argmax(1) == yte).float().mean()))
            log["acc_step"].append(t)
    with torch.no_grad():
        log["final_loss"] = float(lossfn(model(Xtr), ytr))
    return log


def plot(logs: dict, path: str) -> None:
    plt = _require("matplotlib.pyplot")
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for name, log in logs.items():
        times = [log["time"][t] for t in log["acc_step"]]
        axes[0, 0].plot(log["loss"], label=name)
        axes[0, 1].plot(log["time"], log["loss"], label=name)
        axes[1, 0].plot(log["acc_step"], log["acc"], label=name)
        axes[1, 1].plot(times, log["acc"], label=name)
    for ax, (x, y) in zip(axes.flat, [("step", "train loss"), ("seconds", "train loss"),
                                      ("step", "test accuracy"), ("seconds", "test accuracy")]):
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        if y == "train loss":
            ax.set_yscale("log")
        ax.legend()
    fig.suptitle("MLP on digits: natural gradient (curvlib.optim.KFACOptimizer) vs SGD and Adam")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> dict:
    """Run every optimizer, print the final losses, save the figure; returns the logs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="60 steps per optimizer instead of 400")
    parser.add_argument("--out", default="figures", help="folder for natural_gradient.png (default: figures/)")
    args = parser.parse_args(argv)
    _require("sklearn.datasets")
    _require("matplotlib")
    _require("matplotlib.pyplot").switch_backend("Agg")
    steps = 60 if args.quick else 400
    if args.quick:
        torch.set_num_threads(1)  # tiny matrices: threads only contend on a shared 2-core runner
    logs = {}
    for name in ("SGD", "Adam", "KFAC", "EKFAC"):
        logs[name] = train(name, steps, batch=128)
        log = logs[name]
        print(f"{name:6s} final train loss {log['final_loss']:.4f}  test accuracy {log['acc'][-1]:.3f}  "
              f"{log['time'][-1]:.1f} s")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "natural_gradient.png")
    plot(logs, path)
    print(f"saved {path}")
    return logs


if __name__ == "__main__":
    main()
