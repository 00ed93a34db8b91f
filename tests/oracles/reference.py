"""Every exact quantity of a small model from the brute-force oracles, in curvlib's layout.

:func:`reference` builds, from :mod:`oracles.first_order` and :mod:`oracles.second_order` (no
curvlib), the loss, gradient, first-order quantities, GGN and Hessian
diagonals (whole batch and per sample), the per-sample GGN blocks (what the
square root must reproduce), the GGN / Hessian / positive-curvature Hessian
blocks (what the products must reproduce on the identity) and optionally the
KFLR / KFRA factors. :func:`assert_matches` compares curvlib's result with it,
every tensor with a tolerance scaled by the largest entry of the whole result.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import Tensor, nn

from curvlib.extensions import (
    GGNMP, HMP, KFLR, KFRA, PCHMP, BatchDiagGGNExact, BatchDiagHessian, BatchGrad, BatchL2Grad, DiagGGNExact,
    DiagHessian, SqrtGGNExact, SumGradSquared, Variance,
)

from oracles.first_order import first_order_reference
from oracles.second_order import (
    ggn_per_sample, hessian_block, hessian_per_sample, kfra_reference, kron_reference, residual_block, trainable_names,
)
from oracles.on_device import seeded

PRODUCTS = ("ggnmp", "hmp", "pchmp")


def exact_extensions(hessian: bool = True, kflr: bool = False, kfra: bool = False) -> list:
    """Every exact extension (the Hessian family only with ``hessian``)."""
    exts = [BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance(), DiagGGNExact(), BatchDiagGGNExact(),
            SqrtGGNExact(), GGNMP(), HMP()]
    if hessian:
        exts += [DiagHessian(), BatchDiagHessian(), PCHMP()]
    if kflr:
        exts.append(KFLR())
    if kfra:
        exts.append(KFRA())
    return exts


def reference(model: nn.Module, lossfn, X: Tensor, y: Tensor, *, hessian: bool = True,
              kflr: Optional[Dict[str, tuple]] = None, kfra: bool = False, modify: str = "clip",
              pchmp: Optional[bool] = None) -> dict:
    """The oracle's value of every quantity :func:`exact_extensions` asks for.

    ``hessian``: also the Hessian diagonals, and (``pchmp``, default ``hessian``) the
    positive-curvature block (the model's nonlinearities must then be smooth
    activation *modules* or piecewise linear: checked by ``G + R = H``).
    ``kflr``: ``{param: (module, role)}``.
    ``kfra``: the model is an ``nn.Sequential`` of Linear layers and activations.
    """
    names = trainable_names(model)
    with torch.no_grad():
        loss = lossfn(model(X), y)
    ref: dict = {"loss": loss, **first_order_reference(model, lossfn, X, y)}
    keys = ["diag_ggn_exact", "diag_ggn_exact_batch", "sqrt_ggn_exact", "ggnmp", "hmp"]
    pchmp = hessian if pchmp is None else pchmp
    keys += ["diag_h", "diag_h_batch"] if hessian else []
    keys += ["pchmp"] if pchmp else []
    ref.update({k: {} for k in keys})
    n = X.shape[0]
    for name in names:
        p = dict(model.named_parameters())[name]
        Gn = ggn_per_sample(model, lossfn, X, y, name)
        G, H = Gn.sum(0), hessian_block(model, lossfn, X, y, name)
        ref["diag_ggn_exact"][name] = G.diagonal().reshape(p.shape)
        ref["diag_ggn_exact_batch"][name] = Gn.diagonal(dim1=1, dim2=2).reshape((n,) + tuple(p.shape))
        ref["sqrt_ggn_exact"][name] = Gn  # compared through Σ_v S_v S_vᵀ per sample
        ref["ggnmp"][name], ref["hmp"][name] = G, H
        if hessian:
            Hn = hessian_per_sample(model, lossfn, X, y, name)
            # (float32 models: two summation orders agree to float32's rounding, not to 1e-7)
            assert_close(Hn.sum(0), H, f"oracle self-check: per-sample Hessians sum to the Hessian [{name}]",
                         rtol=max(1e-7, 100 * torch.finfo(H.dtype).eps))
            ref["diag_h"][name] = H.diagonal().reshape(p.shape)
            ref["diag_h_batch"][name] = Hn.diagonal(dim1=1, dim2=2).reshape((n,) + tuple(p.shape))
        if pchmp:
            R = residual_block(model, lossfn, X, y, name)
            assert_close(G + R, H, f"oracle self-check: G + residual = Hessian [{name}]")
            ref["pchmp"][name] = G + residual_block(model, lossfn, X, y, name, modify)
    if kflr is not None:
        ref["kflr"] = {name: kron_reference(model, lossfn, X, y, *kflr[name]) for name in names}
    if kfra:
        kf = kfra_reference(model, lossfn, X, y)
        ref["kfra"] = {name: kf[name] for name in names}
    return ref


def kflr_map(model: nn.Module) -> Dict[str, tuple]:
    """``{param: (module, role)}`` for every trainable parameter (for :func:`reference`)."""
    return {f"{m}.{r}" if m else r: (m, r) for m, mod in model.named_modules()
            for r, p in mod.named_parameters(recurse=False) if p.requires_grad}


def assert_close(actual: Tensor, expected: Tensor, what: str, rtol: float = 1e-7, atol: float = 1e-10) -> None:
    """Same shape; ``max |a − e| ≤ atol + rtol · max |e|`` (the scale of the whole result)."""
    assert isinstance(actual, Tensor), f"{what}: got {type(actual).__name__}"
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = expected.abs().max().item() if expected.numel() else 0.0
    err = (actual - expected).abs().max().item() if expected.numel() else 0.0
    assert err <= atol + rtol * scale, f"{what}: max error {err:.3g} at scale {scale:.3g}"


def product_matrix(product, shape, dtype=torch.float64) -> Tensor:
    """``[P, P]``: a block product applied to the identity (row ``i``: the product of ``e_i``)."""
    P = int(torch.Size(shape).numel())
    return product(torch.eye(P, dtype=dtype).reshape((P,) + tuple(shape))).reshape(P, P)


def assert_matches(qs: dict, ref: dict, what: str = "", rtol: float = 1e-7) -> None:
    """Every quantity of ``ref`` that ``qs`` holds equals it (products on the identity)."""
    compared = 0
    for key, want in ref.items():
        if key not in qs:
            continue
        compared += 1
        got = qs[key]
        if key == "loss":
            assert_close(got, want, f"{what} loss", rtol)
            continue
        assert list(got) == list(want), f"{what} {key}: keys {list(got)} != {list(want)}"
        for name, w in want.items():
            label = f"{what} {key}[{name}]"
            if key in PRODUCTS:
                assert_close(product_matrix(got[name], ref["grad"][name].shape, ref["grad"][name].dtype), w, label, rtol)
            elif key == "sqrt_ggn_exact":
                S = got[name].reshape(got[name].shape[0], got[name].shape[1], -1)
                assert_close(torch.einsum("vnp,vnq->npq", S, S), w, label, rtol)
            elif isinstance(w, list):
                assert len(got[name]) == len(w), f"{label}: {len(got[name])} factors, expected {len(w)}"
                for i, (a, b) in enumerate(zip(got[name], w)):
                    assert_close(a, b, f"{label}[{i}]", rtol)
            else:
                assert_close(got[name], w, label, rtol)
    assert compared > 1, f"{what}: nothing compared"


def assert_same(a, b, what: str = "", products_shape: Optional[Dict[str, tuple]] = None, rtol: float = 0.0) -> None:
    """Two results of curvlib are identical (bit for bit; ``rtol > 0``: to that tolerance at
    the scale of each result); products compared on a fixed ``V``."""

    def same(u, v, label):
        if rtol:
            assert_close(u, v, label, rtol)
        else:
            assert torch.equal(u, v), f"{label} differs"

    assert set(a) == set(b), f"{what}: keys {set(a)} != {set(b)}"
    for key in a:
        x, z = a[key], b[key]
        if isinstance(x, Tensor):
            same(x, z, f"{what} {key}")
            continue
        assert list(x) == list(z), f"{what} {key}: keys differ"
        for name in x:
            u, v = x[name], z[name]
            if callable(u):
                shape = products_shape[name]
                V = torch.randn((2,) + tuple(shape), generator=seeded(3), dtype=torch.float64)
                u, v = u(V), v(V)
            if isinstance(u, list):
                assert len(u) == len(v), f"{what} {key}[{name}]: {len(u)} factors, not {len(v)}"
                for i, (s, t) in enumerate(zip(u, v)):
                    same(s, t, f"{what} {key}[{name}][{i}]")
            else:
                same(u, v, f"{what} {key}[{name}]")
