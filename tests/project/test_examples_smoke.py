"""Every example runs with ``--quick`` in a subprocess and writes its PNG into ``--out`` (CI smoke test).

Examples are discovered: every ``examples/*.py`` whose source has a ``--quick`` flag, so a new
example is picked up without touching this file. Each runs as ``python examples/X.py --quick
--out <tmp>/out`` from an empty working directory (which must stay empty: figures go to
``--out`` only), with ``PYTHONPATH=src`` prepended and ``OMP_NUM_THREADS=1``. They run one at a
time: the DDP example starts two processes of its own, and the budget is ~2 min on 2 cores.
"""

import glob
import os
import subprocess
import sys

import pytest

from oracles.on_device import CLEAN_ENVIRON

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
EXAMPLES = sorted(p for p in glob.glob(os.path.join(ROOT, "examples", "*.py"))
                  if "--quick" in open(p, encoding="utf-8").read())
# What an example needs beyond curvlib and torch; every example draws a figure with matplotlib.
NEEDS = {"laplace_digits.py": ["laplace", "sklearn"], "architectures.py": [], "ddp_curvature.py": [],
         "influence.py": []}
DEFAULT_NEEDS = ["sklearn"]  # the digits examples


def test_every_example_is_discovered():
    names = {os.path.basename(p) for p in EXAMPLES}
    assert {"dp_sgd.py", "noise_monitor.py", "pruning.py", "laplace_digits.py", "ddp_curvature.py",
            "architectures.py", "hessian_spectrum.py"} <= names, names


@pytest.mark.parametrize("script", EXAMPLES, ids=os.path.basename)
def test_example_runs_quick_and_writes_png(script, tmp_path):
    pytest.importorskip("matplotlib")
    for module in NEEDS.get(os.path.basename(script), DEFAULT_NEEDS):
        pytest.importorskip(module)
    cwd, out = tmp_path / "cwd", tmp_path / "out"
    cwd.mkdir()
    env = dict(CLEAN_ENVIRON, OMP_NUM_THREADS="1", MPLBACKEND="Agg",
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src")] + ([os.environ["PYTHONPATH"]]
                                                                         if os.environ.get("PYTHONPATH") else [])))
    # (through tests/torchvision_shim.py: laplace-torch imports torchvision, whose registry wheel is a
    # CUDA build that does not import on the CPU torch without it)
    runner = ("import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); import torchvision_shim; "
              "torchvision_shim.install(); sys.argv.pop(0); runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", runner, os.path.join(ROOT, "tests"), script, "--quick", "--out", str(out)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list(out.glob("*.png")), f"no PNG in --out; output:\n{proc.stdout[-2000:]}"
    assert not list(cwd.iterdir()), f"wrote into the working directory: {list(cwd.iterdir())}"
