"""Hessian roots of the structural losses with options, against ``torch.func.hessian`` of the loss.

For ``nn.CrossEntropyLoss`` (``weight`` of any sign, ``ignore_index``,
``label_smoothing``, class indices or probabilities) and ``nn.BCEWithLogitsLoss``
(``weight``, ``pos_weight``) on outputs ``[N, K, *D]``: the signed roots
reproduce every per-sample block of the loss Hessian, the products (plain and
eigenvalue-modified) apply it, the sampled roots are unbiased, and the
``"mean"`` normaliser is PyTorch's (the ratio of the ``"sum"`` and ``"mean"`` losses).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, strategies as st
from torch import nn

from curvlib.losses import curvature_at, hessian_matvec, loss_spec, normaliser, sqrt_hessian

from oracles.second_order import loss_hessian_blocks
from oracles.on_device import seeded

F64 = torch.float64


@st.composite
def option_cases(draw):
    """``(lossfn, out [N, K, *D], y)`` with a random set of options."""
    kind = draw(st.sampled_from(["ce", "bce"]))
    n, k = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    shape = (n, k) + tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    gen = seeded(draw(st.integers(0, 2**16)))
    out = 2 * torch.randn(shape, generator=gen, dtype=F64)
    reduction = draw(st.sampled_from(["mean", "sum"]))
    low = -1.0 if reduction == "sum" and draw(st.booleans()) else 0.2  # negative weights: signed roots
    weight = (low + (2 - low) * torch.rand(k, generator=gen, dtype=F64)) if draw(st.booleans()) else None
    if kind == "bce":
        pos = (0.2 + 2 * torch.rand(shape[1:2] + (1,) * (len(shape) - 2), generator=gen, dtype=F64)
               if draw(st.booleans()) else None)
        w = weight.reshape(shape[1:2] + (1,) * (len(shape) - 2)) if weight is not None else None
        y = torch.rand(shape, generator=gen, dtype=F64)
        y = 2 * y - 0.5 if draw(st.booleans()) else y  # outside [0, 1]: with pos_weight, signed
        return nn.BCEWithLogitsLoss(weight=w, pos_weight=pos, reduction=reduction), out, y
    options = dict(weight=weight, reduction=reduction, label_smoothing=draw(st.sampled_from([0.0, 0.1, 0.45])))
    if draw(st.booleans()):
        return nn.CrossEntropyLoss(**options), out, torch.softmax(torch.randn(shape, generator=gen, dtype=F64), 1)
    y = torch.randint(0, k, (n,) + shape[2:], generator=gen)
    ignore = draw(st.sampled_from([None, -100, "real"]))
    if ignore == "real":
        options["ignore_index"] = draw(st.integers(0, k - 1))
        y.view(-1)[1:] = torch.where(y.view(-1)[1:] % 2 == 0, options["ignore_index"], y.view(-1)[1:])
        y.view(-1)[0] = (options["ignore_index"] + 1) % k if k > 1 else 0
        if k == 1:  # one class, and it is ignored: use "sum" (the mean is 0/0)
            options["reduction"] = "sum"
    elif ignore == -100:
        y.view(-1)[-1] = -100
        y.view(-1)[0] = 0
    return nn.CrossEntropyLoss(**options), out, y


def signed_blocks(roots, n: int, c: int) -> torch.Tensor:
    return sum(sign * torch.einsum("vnc,vnd->ncd", S.reshape(-1, n, c), S.reshape(-1, n, c)) for sign, S in roots)


def close(a, b, what, tol=1e-10):
    err, scale = float((a - b).abs().max()), float(b.abs().max())
    assert err <= tol * scale + 1e-13, f"{what}: max error {err:.3g} at scale {scale:.3g}"


@given(case=option_cases())
def test_roots_reproduce_loss_hessian(case):
    """``Σ sign · S Sᵀ = H_n``; positive options give one root, which is ``sqrt_hessian``."""
    lossfn, out, y = case
    n, c = out.shape[0], out[0].numel()
    H = loss_hessian_blocks(lossfn, out, y)
    curv = curvature_at(loss_spec(lossfn), out, y)
    roots = curv.roots()
    assert all(S.shape == (c,) + tuple(out.shape) for _, S in roots)
    close(signed_blocks(roots, n, c), H, "signed roots")
    psd = bool(torch.linalg.eigvalsh(H).min() >= -1e-12 * max(float(H.abs().max()), 1e-30))
    assert (len(roots) == 1) == (psd or not curv.signed), (len(roots), psd)
    if len(roots) == 1:
        close(signed_blocks([(1.0, sqrt_hessian(loss_spec(lossfn), out, y))], n, c), H, "sqrt_hessian")


@given(case=option_cases(), modify=st.sampled_from([None, "clip", "abs"]))
def test_products_apply_loss_hessian(case, modify):
    """``hessian_matvec`` and ``modified_matvec`` (eigenvalues clipped or absolute) per sample."""
    lossfn, out, y = case
    n, c = out.shape[0], out[0].numel()
    H = loss_hessian_blocks(lossfn, out, y)
    if modify is not None:
        evals, evecs = torch.linalg.eigh(H)
        evals = evals.clamp(min=0) if modify == "clip" else evals.abs()
        H = (evecs * evals.unsqueeze(1)) @ evecs.transpose(1, 2)
    mat = torch.randn((3,) + tuple(out.shape), generator=seeded(0), dtype=F64)
    spec = loss_spec(lossfn)
    got = (hessian_matvec(spec, out, y, mat) if modify is None
           else curvature_at(spec, out, y).modified_matvec(mat, modify))
    want = torch.einsum("ncd,vnd->vnc", H, mat.reshape(3, n, c)).reshape(mat.shape)
    close(got, want, f"product ({modify})", tol=1e-9)


@given(case=option_cases())
def test_mean_normaliser_is_pytorchs(case):
    """``normaliser = lossfn(reduction="sum") / lossfn(reduction="mean")`` (PyTorch's definition)."""
    lossfn, out, y = case
    if lossfn.reduction != "mean":
        assert normaliser(loss_spec(lossfn), y) == 1.0
        return
    summed = type(lossfn)(**{**_options(lossfn), "reduction": "sum"})(out, y)
    mean = lossfn(out, y)
    assume(abs(float(mean)) > 1e-9)  # (one class: every term is 0)
    ratio = float(summed / mean)
    assert normaliser(loss_spec(lossfn), y) == pytest.approx(ratio, rel=1e-10)


def _options(lossfn):
    if isinstance(lossfn, nn.BCEWithLogitsLoss):
        return dict(weight=lossfn.weight, pos_weight=lossfn.pos_weight)
    return dict(weight=lossfn.weight, ignore_index=lossfn.ignore_index, label_smoothing=lossfn.label_smoothing)


W = torch.tensor([1.5, 0.4, 0.9], dtype=F64)
SAMPLED = {
    "ce options": (lambda: nn.CrossEntropyLoss(weight=W, ignore_index=1, label_smoothing=0.2), "index"),
    "ce smoothing": (lambda: nn.CrossEntropyLoss(label_smoothing=0.3), "index"),
    "ce probabilities": (lambda: nn.CrossEntropyLoss(weight=W, label_smoothing=0.2), "prob"),
    "ce negative weight": (lambda: nn.CrossEntropyLoss(weight=torch.tensor([1.0, -0.7, 2.0], dtype=F64),
                                                       reduction="sum"), "index"),
    "bce": (lambda: nn.BCEWithLogitsLoss(weight=W.reshape(3, 1), pos_weight=W.flip(0).reshape(3, 1)), "bce"),
}


@pytest.mark.parametrize("case", sorted(SAMPLED))
def test_sampled_roots_are_unbiased(case):
    """``Σ_m sign · s_m s_mᵀ`` -> ``H_n``: relative error ~ 1/√M; ignored positions get zero columns."""
    make, target = SAMPLED[case]
    lossfn = make()
    gen = seeded(4)
    out = torch.randn(3, 3, 2, generator=gen, dtype=F64)
    if target == "index":
        y = torch.tensor([[0, 1], [1, 2], [2, 0]])
    elif target == "prob":
        y = torch.softmax(torch.randn(out.shape, generator=gen, dtype=F64), 1)
    else:
        y = torch.rand(out.shape, generator=gen, dtype=F64)
    H = loss_hessian_blocks(lossfn, out, y)
    errs = {}
    for m in (200, 20000):
        roots = curvature_at(loss_spec(lossfn), out, y).sampled_roots(m, seeded(1))
        assert all(S.shape == (m,) + tuple(out.shape) for _, S in roots)
        errs[m] = float((signed_blocks(roots, 3, 6) - H).norm() / H.norm())
        if case == "ce options":  # y[0, 1] and y[1, 0] are ignored
            assert roots[0][1][:, 0, :, 1].abs().max() == 0 and roots[0][1][:, 1, :, 0].abs().max() == 0
    assert errs[20000] < 0.05 and errs[20000] < errs[200] / 3, errs
