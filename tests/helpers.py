"""Shared test helpers: run curvlib's first order and compare with the oracle."""

from __future__ import annotations

import torch
from torch import nn

from curvlib import curvature
from curvlib.extensions import BatchGrad, BatchL2Grad, SumGradSquared, Variance

from oracles import assert_close_dicts, first_order_reference

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
    from oracles_second import ggn_per_sample, trainable_names

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
