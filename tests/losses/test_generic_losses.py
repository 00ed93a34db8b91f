"""Generic per-sample losses (autodiff Hessian blocks) and ``KFACEmpirical``, against float64 oracles.

A focal-loss subclass of ``nn.CrossEntropyLoss``, ``nn.NLLLoss`` after
``LogSoftmax`` (its GGN is exactly zero), ``nn.HuberLoss``, ``nn.SmoothL1Loss``,
``nn.KLDivLoss(reduction="batchmean")``, ``nn.BCELoss`` on sigmoid outputs, plain
functions and a Gaussian NLL wrapper (indefinite loss Hessian: every quantity
linear in the GGN exact, its square roots refused). The oracles only call the
loss: per-sample parameter copies (first order) and ``torch.func.hessian`` of
``o ↦ lossfn(o, y)`` (second order). ``KFACEmpirical`` is checked against the
empirical-Fisher Kronecker factors built from autograd gradients at each layer.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib.extensions import HMP, KFRA, PCHMP, BatchGrad, DiagGGNExact, DiagHessian, KFACEmpirical, KFLR, SqrtGGNExact, SqrtGGNMC
from curvlib.losses import loss_spec

from oracles.loss_checks import F64, assert_converges, check_exact, close, mc_errors, model_and_input
from oracles.second_order import (
    detached_params, hessian_block, kfra_reference, loss_hessian_blocks, output_jacobian, residual_block,
)
from oracles.on_device import seeded


class Focal(nn.CrossEntropyLoss):
    """Focal loss (Lin et al.): ``−(1 − p_y)^γ log p_y``, averaged; overrides ``forward``."""

    def __init__(self, gamma: float = 2.0):
        super().__init__()
        self.gamma = gamma

    def forward(self, input, target):
        logp = F.log_softmax(input, 1).gather(1, target.unsqueeze(1)).squeeze(1)
        return (-((1 - logp.exp()) ** self.gamma) * logp).mean()


class PlainCE(nn.CrossEntropyLoss):
    """A subclass that keeps PyTorch's ``forward``: still the structural fast path."""


def log_cosh(out, y):
    return torch.log(torch.cosh(out - y)).sum() / out.shape[0]


def kl_of_logits(out, y):
    return F.kl_div(F.log_softmax(out, 1), y, reduction="batchmean")


def gaussian_nll(out, y):
    """Mean and log-variance from the model's two outputs: indefinite in the log-variance."""
    return F.gaussian_nll_loss(out[:, :1], y, out[:, 1:2].exp())


W = torch.tensor([1.0, 0.5, 2.0], dtype=F64)
# case -> (sequence output [N, C, D]?, module after the model, loss, targets)
CASES = {
    "focal": (False, None, Focal(), "index"),
    "focal seq": (True, None, Focal(gamma=1.5), "index"),
    "nll": (False, nn.LogSoftmax(1), nn.NLLLoss(weight=W, ignore_index=1), "index"),
    "huber": (False, None, nn.HuberLoss(delta=0.7), "real"),
    "smooth l1 seq": (True, None, nn.SmoothL1Loss(beta=0.7, reduction="sum"), "real"),
    "kl batchmean": (False, nn.LogSoftmax(1), nn.KLDivLoss(reduction="batchmean"), "prob"),
    "kl log target": (True, nn.LogSoftmax(1), nn.KLDivLoss(reduction="sum", log_target=True), "log prob"),
    "kl of logits": (False, None, kl_of_logits, "prob"),
    "bce": (False, nn.Sigmoid(), nn.BCELoss(), "unit"),
    "function": (False, None, log_cosh, "real"),
    "gaussian nll": (False, None, gaussian_nll, "gauss"),
}


