"""Bad calls of ``f``: a clear ``CurvatureError`` before any work, instead of torch's.

Each refusal is asserted with its message (what is wrong, where, what to do);
inputs curvlib accepts by converting (``int32`` class indices) and models it
unwraps (``torch.compile``) are compared with the plain call; frozen parameters
are absent from every result, and the others equal the oracle.
"""

from __future__ import annotations

import logging
import pickle
import re
import traceback

import pytest
import torch
from torch import nn

from curvlib import CurvatureError, CurvatureTypeError, curvature
from curvlib.extensions import (
    GGNMP, KFAC, KFLR, KFRA, BatchGrad, DiagGGNExact, DiagGGNMC, DiagHessian, SqrtGGNExact, SqrtGGNMC,
)

from oracles.reference import assert_matches, assert_same, exact_extensions, kflr_map, reference
from oracles.on_device import DEVICE, seeded

DT = torch.float64


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)


def _data(n=5, seed=1):
    g = seeded(seed)
    return torch.randn(n, 3, generator=g, dtype=DT), torch.randint(0, 2, (n,), generator=g)


class Counting(nn.Module):
    """A generic-rule layer that counts its runs on real (not fake) tensors."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d, dtype=DT))
        self.real_runs = 0

    def forward(self, x):
        if not isinstance(x, torch._subclasses.FakeTensor):
            self.real_runs += 1
        return x * self.scale


EXTS = [BatchGrad(), DiagGGNExact(), DiagHessian(), KFLR()]


def test_empty_batch():
    X, y = _data()
    with pytest.raises(CurvatureError, match=r"X has batch size 0 \(shape \[0, 3\].*at least one sample"):
        curvature(_mlp(), nn.CrossEntropyLoss(), EXTS)(X[:0], y[:0])
    with pytest.raises(CurvatureError, match=r"batch size 0"):
        curvature(_mlp(), nn.CrossEntropyLoss(), EXTS, batch_chunk_size=2)(X[:0], y[:0])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_cross_entropy_class_indices_of_any_integer_dtype(dtype):
    model, (X, y) = _mlp(), _data()
    f = curvature(model, nn.CrossEntropyLoss(), exact_extensions(kflr=True))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert_same(f(X, y.to(dtype)), f(X, y), f"y {dtype}", shapes)


def test_params_dtype_and_device_checked_against_the_model():
    model, (X, y) = _mlp(), _data()
    f = curvature(model, nn.CrossEntropyLoss(), EXTS)
    w = model[0].weight.detach()
    on = re.escape(str(w.device))  # the test device (CURVLIB_TEST_DEVICE)
    with pytest.raises(CurvatureError, match=rf"params\['0\.weight'\] has dtype torch\.float32 on {on}, but the model's "
                                             rf"parameter has dtype torch\.float64 on {on}.*value\.to\(torch\.float64\)"):
        f(X, y, params={"0.weight": w.float()})
    with pytest.raises(CurvatureError, match=r"params\['0\.weight'\] has dtype torch\.float64 on meta"):
        f(X, y, params={"0.weight": w.to("meta")})


def test_x_dtype_and_device_against_the_parameters():
    model, (X, y) = _mlp(), _data()
    f = curvature(model, nn.CrossEntropyLoss(), EXTS)
    with pytest.raises(CurvatureError, match=r"fails on X \(shape \[5, 3\], dtype torch\.float32\) at graph node '_0' "
                                             r"\(module '0': Linear.*\n.*X has dtype torch\.float32 but the model's "
                                             r"parameters have dtype torch\.float64.*X\.to\(torch\.float64\)"):
        f(X.float(), y)
    on = re.escape(str(model[0].weight.device))
    with pytest.raises(CurvatureError, match=rf"X is on meta but parameter '0\.weight' is on {on}: move X"):
        f(X.to("meta"), y)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_x_on_another_device_than_the_model():
    model, (X, y) = _mlp().cpu(), tuple(t.cpu() for t in _data())  # deliberately on CPU, whatever the test device
    with pytest.raises(CurvatureError, match=r"X is on cuda:0 but parameter '0\.weight' is on cpu"):
        curvature(model, nn.CrossEntropyLoss(), EXTS)(X.cuda(), y.cuda())
    with pytest.raises(CurvatureError, match=r"params\['0\.weight'\] has dtype torch\.float64 on cuda:0"):
        curvature(model, nn.CrossEntropyLoss(), EXTS)(X, y, params={"0.weight": model[0].weight.detach().cuda()})


@pytest.mark.parametrize("dtype", [torch.complex128, torch.int64, torch.bool])
def test_non_float_x_where_the_first_layer_needs_floats(dtype):
    model, (X, y) = _mlp(), _data()
    with pytest.raises(CurvatureError, match=rf"dtype {dtype}, but graph node '_0' \(module '0': Linear.*needs "
                                             r"floating-point input of the parameters' dtype torch\.float64.*Embedding"):
        curvature(model, nn.CrossEntropyLoss(), EXTS)(X.to(dtype), y)


@pytest.mark.parametrize("exts", [[BatchGrad()], [DiagHessian()], [SqrtGGNExact(), KFLR()]], ids=lambda e: e[0].name)
def test_wrong_feature_dimension_is_named_without_log_noise(exts, caplog):
    model, (_, y) = _mlp(), _data()
    with caplog.at_level(logging.ERROR):
        with pytest.raises(CurvatureError, match=r"fails on X \(shape \[5, 7\].*graph node '_0' \(module '0': "
                                                 r"Linear\(in_features=3.*\(5x7 and 3x4\)"):
            curvature(model, nn.CrossEntropyLoss(), exts)(torch.randn(5, 7, dtype=DT), y)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


def test_unbatched_x_is_named():
    """A single sample without its batch dim (a Linear runs on it; a Conv2d's rule names it)."""
    model, (X, y) = _mlp(), _data()
    with pytest.raises(CurvatureError, match=r"X \(shape \[3\].*fails on a batch with one more sample.*X looks like "
                                             r"a single sample without a batch dimension.*X\.unsqueeze\(0\)"):
        curvature(model, nn.CrossEntropyLoss(), EXTS)(X[0], y[:3])
    conv = nn.Sequential(nn.Conv2d(2, 3, 2), nn.Flatten(), nn.Tanh(), nn.Linear(12, 2)).to(DT)
    with pytest.raises(CurvatureError, match=r"Layer '0' \(Conv2d\) got an input of shape \[2, 3, 3\].*unbatched "
                                             r"inputs are not supported: the batch must be in dim 0"):
        curvature(conv, nn.CrossEntropyLoss(), [BatchGrad()])(torch.randn(2, 3, 3, dtype=DT), y[:2])


@pytest.mark.parametrize("ext", [DiagGGNMC, SqrtGGNMC, KFAC])
def test_monte_carlo_columns_that_cannot_fit_are_refused_before_any_work(ext):
    torch.manual_seed(0)
    layer = Counting(4)
    model = nn.Sequential(nn.Linear(3, 4), layer, nn.Tanh(), nn.Linear(4, 2)).to(DT)
    X, y = _data()
    exts = [ext(mc_samples=10**12)] if ext is not KFAC else [BatchGrad(), ext(mc_samples=10**12)]
    if ext is KFAC:
        layer.scale.requires_grad_(False)  # (no Kronecker factors for a generic layer)
    with pytest.raises(CurvatureError, match=rf"{ext.__name__}: its Monte-Carlo columns \[1000000000000, 5, 2\] would "
                                             rf"take 7\.45e\+04 GiB \(torch\.float64\), more than the .* GiB free on {DEVICE.type}(:\d+)?\. "
                                             r"Use fewer mc_samples \(at most \d+ fit\)"):
        curvature(model, nn.CrossEntropyLoss(), exts)(X, y)
    assert layer.real_runs == 0
    curvature(model, nn.CrossEntropyLoss(), [ext(mc_samples=3)])(X, y)
    assert layer.real_runs > 0  # (the counter counts)


def test_torch_compiled_model():
    """Keys ``_orig_mod.<name>``, values the plain model's; ``params=`` by the compiled
    names; other names refused with the compiled names."""
    model, (X, y) = _mlp(), _data()
    compiled = torch.compile(model)
    exts = exact_extensions(kflr=True, kfra=True)
    qc = curvature(compiled, nn.CrossEntropyLoss(), exts)(X, y)
    qp = curvature(model, nn.CrossEntropyLoss(), exts)(X, y)
    renamed = {k: (v if k == "loss" else {f"_orig_mod.{n}": t for n, t in v.items()}) for k, v in qp.items()}
    assert_same(qc, renamed, "compiled vs plain", {f"_orig_mod.{n}": tuple(p.shape) for n, p in model.named_parameters()})
    assert [n for n, _ in compiled.named_parameters()] == list(qc["grad"])
    other = {n: p.detach() for n, p in _mlp(seed=3).named_parameters()}
    f = curvature(compiled, nn.CrossEntropyLoss(), exts)
    got = f(X, y, params={"_orig_mod.2.weight": other["2.weight"], "_orig_mod.0.bias": other["0.bias"]})
    want = curvature(model, nn.CrossEntropyLoss(), exts)(X, y, params={"2.weight": other["2.weight"],
                                                                      "0.bias": other["0.bias"]})
    assert list(got["kflr"]) == ["_orig_mod.0.bias", "_orig_mod.2.weight"]
    for key in ("grad", "diag_h", "kflr", "grad_batch"):
        for n in want[key]:
            a, b = got[key][f"_orig_mod.{n}"], want[key][n]
            assert all(torch.equal(s, t) for s, t in zip(a, b)) if isinstance(a, list) else torch.equal(a, b)
    for bad in ("2.weight", "_orig_mod.9.weight", "_orig_mod."):
        with pytest.raises(CurvatureError, match=rf"params has an entry '{bad}', which is not a parameter of the "
                                                 r"model; the model is torch\.compile'd.*\['_orig_mod\.0\.weight'"):
            f(X, y, params={bad: other["2.weight"]})


def test_frozen_parameter_is_absent_from_every_result():
    model, (X, y) = _mlp(), _data()
    model[0].bias.requires_grad_(False)
    model[2].weight.requires_grad_(False)
    exts = exact_extensions(kflr=True, kfra=True) + [DiagGGNMC(), KFAC(), SqrtGGNMC()]
    qs = curvature(model, nn.CrossEntropyLoss(), exts)(X, y)
    for key, value in qs.items():
        if key != "loss":
            assert list(value) == ["0.weight", "2.bias"], f"{key}: {list(value)}"
    assert_matches(qs, reference(model, nn.CrossEntropyLoss(), X, y, kflr=kflr_map(model), kfra=True), "frozen")
    assert model[0].bias.grad is None and not model[0].bias.requires_grad


def test_all_parameters_frozen():
    model, (X, y) = _mlp(), _data()
    model.requires_grad_(False)
    qs = curvature(model, nn.CrossEntropyLoss(), [BatchGrad(), DiagGGNExact(), GGNMP(), KFRA()])(X, y)
    assert all(qs[k] == {} for k in ("grad", "grad_batch", "diag_ggn_exact", "ggnmp", "kfra"))
    torch.testing.assert_close(qs["loss"], nn.CrossEntropyLoss()(model(X), y))


def test_errors_are_shown_by_their_public_names():
    """A traceback names ``curvlib.CurvatureError`` (how users import it), not the private module
    defining it; pickling finds the class there."""
    with pytest.raises(CurvatureTypeError) as info:
        curvature(nn.Linear(3, 2), "mse", [BatchGrad()])
    assert traceback.format_exception_only(info.value)[0].startswith("curvlib.CurvatureTypeError: ")
    assert type(pickle.loads(pickle.dumps(info.value))) is CurvatureTypeError
