"""Smoke test of ``benchmarks/operators.py --quick``: it runs, every product method reports a time
and a peak, every installed peer's product agrees with curvlib's, curvlib's Lanczos reaches the
target accuracy and every trace estimate is finite."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from oracles.on_device import CPU_ONLY, ON_CPU

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SCRIPT = os.path.join(ROOT, "benchmarks", "operators.py")
PEERS = {"curvlinops": "curvlinops", "pyhessian": "pyhessian", "pyhessian[batch]": "pyhessian",
         "eigenthings": "hessian_eigenthings"}


def _installed(method: str) -> bool:
    library = method.split(":")[0]
    return library in ("backward", "curvlib") or importlib.util.find_spec(PEERS[library]) is not None


@pytest.mark.skipif(not ON_CPU, reason=CPU_ONLY + " (the benchmark's processes fork)")
def test_quick_run_reports_every_row(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.path.join(ROOT, "tests")]))
    done = subprocess.run([sys.executable, SCRIPT, "--quick", "--out", str(tmp_path), "--name", "smoke"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "smoke.json").read_text())["rows"]
    products = rows["products"]["mlp"]
    for method in filter(_installed, products["memory"]):
        assert "error" not in products["memory"][method], (method, products["memory"][method])
        assert products["memory"][method]["call_above_mib"] >= 0
        assert products["time"]["ratio"][method] > 0, method
    for method, difference in products["time"]["agree"].items():
        assert difference < 1e-3, (method, difference)  # float32: the same matrix-vector product
    for kind, k in rows["spectral"]["mlp"]["kinds"].items():
        assert k["eigen"]["curvlib:lanczos"]["rel_error"] <= 1e-3, kind
        assert all(math.isfinite(r["rel_error"]) for r in k["trace"].values() if "error" not in r), kind
    assert (tmp_path / "smoke.md").read_text().startswith("# Operators against their peers")
