"""curvlib as a laplace-torch backend (``curvlib.laplace``).

Optional dependency: laplace-torch 0.3 (with BackPACK and curvlinops, which it
imports). Reference values: laplace-torch's BackPACK and curvlinops backends on
a Sequential model; on a residual model and on a model with LayerNorm (which
BackPACK's backend cannot handle) a brute-force GGN from ``torch.func`` and
laplace's own ``torch.func`` implementation of the GGN interface.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from oracles.on_device import ON_CPU, seeded

pytest.importorskip(
    "laplace",
    reason="optional dependency laplace-torch is not installed "
    "(pip install --no-deps laplace-torch==0.3 and its requirements)",
)

from laplace import Laplace
from laplace.curvature import BackPackGGN, CurvatureInterface, CurvlinopsGGN, GGNInterface

from curvlib import CurvatureError, CurvatureTypeError
from curvlib.laplace import CurvlibEF, CurvlibGGN
from oracles.laplace_torch import (
    C,
    D_IN,
    DT,
    FACTOR,
    LIKELIHOODS,
    N_DATA,
    brute_force_ggn,
    brute_force_grads,
    brute_force_jacobians,
    close,
    compare_laplace,
    data,
    fitted,
    layernorm,
    linear_inputs,
    loader,
    mlp,
    param_slices,
    residual,
)

# BackPACK's backend (a reference here) warns about its full backward hooks;
# laplace-torch's utilities call the deprecated torch.jit.script.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Full backward hook:UserWarning",
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning",
    "ignore:By default `link_approx`:UserWarning",
)


def fresh_backpack(model_fn, likelihood):
    model = model_fn()
    model.output_size = C  # what Laplace.fit sets, needed by BackPACK's Jacobians
    return BackPackGGN(model, likelihood)


# ------------------------------------------- backend vs laplace-torch's backends
@pytest.mark.parametrize("likelihood", LIKELIHOODS)
def test_diag_full_kron_match_backpack_and_curvlinops(likelihood):
    X, y = data(likelihood)
    ours = CurvlibGGN(mlp(), likelihood)
    for method in ("diag", "full"):
        loss, H = getattr(ours, method)(X, y)
        ref_loss, ref_H = getattr(fresh_backpack(mlp, likelihood), method)(X, y)
        close(loss, ref_loss)
        close(H, ref_H)
    loss, kron = ours.kron(X, y, N=3 * N_DATA)  # a batch of a larger data set: A rescaled
    for ref in (fresh_backpack(mlp, likelihood), CurvlinopsGGN(mlp(), likelihood)):
        ref_loss, ref_kron = ref.kron(X, y, N=3 * N_DATA)
        close(loss, ref_loss)
        assert [len(F) for F in kron.kfacs] == [len(F) for F in ref_kron.kfacs] == [2, 1, 2, 1]
        for F, G in zip(kron.kfacs, ref_kron.kfacs):
            for a, b in zip(F, G):
                close(a, b)


@pytest.mark.parametrize("likelihood", LIKELIHOODS)
def test_jacobians_and_gradients_match_torch_func(likelihood):
    model = layernorm()
    X, y = data(likelihood)
    backend = CurvlibGGN(model, likelihood)
    Js, f = backend.jacobians(X)
    close(Js, brute_force_jacobians(model, X))
    close(f, model(X).detach())
    assert not Js.requires_grad and not f.requires_grad
    Gs, loss = backend.gradients(X, y)
    close(Gs, brute_force_grads(model, X, y, likelihood))
    close(loss, backend.lossfunc(model(X), y).detach())
    sel, _ = backend.selected_output_jacobians(X, y if likelihood == "classification" else torch.zeros(N_DATA, dtype=torch.long))
    close(sel, CurvatureInterface.selected_output_jacobians(backend, X, y if likelihood == "classification" else torch.zeros(N_DATA, dtype=torch.long))[0])


def test_jacobians_backprop_to_inputs():
    """With ``enable_backprop`` the Jacobians stay differentiable w.r.t. the input."""
    model = residual()
    X, _ = data("regression")
    backend = CurvlibGGN(model, "regression")
    Xa = X.clone().requires_grad_()
    Js, f = backend.jacobians(Xa, enable_backprop=True)
    (g,) = torch.autograd.grad((Js**2).sum() + f.sum(), Xa)
    Xb = X.clone().requires_grad_()
    Jr, fr = CurvatureInterface.jacobians(backend, Xb, enable_backprop=True)
    (gr,) = torch.autograd.grad((Jr**2).sum() + fr.sum(), Xb)
    close(g, gr)


@pytest.mark.parametrize("model_fn", [residual, layernorm], ids=["residual", "layernorm"])
@pytest.mark.parametrize("likelihood", LIKELIHOODS)
def test_curvature_matches_brute_force_ggn(model_fn, likelihood):
    model = model_fn()
    X, y = data(likelihood)
    backend = CurvlibGGN(model, likelihood)
    G = brute_force_ggn(model, X, y, likelihood)
    loss, H = backend.full(X, y)
    close(loss, FACTOR[likelihood] * backend.lossfunc(model(X), y).detach())
    close(H, G)
    close(backend.diag(X, y)[1], torch.diagonal(G))

    # Kron: per parameter, in model.parameters() order; Linear weights [B, A], Linear
    # biases [B] (= their exact GGN block), other 1-D parameters their exact block.
    _, kron = backend.kron(X, y, N=2 * N_DATA)
    inputs = linear_inputs(model, X)
    offsets = param_slices(model)
    mods = dict(model.named_modules())
    for (name, p), F in zip(model.named_parameters(), kron.kfacs):
        block = G[offsets[name], offsets[name]]
        mod_name, _, attr = name.rpartition(".")
        if isinstance(mods[mod_name], nn.Linear) and attr == "weight":
            B, A = F
            Bexact = G[offsets[mod_name + ".bias"], offsets[mod_name + ".bias"]].contiguous()
            x = inputs[mod_name]
            Aexact = x.T @ x / N_DATA * (N_DATA / (2 * N_DATA))  # batch mean, times M / N
            close(A * B[0, 0] / Bexact[0, 0], Aexact)  # laplace splits `factor` over both
            close(torch.kron(B, A), torch.kron(Bexact, Aexact))
        else:
            (B,) = F
            close(B, block)


@pytest.mark.parametrize("likelihood", LIKELIHOODS)
def test_empirical_fisher_matches_individual_gradients(likelihood):
    model = layernorm()
    X, y = data(likelihood)
    Gs = brute_force_grads(model, X, y, likelihood)
    backend = CurvlibEF(model, likelihood)
    loss, H = backend.full(X, y)
    close(H, FACTOR[likelihood] * Gs.T @ Gs)
    close(loss, FACTOR[likelihood] * backend.lossfunc(model(X), y).detach())
    loss_d, Hd = backend.diag(X, y)
    close(Hd, FACTOR[likelihood] * (Gs**2).sum(0))
    close(loss_d, loss)


# ------------------------------------------------------- Laplace end to end
@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
@pytest.mark.parametrize("likelihood", LIKELIHOODS)
def test_laplace_matches_backpack_backend(likelihood, structure):
    la = fitted(mlp, likelihood, structure, CurvlibGGN)
    ref = fitted(mlp, likelihood, structure, BackPackGGN)
    close(la.loss, ref.loss)
    compare_laplace(la, ref, likelihood)


@pytest.mark.parametrize("structure", ["kron", "full"])
def test_last_layer_laplace_matches_backpack_backend(structure):
    la = fitted(mlp, "classification", structure, CurvlibGGN, subset_of_weights="last_layer")
    ref = fitted(mlp, "classification", structure, BackPackGGN, subset_of_weights="last_layer")
    compare_laplace(la, ref, "classification")


class _FuncGGN(GGNInterface):
    """laplace-torch's own brute-force GGN (torch.func Jacobians), as a backend."""


