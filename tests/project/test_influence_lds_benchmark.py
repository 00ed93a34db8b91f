"""Smoke test of ``benchmarks/influence_lds.py --quick`` on the digits MLP: it runs, every method
reports a finite LDS and a time, EK-FAC's LDS is positive, and where kronfluence is installed its
identity scores (gradient dot products, nothing fitted) give curvlib's LDS."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("sklearn")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SCRIPT = os.path.join(ROOT, "benchmarks", "influence_lds.py")


def test_quick_run_scores_every_method(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.path.join(ROOT, "tests")]))
    done = subprocess.run([sys.executable, SCRIPT, "--quick", "--problems", "mlp", "--out", str(tmp_path),
                           "--name", "smoke"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "smoke.json").read_text())["results"]["mlp"]["rows"]
    by = {(r["library"], r["strategy"]): r for r in rows}
    assert {s for lib, s in by if lib == "curvlib"} == {"identity", "diagonal", "kfac", "ekfac"}
    for r in rows:
        if "error" in r:
            assert r["library"] == "kronfluence" and r["error"].startswith(("ImportError", "ModuleNotFoundError")), r
            continue
        assert math.isfinite(r["lds"][0]) and -1 <= r["lds"][0] <= 1 and r["seconds"] > 0, r
    assert by["curvlib", "ekfac"]["lds"][0] > 0
    if "error" not in by["kronfluence", "identity"]:
        assert by["kronfluence", "identity"]["lds"][0] == pytest.approx(by["curvlib", "identity"]["lds"][0], abs=1e-9)
    assert (tmp_path / "smoke.md").read_text().startswith("# Influence: linear datamodeling score")
