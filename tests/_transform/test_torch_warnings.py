"""A call emits none of torch's own warnings (here: the one-time forward-mode set-up,
which scripts jvp decompositions and warns that ``torch.jit.script`` is deprecated).
Run in a fresh process: the set-up happens once per process."""

import subprocess
import sys

from oracles.on_device import CLEAN_ENVIRON

SCRIPT = r"""
import os
import warnings
import torch
if os.environ.get("CURVLIB_TEST_DEVICE"):  # the test device, as conftest sets it
    torch.set_default_device(os.environ["CURVLIB_TEST_DEVICE"])
from torch import nn
from curvlib import curvature
from curvlib.extensions import DiagHessian, HMP
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
X, y = torch.randn(5, 3, dtype=torch.double), torch.randint(0, 2, (5,))
f = curvature(model, nn.CrossEntropyLoss(), [DiagHessian(), HMP()])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    qs = f(X, y)
    for name, p in model.named_parameters():
        qs["hmp"][name](torch.ones(2, *p.shape, dtype=p.dtype))
print("\n".join(f"{w.category.__name__}: {w.message}" for w in caught))
"""


def test_no_torch_warnings_in_a_forward_mode_call():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=CLEAN_ENVIRON)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", out.stdout