def problem(case: str, n: int = 4):
    seq, post, lossfn, target = CASES[case]
    gen = seeded(len(case))
    model, X = model_and_input(seq, 3, 4, 3, n, 2, 2, "tanh", gen)
    if post is not None:
        model = nn.Sequential(model, post)
    with torch.no_grad():
        out = model(X)
    if target == "index":
        y = torch.randint(0, 3, (n,) + tuple(out.shape[2:]), generator=gen)
    elif target in ("prob", "log prob"):
        y = torch.softmax(torch.randn(out.shape, generator=gen, dtype=F64), 1)
        y = y.log() if target == "log prob" else y
    elif target == "gauss":
        y = torch.randn(n, 1, generator=gen, dtype=F64)
    else:
        y = torch.rand(out.shape, generator=gen, dtype=F64) * (1 if target == "unit" else 4) - (0 if target == "unit" else 2)
    return model, lossfn, X, y


def is_psd(model, lossfn, X, y) -> bool:
    with torch.no_grad():
        H = loss_hessian_blocks(lossfn, model(X), y)
    return bool(torch.linalg.eigvalsh(H).min() >= -1e-12 * max(float(H.abs().max()), 1e-30))


@pytest.mark.parametrize("case", sorted(CASES))
def test_generic_loss_exact(case):
    """First order, GGN diagonals, square root (PSD) or its refusal, KFLR, GGNMP, Hessian diagonals."""
    model, lossfn, X, y = problem(case)
    assert loss_spec(lossfn).kind == "generic"
    psd = is_psd(model, lossfn, X, y)
    assert psd == (case != "gaussian nll")
    qs = check_exact(model, lossfn, X, y, sqrt=psd)
    if not psd:
        for ext in (SqrtGGNExact(), SqrtGGNMC(mc_samples=3)):
            with pytest.raises(CurvatureError, match=r"indefinite \(eigenvalue -[0-9.e-]+ for sample \d\)"):
                curvature(model, lossfn, [ext])(X, y)
    if case in ("nll", "kl batchmean", "kl log target"):  # linear in the model output: no GGN
        assert all(t.abs().max() == 0 for t in qs["diag_ggn_exact"].values())
        assert all(f[0].abs().max() == 0 for f in qs["kflr"].values())
        assert any(t.abs().max() > 0 for t in qs["diag_h"].values())  # (the softmax's curvature)


def test_kl_of_logits_equals_soft_label_cross_entropy():
    """``KL(y ‖ softmax(f))`` and cross-entropy with soft labels differ by a constant in ``f``:
    the generic path and the structural one give the same gradients and GGN."""
    model, lossfn, X, y = problem("kl of logits")
    exts = lambda: [BatchGrad(), DiagGGNExact(), KFLR(), SqrtGGNExact()]  # noqa: E731
    generic = curvature(model, lossfn, exts())(X, y)
    structural = curvature(model, nn.CrossEntropyLoss(), exts())(X, y)
    for key in ("grad", "grad_batch", "diag_ggn_exact"):
        for name, t in structural[key].items():
            close(generic[key][name], t, f"{key}[{name}]")
    for name, factors in structural["kflr"].items():
        for i, t in enumerate(factors):
            close(generic["kflr"][name][i], t, f"kflr[{name}][{i}]")
    for name, t in structural["sqrt_ggn_exact"].items():  # (roots differ by a rotation)
        a, b = generic["sqrt_ggn_exact"][name].flatten(2), t.flatten(2)
        close(torch.einsum("vnp,vnq->npq", a, a), torch.einsum("vnp,vnq->npq", b, b), f"sqrt[{name}]")


@pytest.mark.parametrize("case", ["bce", "gaussian nll"])
def test_generic_monte_carlo_converges(case):
    """Gaussian roots ``R ε/√M``: unbiased for a PSD loss and, signed, for an indefinite one
    (whose positive and negative parts cancel: a noisier estimate, a looser ratio)."""
    model, lossfn, X, y = problem(case)
    keys = ("diag_ggn_mc", "diag_ggn_mc_batch", "kfac") + (("sqrt_ggn_mc",) if case == "bce" else ())
    assert_converges(mc_errors(model, lossfn, X, y, keys=keys), ratio=3.0 if case == "bce" else 2.0)


