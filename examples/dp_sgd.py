"""Differentially private SGD (DP-SGD) with curvlib's per-sample gradient norms.

What it shows. DP-SGD (Abadi et al., 2016) bounds every sample's influence on
a step: it clips each individual gradient ``g_n = ∇_θ ℓ_n`` to norm at most
``C`` and adds Gaussian noise to their sum,

    c_n    = min(1, C / (‖g_n‖ + 1e-6))           (Opacus's clip factor, same stabiliser)
    g̃      = (Σ_n c_n g_n + σ C ξ) / B,   ξ ~ N(0, I),

with ``B`` the expected batch size of Poisson sampling (each training sample
joins a batch with probability ``q = B / N_train``) and ``σ`` the noise
multiplier. ``‖g_n‖² = Σ_p batch_l2[p][n]`` sums ``BatchL2Grad`` over the
parameters. The clipped sum is computed two ways:

* ``clipped_sum_materialized``: ``BatchGrad`` + ``BatchL2Grad`` in one call,
  then ``Σ_n c_n g_n`` from the ``[N, *p.shape]`` individual gradients;
* ``clipped_sum_ghost`` (in the spirit of ghost clipping, Goodfellow 2015 / Li
  et al. 2022): only ``BatchL2Grad`` (curvlib computes a linear layer's norms
  without forming ``[N, *p.shape]``), then ``Σ_n c_n g_n = ∇_θ Σ_n c_n ℓ_n``
  with ``c`` held fixed: one more backward of a reweighted loss, exact.

Both agree with each other to float64 round-off, and, when Opacus is
installed, with Opacus's ``GradSampleModule`` + ``DPOptimizer`` clipping on
the same batch (printed: the relative difference, expected below 1e-10).
Training uses the ghost variant; the privacy spent, ε at ``δ = 1e-5``, comes
from Opacus's RDP accountant (``opacus.accountants.RDPAccountant``) when it is
installed, otherwise the noise multiplier is stated instead.

Run (needs scikit-learn and matplotlib; digits ship with scikit-learn)::

    python examples/dp_sgd.py                 # ~40 s on 2 CPU cores
    python examples/dp_sgd.py --quick         # under a minute
    python examples/dp_sgd.py --out figures/  # where the PNG goes (default figures/)

The figure ``dp_sgd.png`` shows test accuracy against ε (one curve per noise
multiplier, a point per epoch) next to the non-private baseline; without the
accountant, accuracy against epochs, labelled by noise multiplier.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from curvlib import curvature
from curvlib.extensions import BatchGrad, BatchL2Grad

DELTA = 1e-5
STABILISER = 1e-6  # Opacus: c_n = C / (‖g_n‖ + 1e-6), clamped at 1


def require(module: str, what: str):
    """Import an optional dependency or exit with a message saying how to get it."""
    try:
        return __import__(module)
    except ImportError:
        sys.exit(f"{what} needs `{module}`: pip install scikit-learn matplotlib  (or pip install -e '.[examples]')")


def load_digits(seed: int = 0, dtype=torch.float32) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """scikit-learn's 1797 8x8 digits, pixels scaled to [0, 1]: ``X [N, 64]``, ``y [N]``; 60/40 split."""
    require("sklearn", "the digits data")
    from sklearn.datasets import load_digits as _load
    from sklearn.model_selection import train_test_split

    d = _load()
    X = torch.tensor(d.data, dtype=dtype) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, test_size=0.4, random_state=seed, stratify=y)
    return X_tr, y_tr, X_te, y_te


def make_model(kind: str = "mlp") -> nn.Module:
    """A small MLP on ``[N, 64]``, or a small CNN that reshapes to ``[N, 1, 8, 8]``."""
    if kind == "mlp":
        return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
    return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 4, 3), nn.Tanh(),
                         nn.Flatten(), nn.Linear(4 * 6 * 6, 10))


def clip_factors(batch_l2: Dict[str, Tensor], max_norm: float) -> Tensor:
    """``c [N]``: ``min(1, C / (‖g_n‖ + 1e-6))``, ``‖g_n‖² = Σ_p batch_l2[p][n]``."""
    norms = torch.stack(list(batch_l2.values())).sum(0).sqrt()
    return (max_norm / (norms + STABILISER)).clamp(max=1.0)


