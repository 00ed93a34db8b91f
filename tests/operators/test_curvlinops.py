"""The whole-network operators beside curvlinops 3.x's, where both define the same matrix.

Same: the GGN, the Hessian and the Jacobian, over a loader, for ``"mean"`` and ``"sum"``.
Different by convention: the empirical Fisher with ``"mean"``. curvlinops scales ``Σ_n ∇ℓ_n
∇ℓ_nᵀ`` by ``c = 1/M`` once; curvlib's is ``Σ_n g_n g_nᵀ`` of the individual gradients ``g_n =
c∇ℓ_n`` (BackPACK's ``SumGradSquared`` is its diagonal), so ``c²``. The ratio is exactly ``M``.
"""

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib.operators import GGN, EmpiricalFisher, Hessian, Jacobian

from oracles.on_device import seeded

curvlinops = pytest.importorskip("curvlinops")

D = torch.float64


@settings(max_examples=8)
@given(st.integers(0, 1000), st.sampled_from(["mean", "sum"]), st.sampled_from(["ce", "mse"]), st.integers(2, 7))
def test_same_matrices_as_curvlinops(seed, reduction, kind, n):
    torch.manual_seed(seed)
    g = seeded(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).to(D)
    X = torch.randn(n, 3, generator=g, dtype=D)
    y = torch.randint(0, 3, (n,), generator=g) if kind == "ce" else torch.randn(n, 3, generator=g, dtype=D)
    lossfn = (nn.CrossEntropyLoss if kind == "ce" else nn.MSELoss)(reduction=reduction)
    data = [(X[:1], y[:1]), (X[1:], y[1:])]
    params = list(model.parameters())
    pairs = [(curvlinops.GGNLinearOperator, GGN), (curvlinops.HessianLinearOperator, Hessian),
             (curvlinops.EFLinearOperator, EmpiricalFisher)]
    for theirs, ours in pairs:
        A = theirs(model, lossfn, params, data, progressbar=False)
        expected = A @ torch.eye(A.shape[1], dtype=D)
        if ours is EmpiricalFisher and reduction == "mean":
            expected = expected / (n if kind == "ce" else y.numel())  # c² against c (module doc)
        got = ours(model, lossfn, data).to_dense()
        assert float((got - expected).abs().max()) <= 1e-10 * float(expected.abs().max()) + 1e-13, ours.__name__
    J = curvlinops.JacobianLinearOperator(model, params, data)
    assert torch.allclose(Jacobian(model, lossfn, data).to_dense(), J @ torch.eye(J.shape[1], dtype=D), rtol=0, atol=1e-13)