def modified_blocks(lossfn, out, y, modify):
    """``U mod(Λ) Uᵀ`` of every per-sample loss Hessian block (``"clip"``: ``max(λ, 0)``, ``"abs"``)."""
    evals, U = torch.linalg.eigh(loss_hessian_blocks(lossfn, out, y))
    evals = evals.clamp(min=0) if modify == "clip" else evals.abs()
    return (U * evals.unsqueeze(1)) @ U.transpose(1, 2)


@pytest.mark.parametrize("case", ["focal", "huber", "gaussian nll", "ce negative weight"])
@pytest.mark.parametrize("modify", ["clip", "abs"])
def test_block_products_and_kfra(case, modify):
    """HMP (exact Hessian), PCHMP (the loss Hessian's eigenvalues modified as well as the
    activations' residuals: ``Σ J_nᵀ mod(H_n) J_n + R_mod``) and KFRA (``oracles.second_order.kfra_reference``)."""
    if case == "ce negative weight":
        model, X = model_and_input(False, 3, 4, 3, 4, 1, 1, "tanh", seeded(1))
        lossfn, y = nn.CrossEntropyLoss(weight=torch.tensor([1.0, -0.5, 2.0], dtype=F64)), torch.tensor([0, 1, 2, 1])
    else:
        model, lossfn, X, y = problem(case)
    qs = curvature(model, lossfn, [HMP(), PCHMP(modify=modify), KFRA()])(X, y)
    with torch.no_grad():
        Hm = modified_blocks(lossfn, model(X), y, modify)
    gen = seeded(0)
    for name, p in detached_params(model).items():
        J = output_jacobian(model, X, name)
        PC = torch.einsum("ncp,ncd,ndq->pq", J, Hm, J) + residual_block(model, lossfn, X, y, name, modify)
        H = hessian_block(model, lossfn, X, y, name)
        V = torch.randn((2,) + p.shape, generator=gen, dtype=F64)
        close(qs["pchmp"][name](V), (V.reshape(2, -1) @ PC).reshape(V.shape), f"pchmp[{name}]")
        close(qs["hmp"][name](V), (V.reshape(2, -1) @ H).reshape(V.shape), f"hmp[{name}]")
    for name, factors in kfra_reference(model, lossfn, X, y).items():
        for i, f in enumerate(factors):
            close(qs["kfra"][name][i], f, f"kfra[{name}][{i}]")


def test_generic_loss_under_vmap_over_an_ensemble():
    """``vmap`` over stacked parameters: each member's results as a direct call; the square
    root, whose existence depends on the signs vmap hides, is refused clearly."""
    model, lossfn, X, y = problem("huber")
    members = [{k: v.detach() * s for k, v in model.named_parameters()} for s in (1.0, 1.1)]
    stacked = {k: torch.stack([m[k] for m in members]) for k in members[0]}
    f = curvature(model, lossfn, [BatchGrad(), DiagGGNExact(), KFLR()])
    batched = torch.func.vmap(lambda p: f(X, y, params=p))(stacked)
    for i, member in enumerate(members):
        direct = f(X, y, params=member)
        for key in ("grad_batch", "diag_ggn_exact"):
            for name, t in direct[key].items():
                close(batched[key][name][i], t, f"member {i} {key}[{name}]")
        for name, factors in direct["kflr"].items():
            close(batched["kflr"][name][0][i], factors[0], f"member {i} kflr[{name}]")
    g = curvature(model, lossfn, [SqrtGGNExact()])
    with pytest.raises(CurvatureError, match="SqrtGGNExact under a torch.func transform"):
        torch.func.vmap(lambda p: g(X, y, params=p))(stacked)


# ----------------------------------------------------------------------------- refusals


def pairs(out, y):
    return ((out[0::2] - out[1::2]) ** 2).sum()


