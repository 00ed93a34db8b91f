"""The zoo's models (tests/oracles/zoo.py) bare and behind a one-line wrapper give the same results.

A user writes ``class W(nn.Module): forward(self, ids): return self.hf(input_ids=ids).logits``
around a library model; curvlib must then take the same front end decisions' results as for
the model passed directly (dict ``X``, ``output=``), whatever torch.fx makes of the wrapper:
BatchGrad, DiagGGNExact and KFLR agree to 1e-10 of the largest entry (the bare results are
checked against float64 brute force by tests/_transform/test_zoo.py). Two cases run by
default, the rest are ``slow``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from curvlib import curvature
from curvlib.extensions import KFLR, BatchGrad, DiagGGNExact
from oracles import zoo

FAST = {"distilbert", "timm_vit_tiny"}
KEYS = {"grad_batch": BatchGrad, "diag_ggn_exact": DiagGGNExact, "kflr": KFLR}


def _run(prob, ext):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return curvature(prob.model, prob.lossfn, [ext()], output=prob.output)(prob.X, prob.y)


def _flat(value) -> torch.Tensor:
    return torch.cat([v.reshape(-1) for v in value]) if isinstance(value, (list, tuple)) else value.reshape(-1)


def _cases():
    for name in zoo.NAMES:
        yield pytest.param(name, marks=[] if name in FAST else [pytest.mark.slow], id=name)


@pytest.mark.parametrize("name", list(_cases()))
def test_wrapped_as_bare(name):
    prob = zoo.build(name)
    inner = zoo.wrapped(prob)
    for key, ext in KEYS.items():
        bare, behind = _run(prob, ext)[key], _run(inner, ext)[key]
        assert set(behind) == {f"hf.{k}" for k in bare}, (key, sorted(behind)[:3])
        scale = max(float(_flat(v).abs().max()) for v in bare.values())
        err = max(float((_flat(behind[f"hf.{k}"]) - _flat(v)).abs().max()) for k, v in bare.items())
        assert err <= 1e-10 * scale, f"{name} {key}: wrapped differs from bare by {err:.2e} (scale {scale:.2e})"
