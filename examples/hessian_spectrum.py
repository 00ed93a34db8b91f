"""The Hessian spectrum along training: top eigenvalues, trace and spectral density from curvlib.operators.

What it shows. An MLP (Tanh) trains on scikit-learn's digits with SGD. At a
few checkpoints the whole network's curvature of the mean training loss
``L(θ) = (1/N) Σ_n ℓ(f(x_n; θ), y_n)`` (cross-entropy, all ``N`` training
samples, through a ``DataLoader`` that the operators iterate in every
product) is measured with ``curvlib.operators``, never forming a matrix:

* the Hessian ``H = ∇²_θ L`` (``Hessian``) and the generalised Gauss-Newton
  ``G = Jᵀ (∇²ℓ) J`` (``GGN``, positive semi-definite: the Hessian without
  the second derivatives of the network), as operators ``v ↦ A v``;
* their ``k`` largest eigenvalues by Lanczos (``eigen.lanczos``), each with
  its residual ``r = ‖A v − λ v‖`` (``v`` of unit norm): for a symmetric
  ``A`` some eigenvalue lies in ``[λ − r, λ + r]``;
* their traces ``tr A = Σ_i λ_i`` by Hutch++ (``estimators.hutchpp_trace``):
  the exact trace of ``A`` on a sketched top subspace plus Hutchinson's
  ``(1/m) Σ_i zᵢᵀ A zᵢ`` (Rademacher ``zᵢ``) on the rest, drawn with a
  ±2 standard-error bar (which should cover the exact value about 95% of
  the time; the error is estimated from a third of the products, so it is
  rough itself). The exact traces, ``Σ diag`` of one
  ``curvature(model, lossfn, [DiagHessian(), DiagGGNExact()])`` call, are
  drawn beside them;
* the Hessian's spectral density by stochastic Lanczos quadrature
  (``eigen.spectral_density``): for Rademacher probes ``z``, ``m`` Lanczos
  steps from ``z/‖z‖`` give nodes ``θ_j`` and weights ``τ_j`` with
  ``zᵀ g(H) z / P ≈ Σ_j τ_j g(θ_j)``, and the density, smoothed by a
  Gaussian of width ``σ``, is ``φ(t) ≈ mean over probes of
  Σ_j τ_j N(t; θ_j, σ²)``.

Checking the numbers. The model is small (P = 610 parameters in the
``--quick`` run, 1810 in the full one), so at the first checkpoint both
matrices are also formed (``A.to_dense()``, float64 throughout):
``torch.linalg.eigvalsh`` gives every eigenvalue, and the example prints the
Lanczos and the dense top eigenvalue side by side and stops unless they
agree to a relative 1e-6 (they agree to ~1e-16), and unless the dense
diagonal is ``curvature``'s exact one; the smoothed density of the dense
eigenvalues, ``(1/P) Σ_i N(t; λ_i, σ²)`` (what SLQ estimates), is drawn
under the SLQ estimate of the first checkpoint.

What one sees. The top eigenvalues and the traces rise while the loss falls
fastest (the loss sharpens), peak, then shrink as the network fits the
training set: cross-entropy's curvature ``diag(p) − p pᵀ`` vanishes as the
predictions ``p`` grow confident. The Hessian differs from the GGN by the
network's second derivatives weighted by the loss gradient ``∂ℓ/∂f``
(after the first steps they raise its trace above the GGN's), and its top
eigenvalues approach the GGN's as that gradient goes to zero. At initialisation the Hessian's spectrum is a broad bulk with
negative eigenvalues that the GGN cannot have; after training almost all of
it sits at zero, with a few outliers above.

Run (needs scikit-learn and matplotlib)::

    python examples/hessian_spectrum.py             # about 1 min on one CPU core
    python examples/hessian_spectrum.py --quick     # about 25 s on one CPU core
    python examples/hessian_spectrum.py --out DIR   # default figures/

The figure ``hessian_spectrum.png`` has three panels: (a) the top
eigenvalues of the Hessian and the GGN against the training step; (b) their
traces against the step, Hutch++ estimates with ±2 standard errors and the
exact values; (c) the Hessian's spectral density (log scale) at the first
and the last checkpoint.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Dict, List

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from curvlib import curvature
from curvlib.extensions import DiagGGNExact, DiagHessian
from curvlib.operators import GGN, Hessian, hutchpp_trace, lanczos, spectral_density

#: form the matrices and check Lanczos against ``eigvalsh`` at the first checkpoint up to this P
DENSE_LIMIT = 3000
#: relative agreement required between the Lanczos and the dense top eigenvalue
DENSE_RTOL = 1e-6


def require(module: str, what: str):
    """Import an optional dependency or exit with a message saying how to get it."""
    try:
        return __import__(module)
    except ImportError:
        sys.exit(f"{what} needs `{module}`: pip install scikit-learn matplotlib  (or pip install -e '.[examples]')")


def load_digits(seed: int = 0):
    """scikit-learn's digits, pixels in [0, 1], float64: ``X [N, 64]``, ``y [N]``, 60/40 train/test split."""
    require("sklearn", "the digits data")
    from sklearn.datasets import load_digits as _load
    from sklearn.model_selection import train_test_split

    d = _load()
    X, y = torch.tensor(d.data, dtype=torch.float64) / 16.0, torch.tensor(d.target)
    return train_test_split(X, y, test_size=0.4, random_state=seed, stratify=y)


