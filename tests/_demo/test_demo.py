"""The demo ``python -m curvlib`` passes its own checks and names every extension."""

import importlib.util
import subprocess
import sys

import pytest

from oracles.on_device import CLEAN_ENVIRON
import torch

from curvlib._demo import main as _demo
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


def test_module_entry_point_exits_zero(tmp_path):
    """``python -m curvlib`` in a fresh process: every extension, progress on stderr, the PNG
    where ``--out`` says, and no warning from torch (e.g. "Failed to initialize NumPy")."""
    env = dict(CLEAN_ENVIRON, OMP_NUM_THREADS="1")
    out = tmp_path / "sub" / "demo.png"
    proc = subprocess.run(
        [sys.executable, "-m", "curvlib", "--device", "cpu", "--out", str(out), "--rounds", "3"],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for cls in _demo.exported_extensions():
        assert cls.__name__ in proc.stdout
    assert [line[:5] for line in proc.stderr.splitlines()] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"], proc.stderr
    assert "Warning" not in proc.stderr and "NumPy" not in proc.stderr
    if _has_matplotlib():
        assert out.stat().st_size > 10_000
        assert not (tmp_path / "figures").exists()  # only where --out says


def _has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def test_help_explains_the_options_and_columns(capsys):
    with pytest.raises(SystemExit) as exit_:
        _demo.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for word in ("--device", "--extensions", "--out", "--no-plot", "max |dev|", "layout", "unchecked"):
        assert word in text


def test_selected_extensions_and_figure(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "demo.png"
    assert _demo.main(["--extensions", "BatchGrad", "KFAC", "--out", str(out), "--rounds", "2"]) == 0
    text = capsys.readouterr().out
    assert "BatchGrad (grad_batch)" in text and "KFAC (kfac)" in text and "DiagGGNExact" not in text
    assert out.stat().st_size > 10_000


@pytest.mark.parametrize("argv, message", [
    (["--extensions", "Nope"], "unknown extension"),
    (["--device", "nodevice"], "--device 'nodevice' cannot be used"),
    (["--device", "meta"], "meta"),
])
def test_bad_arguments_are_refused_clearly(argv, message):
    with pytest.raises(SystemExit) as exit_:
        _demo.main(argv + ["--no-plot"])
    assert message in str(exit_.value.code)
