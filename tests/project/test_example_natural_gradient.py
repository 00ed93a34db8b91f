"""``examples/natural_gradient.py --quick`` runs, saves its figure, and KFAC beats SGD;
the code block of docs/preconditioning.md ("Preconditioning and natural gradient") runs as written."""

import math
import os
import re
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "examples"))


@pytest.fixture(autouse=True)
def _on_cpu():
    """A CPU script (its own CPU generators), whatever ``CURVLIB_TEST_DEVICE`` says."""
    with torch.device("cpu"):
        yield


def test_quick_run_writes_the_figure_and_kfac_beats_sgd(tmp_path):
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    import natural_gradient

    threads = torch.get_num_threads()
    try:
        logs = natural_gradient.main(["--quick", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert (tmp_path / "natural_gradient.png").stat().st_size > 10_000
    final = {name: log["final_loss"] for name, log in logs.items()}
    assert all(math.isfinite(v) for v in final.values()), final
    # seeded data, weights and batches: at 60 steps KFAC ≈ 0.02, EKFAC ≈ 0.02, SGD ≈ 0.6
    assert final["KFAC"] < 0.2 * final["SGD"] and final["EKFAC"] < 0.2 * final["SGD"], final
    assert len(logs["KFAC"]["loss"]) == 60 and len(logs["KFAC"]["time"]) == 60


def test_docs_block_runs():
    text = open(os.path.join(ROOT, "docs", "preconditioning.md"), encoding="utf-8").read()
    (block,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    namespace = {}
    exec(compile(block, "docs/preconditioning.md", "exec"), namespace)
    assert namespace["losses"][-1] < namespace["losses"][0]