def checkpoint_steps(total: int, count: int) -> List[int]:
    """``count`` steps from 0 to ``total``, denser early (where the spectrum changes fastest)."""
    # geometric in (step + 1): 0, ..., total
    steps = {round((total + 1) ** (i / (count - 1))) - 1 for i in range(count)}
    return sorted(steps)


def top_eigenvalues(A, k: int, generator: torch.Generator) -> Dict:
    """The ``k`` largest eigenvalues of ``A`` by Lanczos, descending, their residuals ``‖Av − λv‖`` and
    the products it took."""
    # blocks of k vectors: one product A @ [P, k] per iteration costs far less than k products A @ [P]
    pairs = lanczos(A, k, which="largest", block_size=k, generator=generator)
    if not pairs.converged:
        print(f"  (Lanczos on the {type(A).__name__} stopped before its tolerance: residuals {pairs.residuals.tolist()})")
    return {"values": pairs.values.tolist(), "residuals": pairs.residuals.tolist(), "matvecs": pairs.num_matvecs}


def exact_diagonals(model: nn.Module, X: Tensor, y: Tensor, operators: Dict) -> Dict[str, Tensor]:
    """``diag H`` and ``diag G`` ``[P]`` of the mean loss on ``(X, y)`` from one ``curvature`` call (exact,
    per-layer, independent of the operators), flattened in the operators' parameter order."""
    qs = curvature(model, nn.CrossEntropyLoss(), [DiagHessian(), DiagGGNExact()])(X, y)
    return {"Hessian": operators["Hessian"].domain.flatten(qs["diag_h"]),
            "GGN": operators["GGN"].domain.flatten(qs["diag_ggn_exact"])}


def measure(model: nn.Module, loader: DataLoader, X: Tensor, y: Tensor, args,
            generator: torch.Generator, density: bool) -> Dict:
    """Every quantity of one checkpoint (module docstring): ``{"Hessian": {...}, "GGN": {...}}``
    with ``values``, ``residuals``, ``trace``, ``trace_se``, ``trace_exact``, and for the Hessian
    the SLQ result ``slq`` when ``density``; ``"operators"``: the two operators."""
    lossfn = nn.CrossEntropyLoss()
    operators = {"Hessian": Hessian(model, lossfn, loader), "GGN": GGN(model, lossfn, loader)}
    exact = exact_diagonals(model, X, y, operators)
    result: Dict[str, Dict] = {}
    for name, A in operators.items():
        r = top_eigenvalues(A, args.k, generator)
        estimate = hutchpp_trace(A, args.trace_matvecs, generator=generator)
        r.update(trace=float(estimate.value), trace_se=float(estimate.standard_error),
                 trace_exact=float(exact[name].sum()), diagonal=exact[name])
        result[name] = r
    if density:
        result["Hessian"]["slq"] = spectral_density(operators["Hessian"], args.probes, args.slq_steps,
                                                    generator=generator)
    result["operators"] = operators
    return result


