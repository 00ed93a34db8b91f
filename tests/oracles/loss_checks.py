"""Shared checks of the loss tests: curvlib's quantities against the brute-force oracles
(``oracles.first_order.first_order_reference``, ``oracles.second_order``), for any per-sample loss."""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from torch import nn

from curvlib import curvature
from curvlib.extensions import (
    GGNMP, KFAC, KFLR, BatchDiagGGNExact, BatchDiagGGNMC, BatchDiagHessian, BatchGrad, BatchL2Grad,
    DiagGGNExact, DiagGGNMC, DiagHessian, SqrtGGNExact, SqrtGGNMC, SumGradSquared, Variance,
)

from oracles.first_order import first_order_reference
from oracles.second_order import (
    detached_params, ggn_per_sample, hessian_block, hessian_per_sample, kron_input_factor,
    kron_output_factor, trainable_names,
)
from oracles.on_device import seeded

F64 = torch.float64

FIRST = (BatchGrad, BatchL2Grad, SumGradSquared, Variance)


def close(a, b, what, tol=1e-8):
    """``max|a − b| ≤ tol · max|b| + 1e-12`` (one scale for the whole result)."""
    assert tuple(a.shape) == tuple(b.shape), f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    if b.numel():
        err, scale = float((a - b).detach().abs().max()), float(b.detach().abs().max())
        assert err <= tol * scale + 1e-12, f"{what}: max error {err:.3g} at scale {scale:.3g}"

def model_and_input(seq: bool, i: int, h: int, c: int, n: int, d: int, k: int, act: str, gen):
    """MLP ``[N, i] -> [N, C]`` or Conv1d net ``[N, i, d + k - 1] -> [N, C, d]``."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    a = {"tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "relu": nn.ReLU}[act]()
    if seq:
        model = nn.Sequential(nn.Conv1d(i, h, k), a, nn.Conv1d(h, c, 1))
        X = torch.randn(n, i, d + k - 1, generator=gen, dtype=F64)
    else:
        model = nn.Sequential(nn.Linear(i, h), a, nn.Linear(h, c))
        X = torch.randn(n, i, generator=gen, dtype=F64)
    return model.double(), X

def kflr_reference(model, lossfn, X, y, name):
    module, role = name.rsplit(".", 1)
    B = kron_output_factor(model, lossfn, X, y, module)
    return [B] if role == "bias" else [B, kron_input_factor(model, X, module)]


def check_exact(model, lossfn, X, y, sqrt=True):
    """loss, grad, first order, DiagGGNExact, BatchDiagGGNExact, SqrtGGNExact, KFLR, GGNMP,
    DiagHessian and BatchDiagHessian against the oracles."""
    second = [DiagGGNExact(), BatchDiagGGNExact(), KFLR(), GGNMP(), DiagHessian(), BatchDiagHessian()]
    second += [SqrtGGNExact()] if sqrt else []
    qs = curvature(model, lossfn, [e() for e in FIRST] + second)(X, y)
    close(qs["loss"], lossfn(model(X), y).detach(), "loss")
    ref = first_order_reference(model, lossfn, X, y)
    for key, per_param in ref.items():
        for name, want in per_param.items():
            close(qs[key][name], want, f"{key}[{name}]")
    n, params = X.shape[0], detached_params(model)
    gen = seeded(0)
    for name in trainable_names(model):
        p = params[name]
        Gn = ggn_per_sample(model, lossfn, X, y, name)
        close(qs["diag_ggn_exact"][name], Gn.sum(0).diagonal().reshape(p.shape), f"diag_ggn_exact[{name}]")
        close(qs["diag_ggn_exact_batch"][name], Gn.diagonal(dim1=1, dim2=2).reshape((n,) + p.shape),
              f"diag_ggn_exact_batch[{name}]")
        if sqrt:
            sq = qs["sqrt_ggn_exact"][name].reshape(-1, n, p.numel())
            close(torch.einsum("vnp,vnq->npq", sq, sq), Gn, f"sqrt_ggn_exact[{name}] outer products")
        V = torch.randn((3,) + p.shape, generator=gen, dtype=F64)
        close(qs["ggnmp"][name](V), (V.reshape(3, -1) @ Gn.sum(0)).reshape(V.shape), f"ggnmp[{name}]")
        close(qs["diag_h"][name], hessian_block(model, lossfn, X, y, name).diagonal().reshape(p.shape),
              f"diag_h[{name}]")
        Hn = hessian_per_sample(model, lossfn, X, y, name)
        close(qs["diag_h_batch"][name], Hn.diagonal(dim1=1, dim2=2).reshape((n,) + p.shape), f"diag_h_batch[{name}]")
        for i, (a, b) in enumerate(zip(qs["kflr"][name], kflr_reference(model, lossfn, X, y, name), strict=True)):
            close(a, b, f"kflr[{name}][{i}]")
    return qs

MC_EXTS = {"diag_ggn_mc": DiagGGNMC, "diag_ggn_mc_batch": BatchDiagGGNMC, "sqrt_ggn_mc": SqrtGGNMC, "kfac": KFAC}


def mc_exact(model, lossfn, X, y):
    """What each MC quantity estimates (the sqrt as per-sample outer products, KFAC as ``B``)."""
    exact = {key: {} for key in MC_EXTS}
    for name, p in detached_params(model).items():
        Gn = ggn_per_sample(model, lossfn, X, y, name)
        exact["diag_ggn_mc"][name] = Gn.sum(0).diagonal().reshape(p.shape)
        exact["diag_ggn_mc_batch"][name] = Gn.diagonal(dim1=1, dim2=2).reshape((X.shape[0],) + p.shape)
        exact["sqrt_ggn_mc"][name] = Gn
        exact["kfac"][name] = kron_output_factor(model, lossfn, X, y, name.rsplit(".", 1)[0])
    return exact


def mc_read(key, result, model, X):
    if key == "sqrt_ggn_mc":
        return {k: torch.einsum("mnp,mnq->npq", *(2 * [s.flatten(2)])) for k, s in result.items()}
    if key == "kfac":
        for name, factors in result.items():  # A is exact for any M
            if len(factors) == 2:
                close(factors[1], kron_input_factor(model, X, name.rsplit(".", 1)[0]), f"kfac[{name}] A")
        return {k: f[0] for k, f in result.items()}
    return result


def rel(est, exact):
    num = sum(((est[k].detach() - exact[k]) ** 2).sum() for k in exact)
    return float((num / sum((v.detach() ** 2).sum() for v in exact.values())) ** 0.5)


def mc_errors(model, lossfn, X, y, sizes=(1, 100, 10000), on_result=None, keys=tuple(MC_EXTS)):
    """``{key: {M: relative error}}`` of the MC extensions ``keys`` (own seeded generators) against
    the exact quantity each estimates; ``on_result(qs)`` sees each call's results."""
    exact = mc_exact(model, lossfn, X, y)
    errs = {key: {} for key in keys}
    for m in sizes:
        exts = [MC_EXTS[key](mc_samples=m, generator=seeded(i)) for i, key in enumerate(keys)]
        qs = curvature(model, lossfn, exts)(X, y)
        for key in keys:
            errs[key][m] = rel(mc_read(key, qs[key], model, X), exact[key])
        if on_result is not None:
            on_result(qs)
    return errs