def clipped_sum_materialized(model: nn.Module, lossfn: nn.Module, X: Tensor, y: Tensor,
                             max_norm: float) -> Dict[str, Tensor]:
    """``{name: Σ_n c_n g_n}`` (``p.shape``) from the individual gradients ``[N, *p.shape]``.

    ``lossfn`` must sum over samples (``reduction="sum"``), so that ``g_n = ∇ℓ_n``.
    """
    qs = curvature(model, lossfn, [BatchGrad(), BatchL2Grad()])(X, y)
    c = clip_factors(qs["batch_l2"], max_norm)
    return {k: torch.einsum("n,n...->...", c, g) for k, g in qs["grad_batch"].items()}


def clipped_sum_ghost(model: nn.Module, lossfn: nn.Module, X: Tensor, y: Tensor,
                      max_norm: float) -> Dict[str, Tensor]:
    """``{name: Σ_n c_n g_n}`` as the gradient of ``Σ_n c_n ℓ_n`` (``c`` fixed): norms only, one backward more."""
    qs = curvature(model, lossfn, [BatchL2Grad()])(X, y)
    c = clip_factors(qs["batch_l2"], max_norm).detach()
    per_sample = copy.copy(lossfn)
    per_sample.reduction = "none"  # ℓ_n, to be reweighted
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    losses = per_sample(model(X), y)
    grads = torch.autograd.grad((c * losses.reshape(len(c), -1).sum(1)).sum(), list(params.values()))
    return dict(zip(params, grads))


def opacus_clipped_sum(model: nn.Module, X: Tensor, y: Tensor, max_norm: float) -> Optional[Dict[str, Tensor]]:
    """Opacus's clipped sum on the same batch (``GradSampleModule`` + ``DPOptimizer``, no noise), or None."""
    try:
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer
    except ImportError:
        return None
    clone = copy.deepcopy(model)
    gsm = GradSampleModule(clone, loss_reduction="sum")  # its default "mean" scales grad_sample by N
    opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.0), noise_multiplier=0.0,
                      max_grad_norm=max_norm, expected_batch_size=len(X), loss_reduction="sum")
    X = X.detach().requires_grad_(True)  # else Opacus's full backward hooks warn
    nn.CrossEntropyLoss(reduction="sum")(gsm(X), y).backward()
    opt.clip_and_accumulate()
    return {k: p.summed_grad.detach() for k, p in clone.named_parameters()}


def rel_diff(a: Dict[str, Tensor], b: Dict[str, Tensor]) -> float:
    """max |a − b| / max |b| over every parameter."""
    return max(float((a[k] - b[k]).abs().max()) for k in b) / max(float(v.abs().max()) for v in b.values())


def check_on_one_batch(X: Tensor, y: Tensor, max_norm: float) -> None:
    """Print the agreement of the two variants (and Opacus's) in float64 on one batch."""
    torch.manual_seed(0)
    model = make_model().double()
    lossfn = nn.CrossEntropyLoss(reduction="sum")
    X, y = X[:64].double(), y[:64]
    mat = clipped_sum_materialized(model, lossfn, X, y, max_norm)
    ghost = clipped_sum_ghost(model, lossfn, X, y, max_norm)
    print(f"clipped sum, ghost vs materialized (float64): rel. difference {rel_diff(ghost, mat):.1e}")
    theirs = opacus_clipped_sum(model, X, y, max_norm)
    if theirs is None:
        print("Opacus not installed: no comparison with its clipping")
    else:
        print(f"clipped sum, curvlib vs Opacus (float64): rel. difference {rel_diff(mat, theirs):.1e} (required < 1e-10)")
        assert rel_diff(mat, theirs) < 1e-10, "curvlib's clipped sum differs from Opacus's"


def accuracy(model: nn.Module, X: Tensor, y: Tensor) -> float:
    with torch.no_grad():
        return float((model(X).argmax(1) == y).float().mean())


