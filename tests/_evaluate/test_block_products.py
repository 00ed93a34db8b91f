"""Block products (``GGNMP``, ``HMP``, ``PCHMP``) applied to directions ``V [K, *p.shape]``:
``MSELoss()``'s mean, an embedding's padding row, PCHMP on a product of two branches (the
eigenvalue-modified residual, against an explicit block), and the shapes they refuse.
The products on drawn models are checked with every other exact quantity
(``tests/_evaluate/test_second_order_exact.py``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib.extensions import (
    GGNMP, HMP, PCHMP,
)

from oracles.cases import MeanEmbedding, Product
from oracles.checks import check_close
from oracles.second_order import detached_params, ggn_block, ggn_per_sample, hessian_block, residual_block



@pytest.mark.parametrize("ext_cls", [GGNMP, HMP, PCHMP])
def test_embedding_padding_row_products(ext_cls):
    """With ``padding_idx`` autograd holds that row constant (zero gradient), so the
    GGN/Hessian blocks have zero rows *and* columns there (what the diagonals and
    the square root use); a product must not let a direction's padding-row
    component leak into the other rows."""
    torch.manual_seed(0)
    model = MeanEmbedding(3, 2, 2, padding_idx=0).double()
    X = torch.tensor([[0, 1], [1, 1], [2, 0]])
    y = torch.randn(3, 2, dtype=torch.float64)
    lossfn = nn.MSELoss(reduction="sum")
    ext = ext_cls()
    prod = curvature(model, lossfn, [ext])(X, y)[ext.name]["emb.weight"]
    G = ggn_per_sample(model, lossfn, X, y, "emb.weight").sum(0)
    H = hessian_block(model, lossfn, X, y, "emb.weight")
    want = {"ggnmp": G, "hmp": H, "pchmp": G + residual_block(model, lossfn, X, y, "emb.weight", "clip")}[ext.name]
    V = torch.eye(6, dtype=torch.float64).reshape(6, 3, 2)
    check_close(prod(V).reshape(6, 6), want, f"{ext.name}[emb.weight] with padding_idx")


def test_bad_pchmp_modify():
    with pytest.raises(CurvatureError, match="modify"):
        PCHMP(modify="bad")
    assert PCHMP().modify == "clip"


@pytest.mark.parametrize("ext_cls", [GGNMP, HMP, PCHMP])
def test_products_refuse_wrong_shapes(ext_cls):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Sigmoid(), nn.Linear(2, 2)).double()
    X = torch.randn(3, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (3,))
    ext = ext_cls()
    prod = curvature(model, nn.CrossEntropyLoss(), [ext])(X, y)[ext.name]["0.weight"]
    for bad in (
        torch.randn(2, 3, dtype=torch.float64),  # p.shape without the V dim
        torch.randn(1, 3, 2, dtype=torch.float64),  # transposed
        torch.randn(1, 1, 2, 3, dtype=torch.float64),  # one dim too many
        [[0.0] * 3] * 2,  # not a tensor
    ):
        with pytest.raises(CurvatureError, match=r"0\.weight"):
            prod(bad)


@pytest.mark.parametrize("ext_cls", [GGNMP, HMP, PCHMP])
def test_products_with_no_vectors(ext_cls):
    """``V = 0`` directions: an empty ``[0, *p.shape]`` result."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Sigmoid(), nn.Linear(2, 2)).double()
    X = torch.randn(3, 3, dtype=torch.float64)
    ext = ext_cls()
    prod = curvature(model, nn.CrossEntropyLoss(), [ext])(X, torch.randint(0, 2, (3,)))[ext.name]["0.weight"]
    assert prod(torch.zeros(0, 2, 3, dtype=torch.float64)).shape == (0, 2, 3)


@pytest.mark.parametrize("depth", [1, 2])
def test_hmp_mse_mean(depth):
    """HMP with the default ``MSELoss()`` (reduction="mean")."""
    torch.manual_seed(0)
    layers = [nn.Linear(3, 3), nn.Tanh()] * (depth - 1) + [nn.Linear(3, 2)]
    model = nn.Sequential(*layers).double()
    X = torch.randn(4, 3, dtype=torch.float64)
    y = torch.randn(4, 2, dtype=torch.float64)
    lossfn = nn.MSELoss()
    qs = curvature(model, lossfn, [HMP()])(X, y)
    for name, p in model.named_parameters():
        V = torch.randn((2,) + tuple(p.shape), dtype=torch.float64)
        H = hessian_block(model, lossfn, X, y, name)
        check_close(qs["hmp"][name](V), (V.reshape(2, -1) @ H).reshape(V.shape), f"hmp[{name}]")


def _pch_reference_product(model, lossfn, X, y, name, modify):
    """``G_p + Σ_n J_nᵀ mod(R_n) J_n`` for ``Product`` (``z = a(x) ⊙ b(x)``), built
    explicitly: ``R_n = [[0, diag g_n], [diag g_n, 0]]`` over ``(a(x_n), b(x_n))``,
    ``mod`` on its eigenvalues, ``J_n`` the Jacobian of ``(a(x_n), b(x_n))`` w.r.t. ``p``."""
    params = detached_params(model)
    p0 = params[name]

    def branches(p):
        full = {**params, name: p}
        xa = torch.func.functional_call(model.a, {k[2:]: v for k, v in full.items() if k.startswith("a.")}, (X,))
        xb = torch.func.functional_call(model.b, {k[2:]: v for k, v in full.items() if k.startswith("b.")}, (X,))
        return torch.cat([xa, xb], dim=1)  # [N, 2D]

    u = branches(p0)
    d = u.shape[1] // 2
    z = (u[:, :d] * u[:, d:]).detach().requires_grad_(True)
    (g,) = torch.autograd.grad(lossfn(model.c(z), y), z)
    J = torch.func.jacrev(branches)(p0).reshape(X.shape[0], 2 * d, -1)  # [N, 2D, P]
    total = ggn_block(model, lossfn, X, y, name)
    for n in range(X.shape[0]):
        R = torch.zeros(2 * d, 2 * d, dtype=X.dtype)
        R[:d, d:] = torch.diag(g[n])
        R[d:, :d] = torch.diag(g[n])
        lam, Q = torch.linalg.eigh(R)
        lam = lam.clamp(min=0) if modify == "clip" else lam.abs()
        total = total + J[n].T @ (Q @ torch.diag(lam) @ Q.T) @ J[n]
    return total.reshape(p0.numel(), p0.numel())


@pytest.mark.parametrize("modify", ["clip", "abs"])
def test_pchmp_on_products(modify):
    """PCHMP on a product of two branches: the eigenvalue-modified residual (Chen et al.'s
    definition extended from element-wise activations), against an explicit block."""
    torch.manual_seed(0)
    model = Product().double()
    X = torch.randn(4, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (4,))
    lossfn = nn.CrossEntropyLoss()
    qs = curvature(model, lossfn, [PCHMP(modify=modify)])(X, y)
    for name, p in model.named_parameters():
        if not name.startswith(("a.", "b.")):
            continue
        ref = _pch_reference_product(model, lossfn, X, y, name, modify)
        V = torch.randn((3,) + tuple(p.shape), dtype=torch.float64)
        check_close(qs["pchmp"][name](V), (V.reshape(3, -1) @ ref).reshape(V.shape), f"pchmp[{name}] ({modify})")