@pytest.mark.parametrize("model_fn", [residual, layernorm], ids=["residual", "layernorm"])
@pytest.mark.parametrize("structure", ["diag", "full"])
@pytest.mark.parametrize("likelihood", LIKELIHOODS)
def test_laplace_on_graphs_backpack_cannot_handle(model_fn, likelihood, structure):
    la = fitted(model_fn, likelihood, structure, CurvlibGGN)
    ref = fitted(model_fn, likelihood, structure, _FuncGGN)
    compare_laplace(la, ref, likelihood)


@pytest.mark.parametrize("model_fn", [residual, layernorm], ids=["residual", "layernorm"])
def test_kron_laplace_on_graphs_backpack_cannot_handle(model_fn):
    la = fitted(model_fn, "classification", "kron", CurvlibGGN)
    la.optimize_prior_precision(pred_type="glm", method="marglik", n_steps=15)
    X, _ = data("classification", seed=5, n=6)
    probs = la(X, link_approx="probit")
    assert torch.isfinite(la.log_marginal_likelihood()).all()
    close(probs.sum(-1), torch.ones(6, dtype=DT))


@pytest.mark.skipif(not ON_CPU, reason="laplace-torch's SubnetLaplace accepts only a CPU torch.LongTensor of indices")
def test_subnetwork_laplace_matches_brute_force():

    idx = torch.tensor([0, 3, 7, 20, 30, 40, 43])
    la = Laplace(layernorm(), "regression", subset_of_weights="subnetwork",
                 hessian_structure="full", subnetwork_indices=idx, backend=CurvlibGGN)
    la.fit(loader("regression"))
    X, y = data("regression")
    G = brute_force_ggn(layernorm(), X, y, "regression")
    close(la.H, G[idx][:, idx])


