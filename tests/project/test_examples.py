"""``examples/architectures.py`` runs, checks what it claims, and fails on a wrong result."""

import os
import subprocess
import sys

import pytest

from oracles.on_device import CLEAN_ENVIRON
import torch

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")
sys.path.insert(0, EXAMPLES)
import architectures  # noqa: E402


@pytest.fixture(autouse=True)
def _on_cpu():
    """The example is a CPU script (its own CPU generators): it stays on CPU whatever
    ``CURVLIB_TEST_DEVICE`` says (a no-op without the switch)."""
    with torch.device("cpu"):
        yield


def _lstm_problem():
    return next(p for p in architectures.problems() if p[0] == "LSTMClassifier")


def test_lstm_table_names_every_extension(capsys):
    """Every extension curvlib exports gets a row: ok, ran (approximations) or refused; none fails."""
    from curvlib._demo.main import exported_extensions

    assert {type(e) for e, _ in architectures.EXTENSIONS} == set(exported_extensions())
    assert architectures.check_problem(*_lstm_problem()) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert len(rows) == len(architectures.EXTENSIONS)
    assert all(r[2] in ("ok", "ran", "refused:") for r in rows), rows
    assert sum(r[2] == "ok" for r in rows) >= 12  # first order, exact diagonals, sqrt, products


def test_a_wrong_result_fails():
    """The comparison can fail: a reference off by 1% is reported as FAILED."""
    title, model, lossfn, X, y = _lstm_problem()
    ref = architectures.BruteForce(model, lossfn, X, y)
    wrong = architectures.exact(lambda r: {k: 1.01 * g for k, g in r.per_param(r.g).items()})
    cell, failed = architectures.run_extension(architectures.E.BatchGrad(), wrong, model, lossfn, X, y, ref)
    assert failed and cell.startswith("FAILED"), cell
    cell, failed = architectures.run_extension(
        architectures.E.HMP(), architectures.product(lambda r: r.G), model, lossfn, X, y, ref)
    assert failed, cell  # the LSTM's Hessian is not its GGN


def test_brute_force_is_consistent():
    """The reference's own pieces agree: per-sample gradients, GGNs and Hessians sum to the whole."""
    title, model, lossfn, X, y = _lstm_problem()
    ref = architectures.BruteForce(model, lossfn, X, y)
    grad = torch.autograd.grad(lossfn(model(X), y), list(model.parameters()))
    torch.testing.assert_close(ref.g.sum(0), torch.cat([g.flatten() for g in grad]))
    torch.testing.assert_close(ref.H_n.sum(0), ref.H)


@pytest.mark.slow
def test_script_exits_zero():
    env = dict(CLEAN_ENVIRON, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, "architectures.py")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "GPT (tied head)" in proc.stdout and "LSTMClassifier" in proc.stdout
    assert "every checked quantity agrees" in proc.stdout