def dense_check(point: Dict) -> Dict[str, Tensor]:
    """Every eigenvalue of both matrices (``to_dense`` + ``eigvalsh``), printed beside Lanczos's top one;
    exits unless they agree to ``DENSE_RTOL`` and the dense diagonal is the exact one."""
    spectra = {}
    for name in ("Hessian", "GGN"):
        dense = point["operators"][name].to_dense()
        if not torch.allclose(dense.diagonal(), point[name]["diagonal"], rtol=1e-9, atol=1e-12):
            raise SystemExit(f"{name}: the operator's diagonal differs from curvature()'s exact diagonal")
        eigenvalues = torch.linalg.eigvalsh(dense)
        top_dense, top_lanczos = float(eigenvalues[-1]), point[name]["values"][0]
        rel = abs(top_lanczos - top_dense) / abs(top_dense)
        print(f"  {name:7s} top eigenvalue: Lanczos {top_lanczos:.12g} (residual {point[name]['residuals'][0]:.1e}), "
              f"dense eigvalsh {top_dense:.12g}, relative difference {rel:.1e}; "
              f"trace: dense {float(dense.trace()):.8g}, exact diagonal's sum {point[name]['trace_exact']:.8g}")
        if not rel <= DENSE_RTOL:
            raise SystemExit(f"{name}: the Lanczos top eigenvalue {top_lanczos!r} differs from eigvalsh's "
                             f"{top_dense!r} by {rel:.1e} relative (> {DENSE_RTOL:g})")
        spectra[name] = eigenvalues
    return spectra


def accuracy(model: nn.Module, X: Tensor, y: Tensor) -> float:
    """Fraction of ``X`` that ``model`` classifies as ``y``."""
    with torch.no_grad():
        return float((model(X).argmax(1) == y).float().mean())


def report(step: int, point: Dict, acc: float, seconds: float) -> None:
    """One line per matrix: its top eigenvalues (max residual) and trace."""
    print(f"step {step:4d}: test accuracy {acc:.3f}  ({seconds:.1f}s)")
    for name in ("Hessian", "GGN"):
        r = point[name]
        print(f"  {name:7s} top {len(r['values'])}: " + " ".join(f"{v:.4g}" for v in r["values"])
              + f"  (residuals <= {max(r['residuals']):.1e}, {r['matvecs']} products);  trace {r['trace']:.4g} ± {2 * r['trace_se']:.2g} "
              f"(Hutch++, ±2 s.e.), exact {r['trace_exact']:.4g}")


def train(args) -> Dict:
    """SGD on digits, measuring at the checkpoints; return the logged series."""
    X_tr, X_te, y_tr, y_te = load_digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 10)).double()
    P = sum(p.numel() for p in model.parameters())
    # the operators' data: the whole training set in fixed batches, the same in every product
    loader = DataLoader(TensorDataset(X_tr, y_tr), batch_size=args.eval_batch, shuffle=False)
    steps_per_epoch = math.ceil(len(X_tr) / args.batch)
    checkpoints = checkpoint_steps(args.epochs * steps_per_epoch, args.checkpoints)
    print(f"MLP 64-{args.hidden}-10, P = {P} parameters, {len(X_tr)} training samples in {len(loader)} batches; "
          f"checkpoints at steps {checkpoints}")
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    gen, draws = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    log: Dict = {"P": P, "steps": [], "points": [], "dense": None}
    step = 0
    for _ in range(args.epochs + 1):
        for idx in torch.randperm(len(X_tr), generator=gen).split(args.batch):
            if step in checkpoints:
                t0 = time.perf_counter()
                point = measure(model, loader, X_tr, y_tr, args, draws, density=step in (checkpoints[0], checkpoints[-1]))
                report(step, point, accuracy(model, X_te, y_te), time.perf_counter() - t0)
                if step == checkpoints[0] and P <= DENSE_LIMIT:
                    log["dense"] = dense_check(point)
                point.pop("operators")
                log["steps"].append(step)
                log["points"].append(point)
            if step == checkpoints[-1]:
                return log
            opt.zero_grad()
            nn.functional.cross_entropy(model(X_tr[idx]), y_tr[idx]).backward()
            opt.step()
            step += 1
    return log


