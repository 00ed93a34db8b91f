"""curvlib's laplace-torch backends on CNNs: ``kron`` equals laplace-torch's curvlinops
backends (``CurvlinopsGGN``, ``CurvlinopsEF``: curvlinops' KFAC with Grosse & Martens'
KFC convention for convolutions, ``kfac_approx="expand"`` by default, or ``"reduce"``)
factor by factor, float64, for small Conv2d nets over shapes and options."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

pytest.importorskip("laplace")
pytest.importorskip("curvlinops")
from laplace.curvature import CurvlinopsEF, CurvlinopsGGN  # noqa: E402

from curvlib.laplace import CurvlibEF, CurvlibGGN  # noqa: E402

DT = torch.float64
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


def _cnn(c_in, c_mid, k, stride, padding, bias, size):
    conv = nn.Conv2d(c_in, c_mid, k, stride=stride, padding=padding, bias=bias)
    with torch.no_grad():
        flat = conv(torch.zeros(1, c_in, size, size)).numel()
    return nn.Sequential(conv, nn.ReLU(), nn.Conv2d(c_mid, 2, 1), nn.Flatten(), nn.Linear(2 * flat // c_mid, 3)).to(DT)


@settings(max_examples=10)
@given(
    c_in=st.integers(1, 2), c_mid=st.integers(1, 3), k=st.integers(1, 3), stride=st.integers(1, 2),
    padding=st.integers(0, 1), bias=st.booleans(), size=st.integers(3, 5), n=st.integers(1, 4),
    likelihood=st.sampled_from(["classification", "regression"]),
    approx=st.sampled_from([None, "expand", "reduce"]), seed=st.integers(0, 2**16),
)
def test_kron_matches_curvlinops_backends_on_cnns(c_in, c_mid, k, stride, padding, bias, size, n, likelihood,
                                                  approx, seed):
    torch.manual_seed(seed)
    model = _cnn(c_in, c_mid, k, stride, padding, bias, size)
    X = torch.randn(n, c_in, size, size, dtype=DT)
    y = torch.randint(0, 3, (n,)) if likelihood == "classification" else torch.randn(n, 3, dtype=DT)
    kwargs = {} if approx is None else {"kfac_approx": approx}
    for ours_cls, ref_cls in ((CurvlibGGN, CurvlinopsGGN), (CurvlibEF, CurvlinopsEF)):
        # N = n: laplace's curvlinops backend leaves a weight's merged 1x1 factor [B·A]
        # (no bias) unrescaled by M/N; curvlib rescales it (tests/laplace/test_laplace.py: M != N)
        loss, kron = ours_cls(model, likelihood).kron(X, y, N=n, **kwargs)
        ref_loss, ref_kron = ref_cls(model, likelihood).kron(X, y, N=n, **kwargs)
        torch.testing.assert_close(loss, ref_loss)
        assert [len(F) for F in kron.kfacs] == [len(F) for F in ref_kron.kfacs]
        for i, (F, G) in enumerate(zip(kron.kfacs, ref_kron.kfacs)):
            for a, b in zip(F, G):
                scale = float(b.abs().max()) + 1e-300
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11 * scale,
                                           msg=lambda m: f"{ours_cls.__name__} factor {i}: {m}")


def test_merged_one_by_one_factor_is_rescaled():
    """A bias-free weight with 1x1 factors is one factor ``[B·A·M/N]`` (laplace's layout)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 1, 1, bias=False), nn.Flatten(), nn.Linear(4, 3)).to(DT)
    X, y = torch.randn(2, 1, 2, 2, dtype=DT), torch.randint(0, 3, (2,))
    _, whole = CurvlibGGN(model, "classification").kron(X, y, N=2)
    _, part = CurvlibGGN(model, "classification").kron(X, y, N=8)
    assert len(whole.kfacs[0]) == 1
    torch.testing.assert_close(part.kfacs[0][0], whole.kfacs[0][0] / 4)
