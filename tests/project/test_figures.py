"""Example figures keep every title and axis label inside the canvas."""

import importlib.util
import os

import pytest

pytest.importorskip("matplotlib")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("panels", [1, 3])
def test_architectures_figure_text_inside_the_canvas(panels):
    """One panel (``--quick``) used to cut the suptitle and the x label."""
    import matplotlib.pyplot as plt

    arch = _load("architectures")
    rows = [(f"model {k}", ext, cell) for k in range(panels)
            for ext, cell in [("BatchGrad", "ok (max rel. error vs brute force 1.0e-16; 12 ms)"),
                              ("KFAC", "ran (approximation 0.50; 30 ms)"), ("KFRA", "refused: not a chain")]]
    fig = arch.figure(rows)
    fig.canvas.draw()
    canvas = fig.bbox
    texts = [fig._suptitle] + [ax.xaxis.label for ax in fig.axes] + [ax.title for ax in fig.axes]
    for text in texts:
        box = text.get_window_extent()
        assert canvas.x0 - 1 <= box.x0 and box.x1 <= canvas.x1 + 1, f"{text.get_text()!r} cut: {box} vs {canvas}"
        assert canvas.y0 - 1 <= box.y0 and box.y1 <= canvas.y1 + 1, f"{text.get_text()!r} cut: {box} vs {canvas}"
    plt.close(fig)


def test_demo_figure_ticks_apart_and_tolerance_marked():
    """The demo's log-axis tick labels do not overlap (matplotlib's minor labels, "3×10⁰ 4×10⁰",
    would) and its colour bar marks the tolerance."""
    import math

    import matplotlib.pyplot as plt

    from curvlib._demo.plot import summary_figure

    ratios = {"loss.backward": 1.0, "BatchGrad": 2.3, "DiagGGNExact": 4.6, "KFRA": 7.1, "HMP": 2.8}
    deviations = {"grad": {"w": 1e-17}, "DiagGGNExact (diag_ggn_exact)": {"w": 1e-15}, "KFAC (kfac)": {"w": None}}
    fig = summary_figure(ratios, deviations, ["w"], 1e-8, "demo")
    fig.canvas.draw()
    timing = fig.axes[0]
    low, high = timing.get_xlim()
    labels = [t for t in timing.get_xticklabels(minor=False) + timing.get_xticklabels(minor=True)
              if t.get_visible() and t.get_text() and low <= t.get_position()[0] <= high]
    boxes = sorted((t.get_window_extent() for t in labels), key=lambda b: b.x0)
    assert len(boxes) >= 2
    for a, b in zip(boxes, boxes[1:]):
        assert b.x0 - a.x1 >= 5, f"tick labels {a} and {b} closer than 5 px"
    colourbar = fig.axes[-1]
    marks = [line for line in colourbar.get_lines() if math.isclose(line.get_ydata()[0], -8.0)]
    assert marks, "no tolerance line on the colour bar"
    plt.close(fig)