def centred(out, y):
    return ((out - out.mean(0)) ** 2).sum()


def later_pair(out, y):
    """Sample 0 on its own; samples 1 and 2 coupled."""
    return (out[0] ** 2).sum() + (out[1] * out[2]).sum() + (out[3] ** 2).sum()


@pytest.mark.parametrize("lossfn", [pairs, centred, later_pair])
@pytest.mark.parametrize("ext", [BatchGrad, DiagGGNExact])
def test_loss_coupling_samples_refused(lossfn, ext):
    model, _, X, y = problem("function")
    with pytest.raises(CurvatureError, match=f"lossfn {lossfn.__name__} couples samples"):
        curvature(model, lossfn, [ext()])(X, y)


@pytest.mark.parametrize("ext", [BatchGrad, DiagGGNExact])
def test_non_scalar_loss_refused(ext):
    model, _, X, y = problem("function")
    with pytest.raises(CurvatureError, match=r"returned \(4,\), not a scalar"):
        curvature(model, lambda o, t: ((o - t) ** 2).sum(1), [ext()])(X, y)


def test_refused_at_construction():
    """``reduction="none"``, ``GaussianNLLLoss`` (3 arguments), slices and process groups."""
    model, lossfn, X, y = problem("huber")
    with pytest.raises(CurvatureError, match=r"HuberLoss\(reduction='none'\) is not supported"):
        curvature(model, nn.HuberLoss(reduction="none"), [BatchGrad()])
    with pytest.raises(CurvatureError, match=r"GaussianNLLLoss needs 3 arguments.*Wrap it in a function"):
        curvature(model, nn.GaussianNLLLoss(), [BatchGrad()])
    with pytest.raises(CurvatureError, match="batch_chunk_size with lossfn HuberLoss"):
        curvature(model, lossfn, [BatchGrad()], batch_chunk_size=2)
    with pytest.raises(CurvatureError, match="process_group with lossfn HuberLoss"):
        curvature(model, lossfn, [BatchGrad()], process_group=object())


def test_structural_losses_keep_the_fast_path():
    kinds = {nn.CrossEntropyLoss(label_smoothing=0.1): "ce", PlainCE(): "ce", nn.MSELoss(reduction="sum"): "mse",
             nn.BCEWithLogitsLoss(pos_weight=torch.ones(2)): "bce", Focal(): "generic", nn.NLLLoss(): "generic",
             nn.KLDivLoss(reduction="batchmean"): "generic", log_cosh: "generic"}
    assert {type(k).__name__ if isinstance(k, nn.Module) else k.__name__: loss_spec(k).kind for k in kinds} == \
        {type(k).__name__ if isinstance(k, nn.Module) else k.__name__: v for k, v in kinds.items()}
    with pytest.raises(CurvatureError, match="reduction='batchmean'"):  # PyTorch's CE has no batchmean
        loss_spec(nn.CrossEntropyLoss(reduction="batchmean"))


def test_nll_small_integer_targets():
    model, lossfn, X, y = problem("nll")
    want = curvature(model, lossfn, [BatchGrad(), DiagGGNExact()])(X, y)
    got = curvature(model, lossfn, [BatchGrad(), DiagGGNExact()])(X, y.to(torch.int8))
    for name, t in want["grad_batch"].items():
        close(got["grad_batch"][name], t, f"grad_batch[{name}]", tol=0)


# ----------------------------------------------------------------------------- KFACEmpirical


