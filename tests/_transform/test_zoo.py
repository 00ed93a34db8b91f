"""The model zoo: curvlib on real-library models against a float64 brute force.

Every (model, extension group) of tests/oracles/zoo.py x tests/oracles/zoo_checks.GROUPS:

* ``first_order``: loss, grad, BatchGrad, BatchL2Grad, SumGradSquared, Variance against
  per-sample autograd gradients;
* ``ggn``: DiagGGNExact, BatchDiagGGNExact against per-sample ``Jᵀ H J``;
* ``hessian``: DiagHessian, BatchDiagHessian against per-sample double backward;
* ``kflr``: KFLR(kfac_approx="expand"): every Linear / Conv2d / GPT-2 Conv1D weight gets
  two matrix factors; ``B ⊗ A`` against the oracle for the plain, untied, groups=1 ones;
* ``products``: GGNMP and HMP of one weight against its dense GGN / Hessian block;
* ``mc_ggn``: DiagGGNMC, BatchDiagGGNMC averaged over 4 x 256 draws -> the exact diagonal
  (within 15% of the largest entry: the MC error of 1024 draws is a few %);
* ``mc_kfac``: KFAC(kfac_approx="expand") averaged likewise -> KFLR's ``B ⊗ A``.

Tolerance: ``max|a - b| <= rtol * max|b|`` over the whole result; rtol 1e-8, except 1e-6
for Llama/Qwen2/T5 (their RMSNorm / T5LayerNorm, and eager Llama attention's softmax, compute
in float32 inside a float64 model; 1e-5 for their Hessian diagonals, which amplify that
rounding: the all-float64 twin "llama_f64norm" agrees to 1e-14). Three fast
cases run by default; the rest are ``slow`` (``python -m pytest -m slow tests/_transform/test_zoo.py``).
Cases that fail today are strict xfails whose reason is the failure
(/work/briefs/zoo_report.md lists them).
"""

from __future__ import annotations

import pytest
import torch

from oracles import zoo
from oracles import zoo_checks

FAST = {("gpt2_eager", "first_order"), ("bert", "ggn"), ("tv_resnet18", "kflr"), ("llama_cls_left", "first_order")}

# (model, group) -> what goes wrong today (strict: a fix makes the case XPASS -> remove it here)
KNOWN: dict = {}

# (model, group) -> why it is skipped (none today: NFNet's Hessian diagonals and Monte-Carlo GGN
# diagonals, once over 90 s, take about 30 s and 5 s since the dense residuals are split per block)
TOO_SLOW: dict = {}


def _cases():
    for name in zoo.NAMES:
        for group in zoo_checks.GROUPS:
            marks = [] if (name, group) in FAST else [pytest.mark.slow]
            if (name, group) in TOO_SLOW:
                marks.append(pytest.mark.skip(reason=TOO_SLOW[(name, group)]))
            if (name, group) in KNOWN:
                marks.append(pytest.mark.xfail(strict=True, reason=KNOWN[(name, group)]))
            yield pytest.param(name, group, marks=marks, id=f"{name}-{group}")


@pytest.mark.parametrize("name, group", list(_cases()))
def test_zoo(name, group):
    errors = zoo_checks.check(name, group)
    assert errors


def test_zoo_models_are_small():
    """Every zoo model stays small (<= 20k parameters) and runs eagerly in float64."""
    for name in zoo.NAMES:
        prob = zoo.build(name)
        assert zoo.n_params(prob.model) <= 20_000, name
        assert all(p.dtype == torch.float64 for p in prob.model.parameters()), name
        assert not prob.model.training, name