def dp_train(data, sigma: float, epochs: int, args, seed: int = 0):
    """Train with DP-SGD (ghost clipping, Poisson sampling); return ``[(epoch, ε or None, test acc)]``."""
    X_tr, y_tr, X_te, y_te = data
    torch.manual_seed(seed)
    model, lossfn = make_model(), nn.CrossEntropyLoss(reduction="sum")
    q = args.batch / len(X_tr)
    accountant = _accountant()
    gen = torch.Generator().manual_seed(seed)
    history = []
    for epoch in range(1, epochs + 1):
        for _ in range(len(X_tr) // args.batch):
            take = torch.rand(len(X_tr), generator=gen) < q  # Poisson sampling: the RDP analysis assumes it
            grads = (clipped_sum_ghost(model, lossfn, X_tr[take], y_tr[take], args.clip) if take.any()
                     else {k: torch.zeros_like(p) for k, p in model.named_parameters()})
            with torch.no_grad():
                for k, p in model.named_parameters():
                    noise = torch.randn(p.shape, generator=gen) * sigma * args.clip
                    p -= args.lr * (grads[k] + noise) / args.batch
            if accountant is not None and sigma > 0:
                accountant.step(noise_multiplier=sigma, sample_rate=q)
        eps = accountant.get_epsilon(DELTA) if accountant is not None and sigma > 0 else None
        history.append((epoch, eps, accuracy(model, X_te, y_te)))
    return history


def _accountant():
    try:
        from opacus.accountants import RDPAccountant
    except ImportError:
        return None
    return RDPAccountant()


def plot(results: Dict[float, list], path: str, have_accountant: bool) -> None:
    require("matplotlib", "the figure")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for sigma, hist in results.items():
        acc = [h[2] for h in hist]
        if sigma == 0:
            ax.axhline(acc[-1], color="k", ls="--", lw=1, label="clipped SGD, no noise (σ = 0)")
        elif have_accountant:
            ax.plot([h[1] for h in hist], acc, "o-", label=f"σ = {sigma:g}")
        else:
            ax.plot([h[0] for h in hist], acc, "o-", label=f"σ = {sigma:g}")
    ax.set_xlabel(f"ε (RDP accountant, δ = {DELTA:g})" if have_accountant else "epoch (no accountant installed)")
    ax.set_ylabel("test accuracy")
    ax.set_title("DP-SGD on digits (curvlib BatchL2Grad + ghost clipping)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (under a minute on 2 cores)")
    parser.add_argument("--out", default="figures", help="folder for the PNG (created if missing)")
    parser.add_argument("--clip", type=float, default=1.0, help="clipping norm C")
    parser.add_argument("--batch", type=int, default=64, help="expected batch size B (Poisson sampling)")
    parser.add_argument("--lr", type=float, default=2.0)
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--sigmas", type=float, nargs="+", default=None, help="noise multipliers σ")
    args = parser.parse_args(argv)
    epochs = args.epochs or (3 if args.quick else 20)
    sigmas = args.sigmas or ([1.0, 2.0] if args.quick else [0.7, 1.0, 2.0, 4.0])
    require("matplotlib", "the figure")
    os.makedirs(args.out, exist_ok=True)

    data = load_digits()
    check_on_one_batch(data[0], data[1], args.clip)
    have_accountant = _accountant() is not None
    if not have_accountant:
        print("Opacus (its RDP accountant) not installed: ε is not computed; the figure is labelled by σ")
    results = {}
    for sigma in [0.0] + sigmas:
        t0 = time.perf_counter()
        results[sigma] = dp_train(data, sigma, epochs, args)
        epoch, eps, acc = results[sigma][-1]
        privacy = f"ε = {eps:.2f} at δ = {DELTA:g}" if eps is not None else (
            "not private" if sigma == 0 else f"noise multiplier σ = {sigma:g}")
        print(f"σ = {sigma:4.1f}: {epoch} epochs, test accuracy {acc:.3f}, {privacy} "
              f"({time.perf_counter() - t0:.1f}s)")
    path = os.path.join(args.out, "dp_sgd.png")
    plot(results, path, have_accountant)
    print(f"figure saved to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
