"""curvlib on architectures BackPACK's second order cannot take, checked by brute force.

    python examples/architectures.py

For each model of the test zoo (``tests/models.py``: a ResNet with BatchNorm,
a transformer encoder block, a tied autoencoder, in-place activations,
gating, concatenated branches, a reused module, functional ops) this computes
individual gradients, their norms, the GGN diagonal and the Hessian diagonal
with curvlib, and the same quantities by brute force with ``torch.func``
(float64), and prints the largest deviation. Where curvlib refuses an
extension (the Hessian family on operations whose second derivative it does
not know yet), the refusal is printed instead.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch.func import functional_call, hessian, jacrev

from curvlib import CurvatureError, curvature
from curvlib.extensions import BatchGrad, BatchL2Grad, DiagGGNExact, DiagHessian

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from models import ZOO  # noqa: E402

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- brute force


def _loss_of(model, lossfn, X, y, name):
    params = {k: p.detach() for k, p in model.named_parameters()}

    def out(t):
        return functional_call(model, {**params, name: t}, (X,))

    return out, params[name]


def brute_force(model, lossfn, X, y):
    """Individual gradients, GGN and Hessian diagonals from dense ``torch.func`` objects."""
    n = X.shape[0]
    result = {"grad_batch": {}, "batch_l2": {}, "diag_ggn_exact": {}, "diag_h": {}}
    for name, p in model.named_parameters():
        out, p0 = _loss_of(model, lossfn, X, y, name)
        with torch.no_grad():
            o0 = out(p0)
        # sample i's term of the loss: only row i depends on the parameter
        per = []
        for i in range(n):
            mask = torch.zeros((n,) + (1,) * (o0.dim() - 1), dtype=torch.bool)
            mask[i] = True
            per.append(torch.func.grad(lambda t, m=mask: lossfn(torch.where(m, out(t), o0), y))(p0))
        gb = torch.stack(per)
        result["grad_batch"][name] = gb
        result["batch_l2"][name] = (gb**2).flatten(1).sum(1)
        J = jacrev(out)(p0).reshape(o0.numel(), p0.numel())
        HL = hessian(lambda o: lossfn(o, y))(o0).reshape(o0.numel(), o0.numel())
        result["diag_ggn_exact"][name] = torch.einsum("ap,ab,bp->p", J, HL, J).reshape(p0.shape)
        H = jacrev(jacrev(lambda t: lossfn(out(t), y)))(p0).reshape(p0.numel(), p0.numel())
        result["diag_h"][name] = H.diagonal().reshape(p0.shape)
    return result


def max_deviation(got, want) -> float:
    return max(float((got[k] - want[k]).abs().max()) for k in want)


# ----------------------------------------------------------------------------- main

EXTENSIONS = [("BatchGrad", BatchGrad), ("BatchL2Grad", BatchL2Grad), ("DiagGGNExact", DiagGGNExact), ("DiagHessian", DiagHessian)]


def main() -> None:
    for arch, build in ZOO.items():
        model, lossfn, X, y, _ = build(0)
        n_params = sum(p.numel() for p in model.parameters())
        ref = brute_force(model, lossfn, X, y)
        print(f"\n{arch}: {type(model).__name__}, {n_params} parameters, X {tuple(X.shape)}, "
              f"output {tuple(model(X).shape)}, {type(lossfn).__name__}")
        print(f"  {'extension':<14} {'result key':<16} {'max |curvlib - brute force|':>28} {'ms':>8}")
        for label, ext in EXTENSIONS:
            e = ext()
            try:
                f = curvature(model, lossfn, [e])
                f(X, y)  # first call: traces and plans
                t0 = time.perf_counter()
                qs = f(X, y)
                ms = 1e3 * (time.perf_counter() - t0)
            except CurvatureError as err:
                print(f"  {label:<14} refused: {str(err).splitlines()[0][:100]}...")
                continue
            print(f"  {label:<14} {e.name:<16} {max_deviation(qs[e.name], ref[e.name]):>28.2e} {ms:>8.1f}")


if __name__ == "__main__":
    main()