def assert_converges(errs, ratio=3.0):
    """Error ~ 1/√M: small at M = 10000, ``ratio`` times smaller than at 100 (10 in expectation),
    which beats M = 1."""
    for key, e in errs.items():
        assert e[10000] < 0.1 and e[10000] < e[100] / ratio and e[100] < e[1], (key, e)


# ----------------------------------------------------------------------------- drawn problems (loss options)


def ce_targets(out, target: str, ignore: str, ignore_class: int, gen):
    """Class indices (with ignored entries, the first one counted) or class probabilities."""
    k = out.shape[1]
    if target == "prob":
        return torch.softmax(torch.randn(out.shape, generator=gen, dtype=F64), 1)
    y = torch.randint(0, k, (out.shape[0],) + tuple(out.shape[2:]), generator=gen)
    flat = y.view(-1)
    if ignore == "real":
        flat[-1] = ignore_class
        flat[0] = (ignore_class + 1) % k
    elif ignore == "default":
        flat[-1] = -100
    return y


@st.composite
def ce_problems(draw):
    seq = draw(st.booleans())
    k, n = draw(st.integers(2, 3)), draw(st.integers(2, 4))
    gen = seeded(draw(st.integers(0, 2**16)))
    model, X = model_and_input(seq, draw(st.integers(1, 3)), draw(st.integers(1, 3)), k, n,
                               draw(st.integers(1, 3)), draw(st.integers(1, 2)),
                               draw(st.sampled_from(["tanh", "sigmoid", "relu"])), gen)
    target = draw(st.sampled_from(["index", "prob"]))
    ignore = draw(st.sampled_from(["none", "real", "default"]))
    ignore_class = draw(st.integers(0, k - 1))
    options = dict(reduction=draw(st.sampled_from(["mean", "sum"])),
                   label_smoothing=draw(st.sampled_from([0.0, 0.3])))
    if draw(st.booleans()):
        options["weight"] = 0.2 + 2 * torch.rand(k, generator=gen, dtype=F64)
    if ignore == "real" and target == "index":  # (PyTorch refuses it for probabilities)
        options["ignore_index"] = ignore_class
    with torch.no_grad():
        y = ce_targets(model(X), target, ignore, ignore_class, gen)
    return model, nn.CrossEntropyLoss(**options), X, y


def bce_weight(shape_kind: str, out_shape, gen):
    n, c = out_shape[0], out_shape[1]
    rest = (1,) * (len(out_shape) - 2)
    shape = {"class": (c,) + rest, "sample": (n,) + (1,) * (len(out_shape) - 1), "full": tuple(out_shape),
             "scalar": (1,), "last": (out_shape[-1],)}[shape_kind]
    return 0.2 + 2 * torch.rand(shape, generator=gen, dtype=F64)


@st.composite
def bce_problems(draw):
    seq = draw(st.booleans())
    gen = seeded(draw(st.integers(0, 2**16)))
    model, X = model_and_input(seq, draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 3)),
                               draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 2)),
                               draw(st.sampled_from(["tanh", "sigmoid", "relu"])), gen)
    with torch.no_grad():
        shape = tuple(model(X).shape)
    options = dict(reduction=draw(st.sampled_from(["mean", "sum"])))
    w = draw(st.sampled_from(["none", "class", "sample", "full", "scalar", "last"]))
    if w != "none":
        options["weight"] = bce_weight(w, shape, gen)
    if draw(st.booleans()):
        options["pos_weight"] = bce_weight("class", shape, gen)
    y = torch.rand(shape, generator=gen, dtype=F64)
    return model, nn.BCEWithLogitsLoss(**options), X, y
