"""A clone of the repository in a folder named ``curvlib`` passes the test that depends on the name.

``git clone .../curvlib`` creates that folder. The "at file:line" pointer of the refusal of
a parameter used outside its module skips the frames inside the library; were "inside the
library" any path containing ``curvlib``, ``tests/_trace/test_untraced.py::test_direct_parameter_use_refused_with_line``
would fail under such a clone. "Inside the library" is the package's own directory; this
test clones the repository the tests live in (its committed state) into ``<tmp>/curvlib``
and runs that test there, with the clone's ``src`` on ``PYTHONPATH`` (no new environment).
"""

import os
import shutil
import subprocess
import sys

import pytest

from oracles.on_device import CLEAN_ENVIRON

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TEST = "tests/_trace/test_untraced.py::test_direct_parameter_use_refused_with_line"


def _clone(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    if subprocess.run(["git", "rev-parse", "--git-dir"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("the tests do not live in a git checkout")
    clone = tmp_path / "curvlib"
    proc = subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", ROOT, str(clone)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return clone


def test_clone_named_curvlib_keeps_the_line_pointer(tmp_path):
    clone = _clone(tmp_path)
    env = dict(CLEAN_ENVIRON, PYTHONPATH=str(clone / "src"))
    # the clone's curvlib is the one imported, not an installed (editable) one
    where = subprocess.run([sys.executable, "-c", "import curvlib; print(curvlib.__file__)"],
                           cwd=clone, env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(str(clone / "src" / "curvlib")), where.stdout
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TEST],
                          cwd=clone, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout, proc.stdout[-2000:]