def ef_kron_reference(model, lossfn, X, y, name: str, approx=None):
    """Empirical-Fisher factors of a Linear layer from autograd: ``m[n, s]`` the gradient of the loss
    at the layer's output (sample ``n``, position ``s``), ``x`` its input. BackPACK-like (``None``):
    ``B = Σ_n (Σ_s m)(Σ_s m)ᵀ``, ``A = (1/N) Σ_{n,s} x xᵀ``; ``"expand"``: ``B = Σ_{n,s} m mᵀ``,
    ``A = (1/(N S)) Σ x xᵀ``; ``"reduce"``: ``A = (1/N) Σ_n x̄ x̄ᵀ`` (``x̄`` the mean over positions)."""
    module_name, role = name.rsplit(".", 1)
    store = {}

    def hook(mod, args, out):
        store["x"] = args[0].detach()
        store["delta"] = torch.zeros_like(out, requires_grad=True)
        return out + store["delta"]

    handle = model.get_submodule(module_name).register_forward_hook(hook)
    try:
        (m,) = torch.autograd.grad(lossfn(model(X), y), store["delta"])
    finally:
        handle.remove()
    n = X.shape[0]
    m, x = m.reshape(n, -1, m.shape[-1]), store["x"].reshape(n, -1, store["x"].shape[-1])
    ms = m.flatten(0, 1) if approx == "expand" else m.sum(1)
    B = ms.T @ ms
    if role == "bias":
        return [B]
    xs = x.mean(1) if approx == "reduce" else x.flatten(0, 1)
    return [B, xs.T @ xs / (n * x.shape[1] if approx == "expand" else n)]


def sequence_problem():
    """A Linear MLP over positions, ``[N, T, 2] -> [N, T, 2]``, flattened into MSE."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 2), nn.Flatten()).double()
    X = torch.randn(4, 5, 2, dtype=F64)
    return model, X, torch.randn(4, 10, dtype=F64)


@pytest.mark.parametrize("case", ["ce options", "ce probabilities", "huber", "sequence mse", "sequence huber"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("approx", [None, "expand", "reduce"])
def test_kfac_empirical(case, reduction, approx):
    if case.startswith("sequence"):
        model, X, y = sequence_problem()
        lossfn = (nn.MSELoss if case == "sequence mse" else nn.HuberLoss)(reduction=reduction)
    else:
        model, lossfn, X, y = problem("huber", n=5)
        if case.startswith("ce"):
            with torch.no_grad():
                y = (torch.tensor([0, 2, 1, 1, 2]) if case == "ce options" else torch.softmax(model(X), 1).flip(1))
            lossfn = nn.CrossEntropyLoss(weight=W, ignore_index=1 if case == "ce options" else -100,
                                         label_smoothing=0.2)
        lossfn.reduction = reduction
    qs = curvature(model, lossfn, [KFACEmpirical(kfac_approx=approx)])(X, y)
    assert list(qs["kfac_empirical"]) == [n for n, _ in model.named_parameters()]
    for name, factors in qs["kfac_empirical"].items():
        want = ef_kron_reference(model, lossfn, X, y, name, approx)
        assert len(factors) == len(want), name
        for i, (a, b) in enumerate(zip(factors, want)):
            close(a, b, f"kfac_empirical[{name}][{i}]")


def test_nll_loss_ggn_warns_once_and_points_to_cross_entropy():
    """NLLLoss is linear in f: the GGN is exactly 0, said once per curvature object."""
    model = nn.Sequential(nn.Linear(3, 4), nn.LogSoftmax(1)).double()
    X, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 4, (5,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f = curvature(model, nn.NLLLoss(), [DiagGGNExact()])
        qs = [f(X, y) for _ in range(2)]
    linear = [w for w in caught if "linear in the model output" in str(w.message)]
    assert len(linear) == 1 and "nn.CrossEntropyLoss on the logits" in str(linear[0].message)
    assert linear[0].filename == __file__  # points at the user's curvature(...) line
    assert all(float(d.abs().max()) == 0.0 for q in qs for d in q["diag_ggn_exact"].values())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        curvature(model, nn.NLLLoss(), [DiagHessian()])  # the Hessian keeps the log-softmax's curvature
        curvature(model[0], nn.CrossEntropyLoss(), [DiagGGNExact()])
    assert not [w for w in caught if "linear in the model output" in str(w.message)]
