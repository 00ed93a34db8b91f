"""Checks that run curvlib and compare with the oracles (float64).

* :func:`check_first_order`, :func:`check_ggn_columns`: first order and GGN columns against
  the per-sample-copies oracle (:mod:`oracles.first_order`);
* :func:`check_second_order`: every exact second-order quantity of one call (diagonals, batch
  diagonals, square root, products, optionally KFLR) against :mod:`oracles.second_order`;
* :func:`check_hessian_diagonals`, :func:`check_hessian_family`: the Hessian diagonals (and
  PCHMP) on any graph, against ``torch.func`` Hessians and :mod:`oracles.pchmp`;
* :func:`curvlib_blocks`: curvlib's PCHMP blocks ``[P, P]`` (applied to the identity);
* :func:`state_snapshot`, :func:`_assert_same_state`: the model is left untouched.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import Tensor, nn

from curvlib import curvature
from curvlib.extensions import (
    GGNMP, HMP, KFLR, PCHMP, BatchDiagGGNExact, BatchDiagHessian, BatchGrad, BatchL2Grad, DiagGGNExact, DiagHessian,
    SqrtGGNExact, SumGradSquared, Variance,
)

from oracles.first_order import assert_close_dicts, first_order_reference
from oracles.on_device import seeded
from oracles.pchmp import assert_blocks_close, pchmp_blocks
from oracles.second_order import (
    detached_params,
    ggn_block,
    ggn_per_sample,
    hessian_block,
    hessian_per_sample,
    kron_reference,
    loss_root,
    output_jacobian,
    residual_block,
    trainable_names,
)

FIRST_ORDER_EXTENSIONS = (BatchGrad, BatchL2Grad, SumGradSquared, Variance)


def state_snapshot(model: nn.Module):
    """Everything curvlib must leave untouched."""
    return (
        {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()},
        {n: (type(p), p.grad) for n, p in model.named_parameters()},
        [
            (m._forward_hooks.copy(), m._forward_pre_hooks.copy(), m._backward_hooks.copy(), sorted(vars(m)))
            for m in model.modules()
        ],
    )


def check_first_order(model: nn.Module, lossfn: nn.Module, X, y, extensions=FIRST_ORDER_EXTENSIONS):
    """curvlib's loss, gradient and first-order quantities equal the oracle's,
    and the model is left exactly as it was."""
    before = state_snapshot(model)
    qs = curvature(model, lossfn, [e() for e in extensions])(X, y)
    after = state_snapshot(model)
    ref = first_order_reference(model, lossfn, X, y)
    torch.testing.assert_close(qs["loss"], lossfn(model(X), y))
    assert_close_dicts(qs["grad"], ref["grad"], "grad")
    for e in extensions:
        assert_close_dicts(qs[e.name], ref[e.name], e.name)
    _assert_same_state(before, after)
    return qs


def _assert_same_state(before, after):
    sd_b, p_b, mod_b = before
    sd_a, p_a, mod_a = after
    assert sd_b.keys() == sd_a.keys()
    for k in sd_b:
        assert torch.equal(sd_b[k], sd_a[k]), f"state_dict[{k}] changed"
    assert p_b == p_a, "parameters were replaced or got a .grad"
    assert mod_b == mod_a, "hooks or attributes of a module changed"


def check_ggn_columns(model, lossfn, X, y):
    """GGN diagonal, per-sample diagonal and square root against the per-sample GGN oracle."""
    from curvlib import curvature, extensions
    from oracles.second_order import ggn_per_sample, trainable_names

    exts = [extensions.DiagGGNExact(), extensions.BatchDiagGGNExact(), extensions.SqrtGGNExact()]
    qs = curvature(model, lossfn, exts)(X, y)
    n = X.shape[0]
    for name in trainable_names(model):
        p = dict(model.named_parameters())[name]
        Gn = ggn_per_sample(model, lossfn, X, y, name)
        torch.testing.assert_close(qs["diag_ggn_exact"][name], Gn.sum(0).diagonal().reshape(p.shape))
        torch.testing.assert_close(
            qs["diag_ggn_exact_batch"][name], Gn.diagonal(dim1=1, dim2=2).reshape((n,) + tuple(p.shape))
        )
        sq = qs["sqrt_ggn_exact"][name].reshape(-1, n, p.numel())
        torch.testing.assert_close(torch.einsum("vnp,vnq->npq", sq, sq), Gn)


# ----------------------------------------------------------------------------- second order

RTOL, ATOL = 1e-7, 1e-9


def check_close(actual, expected, what):
    """Same shape, and ``torch.testing.assert_close`` with ``RTOL``/``ATOL`` (a message naming ``what``)."""
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def check_second_order(
    model: nn.Module,
    lossfn: nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
    *,
    hessian: bool = True,
    hmp: bool = True,
    modify: str = "clip",
    kflr: Optional[Dict[str, tuple]] = None,
    seed: int = 0,
    constant_rows: Optional[Dict[str, int]] = None,
) -> dict:
    """Compare every exact second-order quantity with the oracle.

    Args:
        hessian: also DiagHessian, BatchDiagHessian and PCHMP (the model's
            nonlinearities must be modules of ``oracles.second_order.SMOOTH_ACTIVATIONS``
            or piecewise linear, so that the residual oracle is complete: this is
            checked, ``G + R = ∇²L``).
        hmp: also HMP.
        kflr: ``{param name: (module name, role)}`` to check KFLR for (then
            every trainable parameter must be in it).
        constant_rows: ``{param name: row}``: the product directions ``V`` get
            a zero in that row (an embedding's ``padding_idx``, which autograd
            holds constant; the full products are tested by
            :func:`test_block_products.test_embedding_padding_row_products`).
    """
    exts = [DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact(), GGNMP()]
    if hmp:
        exts.append(HMP())
    if hessian:
        exts += [DiagHessian(), BatchDiagHessian(), PCHMP(modify=modify)]
    if kflr is not None:
        exts.append(KFLR())
    before = state_snapshot(model)
    qs = curvature(model, lossfn, exts)(X, y)
    torch.testing.assert_close(qs["loss"], lossfn(model(X), y))
    n = X.shape[0]
    with torch.no_grad():
        c = model(X)[0].numel()
    names = trainable_names(model)
    params = detached_params(model)
    gen = seeded(seed)
    for ext in exts:
        assert list(qs[ext.name]) == names, f"{ext.name}: keys {list(qs[ext.name])} != {names}"
    for name in names:
        p = params[name]
        P = p.numel()
        Gn = ggn_per_sample(model, lossfn, X, y, name)
        G = Gn.sum(0)
        check_close(qs["diag_ggn_exact"][name], G.diagonal().reshape(p.shape), f"diag_ggn_exact[{name}]")
        check_close(
            qs["diag_ggn_exact_batch"][name],
            Gn.diagonal(dim1=1, dim2=2).reshape((n,) + tuple(p.shape)),
            f"diag_ggn_exact_batch[{name}]",
        )
        sq = qs["sqrt_ggn_exact"][name]
        assert tuple(sq.shape) == (c, n) + tuple(p.shape), f"sqrt_ggn_exact[{name}] shape {tuple(sq.shape)}"
        sq = sq.reshape(c, n, P)
        check_close(torch.einsum("vnp,vnq->npq", sq, sq), Gn, f"sqrt_ggn_exact[{name}] (per-sample SᵀS)")
        J = output_jacobian(model, X, name)  # [N, C, P]; BackPACK's factor is J_nᵀ S_n
        S = loss_root(lossfn, model(X).detach(), y).reshape(c, n, c)
        check_close(sq, torch.einsum("ncp,vnc->vnp", J, S), f"sqrt_ggn_exact[{name}] (= J_nᵀ S_n)")

        V = torch.randn((3,) + tuple(p.shape), generator=gen, dtype=p.dtype)
        if constant_rows and name in constant_rows:
            V[:, constant_rows[name]] = 0
        Vf = V.reshape(3, P)
        check_close(qs["ggnmp"][name](V), (Vf @ G).reshape(V.shape), f"ggnmp[{name}]")
        H = None
        if hmp or hessian:
            H = hessian_block(model, lossfn, X, y, name)
        if hmp:
            check_close(qs["hmp"][name](V), (Vf @ H).reshape(V.shape), f"hmp[{name}]")
        if hessian:
            Hn = hessian_per_sample(model, lossfn, X, y, name)
            check_close(Hn.sum(0), H, f"oracle self-check: per-sample Hessians sum to the Hessian [{name}]")
            R = residual_block(model, lossfn, X, y, name)
            check_close(G + R, H, f"oracle self-check: G + residual = Hessian [{name}]")
            check_close(qs["diag_h"][name], H.diagonal().reshape(p.shape), f"diag_h[{name}]")
            check_close(
                qs["diag_h_batch"][name],
                Hn.diagonal(dim1=1, dim2=2).reshape((n,) + tuple(p.shape)),
                f"diag_h_batch[{name}]",
            )
            PC = G + residual_block(model, lossfn, X, y, name, modify)
            check_close(qs["pchmp"][name](V), (Vf @ PC).reshape(V.shape), f"pchmp[{name}] ({modify})")
        if kflr is not None:
            module_name, role = kflr[name]
            got = qs["kflr"][name]
            want = kron_reference(model, lossfn, X, y, module_name, role)
            assert len(got) == len(want), f"kflr[{name}]: {len(got)} factors, expected {len(want)}"
            for i, (a, b) in enumerate(zip(got, want)):
                check_close(a, b, f"kflr[{name}][{i}]")
    # the product callables re-run the forward: the model must still be untouched
    _assert_same_state(before, state_snapshot(model))
    return qs


def check_hessian_diagonals(model, lossfn, X, y):
    """DiagHessian and BatchDiagHessian against torch.func Hessian blocks (any graph)."""
    qs = curvature(model, lossfn, [DiagHessian(), BatchDiagHessian()])(X, y)
    params = detached_params(model)
    for name in trainable_names(model):
        p = params[name]
        H = hessian_block(model, lossfn, X, y, name)
        check_close(qs["diag_h"][name], H.diagonal().reshape(p.shape), f"diag_h[{name}]")
        Hn = hessian_per_sample(model, lossfn, X, y, name)
        check_close(
            qs["diag_h_batch"][name],
            Hn.diagonal(dim1=1, dim2=2).reshape((X.shape[0],) + tuple(p.shape)),
            f"diag_h_batch[{name}]",
        )


def _dense_product(fn, p: Tensor) -> Tensor:
    P = p.numel()
    eye = torch.eye(P, dtype=p.dtype).reshape((P,) + tuple(p.shape))
    return fn(eye).reshape(P, P)


def _assert_loewner_geq(A: Tensor, B: Tensor, what: str) -> None:
    """``A ⪰ B`` up to round-off."""
    D = A - B
    scale = max(1.0, float(A.abs().max()), float(B.abs().max()))
    low = float(torch.linalg.eigvalsh((D + D.T) / 2).min())
    assert low >= -1e-9 * scale, f"{what}: smallest eigenvalue {low:.3e} < 0"


def check_hessian_family(model: nn.Module, lossfn: nn.Module, X: Tensor, y: Tensor, *, exact_pchmp: bool,
                         pchmp_optional: bool = False) -> None:
    """DiagHessian, BatchDiagHessian and PCHMP against brute force.

    ``exact_pchmp``: every smooth nonlinearity of the model is an activation
    module, so ``check_second_order(hessian=True)`` (``oracles.second_order``) checks
    PCHMP exactly. Otherwise the diagonals are compared with ``torch.func``
    Hessians, and PCHMP (``"clip"``, ``"abs"``) with the full blocks of
    ``oracles.pchmp``; where that oracle does not apply (in-place operations),
    PCHMP must be symmetric with ``PCH ⪰ GGN`` and ``PCH ⪰ Hessian``.
    ``pchmp_optional``: a refusal of PCHMP is accepted (nodes that are not
    element-wise: products, softmax, normalisations, shared weights).
    """
    if exact_pchmp and not pchmp_optional:
        check_second_order(model, lossfn, X, y, hessian=True, hmp=False)
        return
    qs = curvature(model, lossfn, [DiagHessian(), BatchDiagHessian()])(X, y)
    pc, exact = {}, {}
    try:
        for modify in ("clip", "abs"):
            pc[modify] = curvature(model, lossfn, [PCHMP(modify=modify)])(X, y)["pchmp"]
    except ValueError:
        if not pchmp_optional:
            raise
        pc = {}
    try:
        exact = {modify: pchmp_blocks(model, lossfn, X, y, modify) for modify in pc}
    except NotImplementedError:  # in-place operations
        pass
    params = detached_params(model)
    for name in trainable_names(model):
        p = params[name]
        H = hessian_block(model, lossfn, X, y, name)
        Hn = hessian_per_sample(model, lossfn, X, y, name)
        torch.testing.assert_close(
            qs["diag_h"][name], H.diagonal().reshape(p.shape), rtol=RTOL, atol=ATOL, msg=lambda m: f"diag_h[{name}]: {m}"
        )
        torch.testing.assert_close(
            qs["diag_h_batch"][name],
            Hn.diagonal(dim1=1, dim2=2).reshape((X.shape[0],) + tuple(p.shape)),
            rtol=RTOL, atol=ATOL, msg=lambda m: f"diag_h_batch[{name}]: {m}",
        )
        for modify, fns in pc.items():
            if modify in exact:
                continue
            PC = _dense_product(fns[name], p)
            torch.testing.assert_close(PC, PC.T, rtol=RTOL, atol=ATOL, msg=lambda m: f"pchmp[{name}] ({modify}) symmetric: {m}")
            _assert_loewner_geq(PC, ggn_block(model, lossfn, X, y, name), f"pchmp[{name}] ({modify}) ⪰ GGN")
            _assert_loewner_geq(PC, H, f"pchmp[{name}] ({modify}) ⪰ Hessian")
    for modify, want in exact.items():
        assert_blocks_close({k: _dense_product(pc[modify][k], params[k]) for k in want}, want, f"pchmp ({modify})")


def curvlib_blocks(model: nn.Module, lossfn: nn.Module, X: Tensor, y: Tensor, modify: str) -> Dict[str, Tensor]:
    """``{name: [P, P]}``: curvlib's PCHMP applied to the identity."""
    fns = curvature(model, lossfn, [PCHMP(modify=modify)])(X, y)["pchmp"]
    blocks = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            P = p.numel()
            blocks[name] = fns[name](torch.eye(P, dtype=torch.float64).reshape((P,) + tuple(p.shape))).reshape(P, P)
    return blocks
