"""Dense per-sample residuals ``∇²_u (g · f(u))`` by ``torch.func.hessian``, against which the
factored residuals (signed columns, positive-curvature products) are checked."""

import torch

from curvlib._hessian.algebra import factor, positive_curvature


def _dense(f, inputs, g, in_dims, out_dim):
    """``R [N, D, D]`` over the concatenated per-sample inputs, by brute force."""
    xs = [x.movedim(d, 0) for x, d in zip(inputs, in_dims)]
    n = xs[0].shape[0]
    sizes = [x[0].numel() for x in xs]
    R = []
    for k in range(n):
        u = torch.cat([x[k].reshape(-1) for x in xs])

        def contracted(u):
            parts = [p.reshape(x[k].shape).unsqueeze(d) for p, x, d in zip(torch.split(u, sizes), xs, in_dims)]
            return (f(*parts).movedim(out_dim, 0)[0] * g.movedim(out_dim, 0)[k]).sum()

        R.append(torch.func.hessian(contracted)(u))
    return torch.stack(R), sizes


def _assembled(res, g, n, sizes):
    """``Σ sign c cᵀ`` per sample from the signed columns."""
    total = 0
    for sign, taps, _ in factor(res, g):
        v = taps[0].shape[0]
        cols = torch.cat([taps[j][0:v].movedim(1 + d, 1).reshape(v, n, -1) for j, d in enumerate(res.in_dims)], 2)
        total = total + sign * torch.einsum("vni,vnj->nij", cols, cols)
    return total


def check_residual(res, f, g, n, floor: float = 0.0):
    """``floor``: the size of the terms that cancel in ``R`` (a tolerance scale where ``R`` is ~0)."""
    R, sizes = _dense(f, res.inputs, g, res.in_dims, res.out_dim)
    scale = float(R.abs().max()) + floor + 1e-30
    assert float((_assembled(res, g, n, sizes) - R).abs().max()) <= 1e-10 * scale
    for modify in ("clip", "abs"):
        lam, Q = torch.linalg.eigh(R)
        lam = lam.clamp(min=0) if modify == "clip" else lam.abs()
        M = (Q * lam.unsqueeze(1)) @ Q.transpose(1, 2)
        t = [torch.randn_like(x) for x in res.inputs]
        flat = torch.cat([x.movedim(d, 0).reshape(n, -1) for x, d in zip(t, res.in_dims)], 1)
        want = torch.einsum("nij,nj->ni", M, flat)
        got, _ = positive_curvature(res, g, modify)(t, {})
        got = torch.cat([c.movedim(d, 0).reshape(n, -1) for c, d in zip(got, res.in_dims)], 1)
        assert float((got - want).abs().max()) <= 1e-10 * scale, modify