def smoothed(eigenvalues: Tensor, grid: Tensor, sigma: float) -> Tensor:
    """``(1/P) Σ_i N(t; λ_i, σ²)`` on ``grid``: the density SLQ estimates, from every eigenvalue."""
    z = (grid[:, None] - eigenvalues[None, :]) / sigma
    return torch.exp(-0.5 * z**2).sum(1) / (len(eigenvalues) * sigma * math.sqrt(2 * math.pi))


MATRICES = (("Hessian", "tab:red", "-"), ("GGN", "tab:blue", "--"))  # name, colour, line style


def plot_eigenvalues(ax, log: Dict) -> None:
    """Panel (a): the top eigenvalues of both matrices against the step, λ₁ darkest."""
    for name, color, style in MATRICES:
        values = torch.tensor([p[name]["values"] for p in log["points"]])
        for i in range(values.shape[1]):
            ax.plot(log["steps"], values[:, i], style, color=color, marker="o", ms=3.5, lw=1.2,
                    alpha=1.0 - 0.65 * i / max(values.shape[1] - 1, 1))
    # the residual bounds |λ − λ_true| <= r are far below the markers: their largest goes in the title
    worst = max(max(p[name]["residuals"]) for p in log["points"] for name, _, _ in MATRICES)
    ax.set_ylabel("eigenvalue")
    ax.set_title(f"(a) top {values.shape[1]} eigenvalues, λ₁ darkest\n(Lanczos; every residual ≤ {worst:.0e})")


def plot_traces(ax, log: Dict) -> None:
    """Panel (b): Hutch++ traces with ±2 standard errors, and the exact traces."""
    for (name, color, _), shift in zip(MATRICES, (-0.04, 0.04)):
        est = torch.tensor([p[name]["trace"] for p in log["points"]])
        se = torch.tensor([p[name]["trace_se"] for p in log["points"]])
        steps = torch.tensor(log["steps"], dtype=torch.float64)
        x = (steps + 1) * math.exp(shift) - 1  # the two matrices' bars side by side on the log axis
        ax.errorbar(x, est, yerr=2 * se, fmt="o", color=color, ms=3.5, capsize=3, lw=1.2)
        ax.plot(log["steps"], [p[name]["trace_exact"] for p in log["points"]], ":", color=color, lw=1.4)
    ax.set_ylabel("trace")
    ax.set_title("(b) trace\n(Hutch++ and exact)")


def legend_handles(ax):
    """The legend of panels (a) and (b): colour and line style name the matrix, the glyphs the trace's kind."""
    # empty artists on ``ax`` (it draws no legend of its own): their glyphs are the panels' own
    handles = [ax.plot([], [], ls, color=c, marker="o", ms=3.5, label=name)[0] for name, c, ls in MATRICES]
    handles.append(ax.errorbar([], [], yerr=[], fmt="o", color="0.3", ms=3.5, capsize=3, label="Hutch++ ± 2 s.e."))
    handles += ax.plot([], [], ":", color="0.3", lw=1.4, label="exact trace (Σ diagonal)")
    return handles


