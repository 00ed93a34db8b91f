"""The demo's PNG summary: timings per extension and deviations per layer.

Two panels, written by :func:`save_summary` (matplotlib with the ``Agg``
backend, imported only here, so the demo runs without it):

* left: each extension's median time per call relative to a plain
  ``loss.backward()`` (log scale), the dashed line at 1;
* right: ``log10 max |value − reference|`` per quantity (rows) and parameter
  (columns); grey cells are unchecked (Monte-Carlo estimates, Kronecker
  approximations), red-bordered ones exceed the tolerance.
"""

from __future__ import annotations

import math
import os
from typing import Dict, List, Optional, Sequence

__all__ = ["save_summary", "summary_figure"]


def save_summary(
    path: str,
    ratios: Dict[str, float],
    deviations: Dict[str, Dict[str, Optional[float]]],
    parameters: Sequence[str],
    tolerance: float,
    title: str,
) -> str:
    """Write the two-panel summary to ``path`` (folders created); return the path.

    Args:
        ratios: method label -> median time / ``loss.backward``'s.
        deviations: quantity label -> parameter name -> ``max |dev|``
            (``None``: unchecked).
        parameters: the column order.
        tolerance: cells above it are outlined.
        title: the figure's title (problem and verdict).

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib.pyplot as plt  # optional dependency

    fig = summary_figure(ratios, deviations, parameters, tolerance, title)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary_figure(ratios, deviations, parameters: Sequence[str], tolerance: float, title: str):
    """The two-panel figure of :func:`save_summary` (not saved)."""
    import matplotlib  # optional dependency

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency

    rows = list(deviations)
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(13, max(4.0, 0.32 * len(rows) + 1.5)), gridspec_kw={"width_ratios": [1, 1.3]}
    )
    _timing_panel(left, ratios)
    image = _deviation_panel(right, deviations, rows, parameters, tolerance)
    bar = fig.colorbar(image, ax=right, label="log10 max |curvlib − brute force|  (red line: tolerance)")
    # the tolerance on the colour scale: cells above the line are outlined in red
    bar.ax.axhline(math.log10(tolerance), color="red", linewidth=2)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _timing_panel(ax, ratios: Dict[str, float]) -> None:
    labels = list(ratios)
    ax.barh(range(len(labels)), [ratios[k] for k in labels], color="tab:blue")
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    # plain labels at 1-2-5 steps (matplotlib's own minor labels, "3×10⁰ 4×10⁰", collide)
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator  # optional dependency

    top = max(max(ratios.values(), default=1.0), 1.0) * 1.5
    low = min(min(ratios.values(), default=1.0), 1.0) / 1.5
    ticks = [m * 10.0**e for e in range(math.floor(math.log10(low)), math.ceil(math.log10(top)) + 1)
             for m in (1, 2, 5) if low <= m * 10.0**e <= top]
    ax.set_xlim(low, top)
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.axvline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_xlabel("time per call / loss.backward() (median)")
    ax.set_title("cost of each extension alone")


def _deviation_panel(ax, deviations, rows: List[str], parameters: Sequence[str], tolerance: float):
    import numpy as np  # with matplotlib only

    grid = np.full((len(rows), len(parameters)), np.nan)
    for i, q in enumerate(rows):
        for j, p in enumerate(parameters):
            dev = deviations[q].get(p)
            if dev is not None:
                grid[i, j] = math.log10(max(dev, 1e-20))
    cmap = matplotlib_cmap()
    image = ax.imshow(grid, aspect="auto", cmap=cmap, vmin=-20, vmax=0)
    for i, q in enumerate(rows):
        for j, p in enumerate(parameters):
            dev = deviations[q].get(p)
            if dev is not None and not dev <= tolerance:
                ax.add_patch(_outline(i, j))
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.set_xticks(range(len(parameters)), parameters, rotation=30, ha="right", fontsize=8)
    ax.set_title(f"deviation from brute force (grey: unchecked; tolerance {tolerance:g})")
    return image


def matplotlib_cmap():
    """``viridis`` with NaN (unchecked) drawn grey."""
    import matplotlib  # optional dependency

    cmap = matplotlib.colormaps["viridis"].copy()
    cmap.set_bad("lightgrey")
    return cmap


def _outline(i: int, j: int):
    from matplotlib.patches import Rectangle  # optional dependency

    return Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2)
