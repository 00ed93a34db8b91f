"""The demo ``python -m curvlib`` passes its own checks and names every extension."""

import os
import subprocess
import sys

import torch

from curvlib import _demo


def test_demo_passes_and_prints_every_extension(capsys):
    assert _demo.main() == 0
    out = capsys.readouterr().out
    classes = _demo.exported_extensions()
    assert classes, "curvlib.extensions exports no extension"
    for cls in classes:
        assert cls.__name__ in out
        assert _demo.instantiate(cls).name in out
    assert "all checks passed" in out
    assert "loss.backward" in out


def test_demo_restores_thread_count(capsys):
    before = torch.get_num_threads()
    _demo.main()
    assert torch.get_num_threads() == before


def test_demo_fails_on_a_wrong_result(monkeypatch, capsys):
    """A deviation above the tolerance makes the demo exit non-zero and name it."""
    good = _demo.REFERENCES["batch_l2"]
    monkeypatch.setitem(
        _demo.REFERENCES, "batch_l2", lambda ref: {k: v + 1e-6 for k, v in good(ref).items()}
    )
    assert _demo.main() == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "batch_l2" in out


def test_module_entry_point_exits_zero():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "curvlib"], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for cls in _demo.exported_extensions():
        assert cls.__name__ in proc.stdout
