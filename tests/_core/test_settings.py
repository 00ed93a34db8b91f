"""The tunable sizes and switches in one frozen record (``curvlib._core.settings``)."""

import dataclasses
import inspect
import threading

import pytest
import torch
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib._core import settings
from curvlib._core.settings import Settings, current, override
from curvlib.extensions import KFRA, DiagHessian
from curvlib.rules import conv


def test_defaults_and_frozen():
    """Outside any override the defaults are in force; the record cannot be changed in place."""
    assert current() == Settings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        current().conv_method = "bmm"


def test_override_nests_and_restores():
    """``override`` replaces only the named fields, nests, and restores the previous record on
    exit, also when the block raises; an unknown field is refused."""
    before = current()
    with override(conv_method="bmm", stream_min_bytes=0) as inner:
        assert inner is current() and inner.conv_method == "bmm" and inner.stream_min_bytes == 0
        assert inner.dense_factor_bytes == before.dense_factor_bytes
        with override(conv_method="conv"):
            assert current().conv_method == "conv" and current().stream_min_bytes == 0
        assert current() is inner
        with pytest.raises(RuntimeError), override(loop_sqrt_columns=False):
            assert not current().loop_sqrt_columns
            raise RuntimeError("inside")
        assert current() is inner
    assert current() is before
    with pytest.raises(TypeError):
        with override(no_such_knob=1):
            pass
    assert current() is before


def test_read_at_call_time_by_every_thread():
    """The record is process-wide: another thread (as autograd's device threads running backward
    hooks) sees the override in force."""
    seen = []
    with override(conv_method="bmm"):
        t = threading.Thread(target=lambda: seen.append(conv.choose_method(16, 32, 9, 64)))
        t.start()
        t.join()
    seen.append(conv.choose_method(16, 32, 9, 64))
    assert seen == ["bmm", "conv"]


def test_every_field_is_documented():
    """Each field carries a ``#:`` comment (what it bounds or switches) right above it."""
    source = inspect.getsource(settings.Settings).splitlines()
    for field in dataclasses.fields(Settings):
        at = next(i for i, line in enumerate(source) if line.strip().startswith(f"{field.name}:"))
        assert source[at - 1].strip().startswith("#:"), field.name


class _Cumprod(nn.Module):
    """A dense per-sample residual ``[N, 4, 4]`` (``cumprod``) between two Linear layers."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.cumprod(self.a(x), 1))


@pytest.mark.parametrize("ext,knob,refusal", [
    (KFRA, "kfra_max_entries", "KFRA: the dense batch-averaged recursion"),
    (DiagHessian, "max_dense_residual_entries", "a dense 4x4 matrix per sample"),
])
def test_size_limits_read_at_call_time(ext, knob, refusal):
    """The refusals' limits are the settings in force when a call is planned: the call runs by
    default and is refused, naming the limit, under a limit below its size."""
    torch.manual_seed(0)
    model = _Cumprod().double()
    X, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    curvature(model, nn.CrossEntropyLoss(), [ext()])(X, y)
    with override(**{knob: 3}), pytest.raises(CurvatureError, match=refusal):
        curvature(model, nn.CrossEntropyLoss(), [ext()])(X, y)