def plot_density(ax, log: Dict) -> None:
    """Panel (c): the Hessian's SLQ density at the first and the last checkpoint, and the dense one."""
    first, last = log["points"][0]["Hessian"], log["points"][-1]["Hessian"]
    # SLQ's nodes lie inside the spectrum and reach its ends: they bound the grid
    lo = min(float(first["slq"].nodes.min()), float(last["slq"].nodes.min()))
    hi = max(float(first["slq"].nodes.max()), float(last["slq"].nodes.max()))
    lo, hi = lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo)
    grid = torch.linspace(lo, hi, 1000, dtype=torch.float64)
    sigma = (hi - lo) / 100
    curves = []
    for point, step, color in ((first, log["steps"][0], "tab:purple"), (last, log["steps"][-1], "tab:orange")):
        curves.append(point["slq"].density(grid, sigma))
        ax.plot(grid, curves[-1], color=color, lw=1.4, label=f"step {step} (SLQ)")
    if log["dense"] is not None:
        ax.plot(grid, smoothed(log["dense"]["Hessian"], grid, sigma), "k--", lw=0.9,
                label=f"step {log['steps'][0]}, every eigenvalue\n(eigvalsh, same smoothing)")
    top = float(torch.stack(curves).max())
    ax.set_yscale("log")
    ax.set_ylim(top * 1e-5, top * 2)
    ax.set_xlim(lo, hi)
    ax.set_xlabel("eigenvalue of the Hessian")
    ax.set_ylabel("density")
    ax.set_title(f"(c) Hessian spectral density (SLQ; Gaussian smoothing σ = {sigma:.2g})")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)


def figure(log: Dict):
    """The three panels (module docstring) for a docs column: 8 in wide (800 px at 100 dpi), text >= 9 pt,
    legends outside the data."""
    require("matplotlib", "the figure")
    import matplotlib.pyplot as plt

    style = {"font.size": 10, "axes.titlesize": 10, "axes.labelsize": 10, "xtick.labelsize": 9,
             "ytick.labelsize": 9, "legend.fontsize": 9}
    # the panels' tensors on the CPU, whatever torch's default device: matplotlib reads them as arrays
    with plt.rc_context(style), torch.device("cpu"):
        fig = plt.figure(figsize=(8, 6.6), layout="constrained")
        fig.suptitle(f"Curvature of an MLP on digits along training (P = {log['P']}, curvlib.operators)")
        top, bottom = fig.subfigures(2, 1, height_ratios=[1.1, 1])
        panels = top.subplots(1, 2)
        plot_eigenvalues(panels[0], log)
        plot_traces(panels[1], log)
        for ax in panels:
            # 0, then logarithmic: the checkpoints are spaced geometrically
            ax.set_xscale("symlog", linthresh=1, linscale=0.5)
            ax.set_xlim(-0.3, log["steps"][-1] * 1.4)
            ax.set_xlabel("training step (SGD)")
        top.legend(handles=legend_handles(panels[1]), loc="outside lower center", ncol=4, frameon=False)
        plot_density(bottom.subplots(), log)
    return fig


def plot(log: Dict, path: str) -> None:
    require("matplotlib", "the figure")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = figure(log)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (under a minute on one core)")
    parser.add_argument("--out", default="figures", help="folder for the PNG (created if missing)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs of SGD")
    parser.add_argument("--hidden", type=int, default=None, help="hidden units of the MLP")
    parser.add_argument("--checkpoints", type=int, default=None, help="number of checkpoints")
    parser.add_argument("--k", type=int, default=None, help="top eigenvalues per matrix")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--batch", type=int, default=32, help="SGD batch size")
    parser.add_argument("--eval-batch", type=int, default=540, help="batch size of the operators' loader")
    args = parser.parse_args(argv)
    if args.checkpoints is not None and args.checkpoints < 2:
        parser.error("--checkpoints must be at least 2 (the first and the last)")
    quick = {"epochs": 4, "hidden": 8, "checkpoints": 4, "k": 4, "trace_matvecs": 45, "probes": 4, "slq_steps": 30}
    full = {"epochs": 30, "hidden": 24, "checkpoints": 7, "k": 5, "trace_matvecs": 60, "probes": 8, "slq_steps": 80}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    require("matplotlib", "the figure")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    log = train(args)
    print(f"done in {time.perf_counter() - t0:.1f}s")
    path = os.path.join(args.out, "hessian_spectrum.png")
    plot(log, path)
    print(f"figure saved to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