@pytest.mark.parametrize("likelihood", LIKELIHOODS)
def test_stochastic_ggn_is_reproducible_and_unbiased(likelihood):
    model = mlp()
    X, y = data(likelihood)
    G = brute_force_ggn(model, X, y, likelihood)

    def backend(seed, samples):
        return CurvlibGGN(model, likelihood, stochastic=True, num_samples=samples,
                          generator=seeded(seed))

    close(backend(0, 3).diag(X, y)[1], backend(0, 3).diag(X, y)[1])
    H = backend(1, 4000).full(X, y)[1]
    assert (H - G).abs().max() < 0.08 * G.abs().max()
    d = backend(2, 4000).diag(X, y)[1]
    assert (d - torch.diagonal(G)).abs().max() < 0.08 * torch.diagonal(G).abs().max()
    _, kron = backend(3, 50).kron(X, y, N=N_DATA)
    assert [len(F) for F in kron.kfacs] == [2, 1, 2, 1]
    la = Laplace(mlp(), likelihood, "all", hessian_structure="kron", backend=CurvlibGGN,
                 backend_kwargs={"stochastic": True, "num_samples": 2})
    la.fit(loader(likelihood))
    assert torch.isfinite(la.log_marginal_likelihood())


def test_empirical_fisher_laplace():
    la = fitted(layernorm, "classification", "diag", CurvlibEF)
    ref_H = (brute_force_grads(layernorm(), *data("classification"), "classification") ** 2).sum(0)
    close(la.H, ref_H)
    la.optimize_prior_precision(pred_type="glm", method="marglik", n_steps=5)
    assert torch.isfinite(la.log_marginal_likelihood())


def test_refusals_are_clear():
    model = nn.Sequential(nn.Embedding(5, 3), nn.Flatten(), nn.Linear(6, C)).to(DT)
    X = torch.randint(0, 5, (4, 2))
    y = torch.randint(0, C, (4,))
    with pytest.raises(CurvatureError, match=r"'0\.weight'.*Embedding.*'diag' or 'full'"):
        CurvlibGGN(model, "classification").kron(X, y, N=4)
    backend = CurvlibGGN(mlp(), "classification")
    with pytest.raises(CurvatureTypeError, match=r"mapping or tuple of tensors.*got list"):
        backend.diag([torch.zeros(2, D_IN, dtype=DT)], y[:2])
    with pytest.raises(CurvatureError, match=r"class-index targets of shape \[N\] or class probabilities"):
        backend.diag(torch.zeros(4, D_IN, dtype=DT), torch.zeros(4, 2, dtype=torch.long))
    sub = CurvlibGGN(mlp(), "classification", subnetwork_indices=torch.tensor([0, 1]))
    with pytest.raises(CurvatureError, match="subnetwork"):
        sub.kron(torch.zeros(4, D_IN, dtype=DT), y, N=4)


def test_factor_conventions_documented():
    """The regression factor 1/2 turns MSELoss(sum) into the unit-variance Gaussian."""
    assert CurvlibGGN(mlp(), "regression").factor == 0.5
    assert math.isclose(CurvlibGGN(mlp(), "classification").factor, 1.0)
