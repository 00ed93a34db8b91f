"""Example figures keep every title and axis label inside the canvas (issue 24, item 8)."""

import importlib.util
import os

import pytest

pytest.importorskip("matplotlib")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


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
