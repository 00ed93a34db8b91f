"""Laplace approximation with curvlib as laplace-torch's curvature backend.

Trains a small MLP on scikit-learn's handwritten digits (1797 8x8 images,
shipped with scikit-learn: no download), fits a Laplace approximation around
the trained weights with ``backend=CurvlibGGN``, tunes the prior precision by
maximising the marginal likelihood, and compares the MAP network's and the
Laplace predictive's calibration on held-out digits. The reliability diagram
is saved as a PNG.

Needs (beside curvlib and torch): laplace-torch 0.3, scikit-learn, matplotlib.

    pip install --no-deps laplace-torch==0.3 asdfghjkl==0.1a4 backpack-for-pytorch==1.7.1 \
        unfoldNd curvlinops-for-pytorch==3.0.1 einconv linear_operator torchmetrics \
        lightning-utilities einops
    pip install scipy tqdm scikit-learn matplotlib
    python examples/laplace_digits.py --structure kron          # figures/laplace_digits.png
    python examples/laplace_digits.py --quick --out DIR          # under a minute; PNG into DIR

The figure ``laplace_digits.png`` is a reliability diagram per predictive
(accuracy per confidence bin against the diagonal of perfect calibration),
MAP next to Laplace, with accuracy, NLL and ECE in the titles.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def load_data(seed: int):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    X = torch.tensor(digits.data, dtype=torch.float32) / 16.0  # pixel values 0..16
    y = torch.tensor(digits.target, dtype=torch.long)
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, test_size=0.4, random_state=seed, stratify=y)
    return X_tr, y_tr, X_te, y_te


def train(model: nn.Module, X: torch.Tensor, y: torch.Tensor, epochs: int, seed: int) -> None:
    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    loader = DataLoader(TensorDataset(X, y), batch_size=64, shuffle=True)
    lossfn = nn.CrossEntropyLoss()
    model.train()
    for _ in range(epochs):
        for xb, yb in loader:
            opt.zero_grad()
            lossfn(model(xb), yb).backward()
            opt.step()
    model.eval()


def calibration(probs: torch.Tensor, y: torch.Tensor, bins: int = 10):
    """Accuracy, NLL, expected calibration error and the reliability-diagram bins."""
    conf, pred = probs.max(-1)
    correct = (pred == y).float()
    edges = torch.linspace(0, 1, bins + 1)
    centers, accs, confs, counts = [], [], [], []
    ece = 0.0
    for lo, hi in zip(edges[:-1], edges[1:]):
        mask = (conf > lo) & (conf <= hi)
        centers.append(float((lo + hi) / 2))
        counts.append(int(mask.sum()))
        if mask.any():
            accs.append(float(correct[mask].mean()))
            confs.append(float(conf[mask].mean()))
            ece += mask.float().mean().item() * abs(accs[-1] - confs[-1])
        else:
            accs.append(float("nan"))
            confs.append(float("nan"))
    nll = nn.functional.nll_loss(probs.clamp_min(1e-12).log(), y).item()
    return {
        "acc": correct.mean().item(), "nll": nll, "ece": ece,
        "centers": centers, "bin_acc": accs, "bin_conf": confs, "counts": counts,
    }


def reliability_diagram(results: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 4.2), sharey=True)
    for ax, (label, r) in zip(axes, results.items()):
        width = 1.0 / len(r["centers"])
        ax.bar(r["centers"], r["bin_acc"], width=width, edgecolor="black", alpha=0.75, label="accuracy")
        ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
        ax.plot(r["centers"], r["bin_conf"], "_", color="tab:red", ms=14, mew=2, label="mean confidence in bin")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("confidence")
        ax.set_title(f"{label}\nacc {r['acc']:.3f}  NLL {r['nll']:.3f}  ECE {r['ece']:.3f}")
        ax.set_aspect("equal")
    axes[0].set_ylabel("accuracy")
    axes[0].legend(loc="upper left", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--structure", choices=["diag", "kron", "full"], default="kron")
    parser.add_argument("--subset", choices=["all", "last_layer"], default="all",
                        help="weights under the Laplace approximation")
    parser.add_argument("--epochs", type=int, default=None, help="default 40 (10 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a short run (under a minute on 2 cores)")
    parser.add_argument("--out", default="figures", help="folder for the PNG (created if missing)")
    args = parser.parse_args()
    args.epochs = args.epochs or (10 if args.quick else 40)
    for module, pip in (("laplace", "laplace-torch (see the module docstring)"), ("sklearn", "scikit-learn"),
                        ("matplotlib", "matplotlib")):
        try:
            __import__(module)
        except ImportError:
            sys.exit(f"this example needs `{module}`: pip install {pip}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "laplace_digits.png")

    from laplace import Laplace

    from curvlib.laplace import CurvlibGGN

    X_tr, y_tr, X_te, y_te = load_data(args.seed)
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 10))
    t0 = time.perf_counter()
    train(model, X_tr, y_tr, args.epochs, args.seed)
    print(f"trained MLP ({sum(p.numel() for p in model.parameters())} parameters) "
          f"on {len(X_tr)} digits in {time.perf_counter() - t0:.1f}s")

    la = Laplace(model, "classification", subset_of_weights=args.subset,
                 hessian_structure=args.structure, backend=CurvlibGGN)
    t0 = time.perf_counter()
    la.fit(DataLoader(TensorDataset(X_tr, y_tr), batch_size=256))
    t_fit = time.perf_counter() - t0
    t0 = time.perf_counter()
    la.optimize_prior_precision(pred_type="glm", method="marglik", link_approx="probit")
    t_prior = time.perf_counter() - t0
    print(f"Laplace ({args.subset}, {args.structure}, CurvlibGGN): fit {t_fit:.2f}s, prior optimisation {t_prior:.2f}s, "
          f"prior precision {la.prior_precision.item():.3g}, "
          f"log marginal likelihood {la.log_marginal_likelihood().item():.1f}")

    with torch.no_grad():
        map_probs = torch.softmax(model(X_te), -1)
    la_probs = la(X_te, pred_type="glm", link_approx="probit")

    results = {"MAP": calibration(map_probs, y_te),
               f"Laplace ({args.subset}, {args.structure})": calibration(la_probs, y_te)}
    for label, r in results.items():
        print(f"{label:26s} acc {r['acc']:.4f}  NLL {r['nll']:.4f}  ECE {r['ece']:.4f}")
    reliability_diagram(results, path, f"digits, {len(X_te)} test images")
    print(f"reliability diagram saved to {path}")


if __name__ == "__main__":
    main()
