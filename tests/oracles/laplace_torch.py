"""Models, data and brute-force oracles for the laplace-torch backend tests.

Plain ``torch.func`` (laplace-torch is imported only inside :func:`fitted`):
per-sample Jacobians and gradients, the GGN and the empirical Fisher's Kronecker
factors, and end-to-end comparisons of two fitted Laplace approximations.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from oracles.on_device import seeded

DT = torch.float64
N_DATA, D_IN, C = 12, 3, 4


# ----------------------------------------------------------------- models
def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, 5), nn.Tanh(), nn.Linear(5, C)).to(DT)


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, 5)
        self.block = nn.Linear(5, 5)
        self.out = nn.Linear(5, C)

    def forward(self, x):
        h = self.inp(x)
        h = h + self.block(torch.tanh(h))
        return self.out(torch.tanh(h))


def residual(seed=0):
    torch.manual_seed(seed)
    return Residual().to(DT)


def layernorm(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(D_IN, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, C)).to(DT)
    with torch.no_grad():  # non-trivial affine parameters
        model[1].weight.add_(0.3 * torch.randn(5, dtype=DT))
        model[1].bias.add_(0.3 * torch.randn(5, dtype=DT))
    return model


def data(likelihood, seed=1, n=N_DATA):
    g = seeded(seed)
    X = torch.randn(n, D_IN, generator=g, dtype=DT)
    if likelihood == "classification":
        y = torch.randint(0, C, (n,), generator=g)
    else:
        y = torch.randn(n, C, generator=g, dtype=DT)
    return X, y


def loader(likelihood, batch_size=5):
    X, y = data(likelihood)
    return DataLoader(TensorDataset(X, y), batch_size=batch_size)


LIKELIHOODS = ["classification", "regression"]
FACTOR = {"classification": 1.0, "regression": 0.5}


# ------------------------------------------------------------- oracles
def flat_params(model):
    return {k: v.detach() for k, v in model.named_parameters()}


def brute_force_jacobians(model, X):
    """``[N, C, P]`` per-sample Jacobians from torch.func, in ``named_parameters`` order."""
    params = flat_params(model)

    def out(p, x):
        return torch.func.functional_call(model, p, (x[None],))[0]

    J = torch.func.vmap(torch.func.jacrev(out), in_dims=(None, 0))(params, X)
    return torch.cat([j.reshape(X.shape[0], C, -1) for j in J.values()], -1)


def brute_force_ggn(model, X, y, likelihood):
    """``factor * Σ_n J_nᵀ ∇²ℓ_n J_n`` with laplace's sum-reduced losses."""
    J = brute_force_jacobians(model, X)
    f = model(X).detach()
    if likelihood == "classification":
        def loss(fn, yn):
            return nn.functional.cross_entropy(fn[None], yn[None], reduction="sum")
    else:
        def loss(fn, yn):
            return ((fn - yn) ** 2).sum()
    Lam = torch.func.vmap(torch.func.hessian(loss))(f, y)  # [N, C, C]
    return FACTOR[likelihood] * torch.einsum("ncp,ncd,ndq->pq", J, Lam, J)


def brute_force_grads(model, X, y, likelihood):
    """Individual gradients ``[N, P]`` of laplace's sum-reduced loss."""
    params = flat_params(model)
    lossfn = nn.CrossEntropyLoss(reduction="sum") if likelihood == "classification" else nn.MSELoss(reduction="sum")

    def loss(p, x, t):
        return lossfn(torch.func.functional_call(model, p, (x[None],)), t[None])

    G = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, X, y)
    return torch.cat([g.reshape(X.shape[0], -1) for g in G.values()], -1)


def close(a, b, tol=1e-10):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)



def fitted(model_fn, likelihood, structure, backend, loader_fn=None, **kwargs):
    """``Laplace(...)`` of a fresh ``model_fn()`` fitted on ``loader_fn(likelihood)``."""
    from laplace import Laplace

    kwargs.setdefault("subset_of_weights", "all")
    la = Laplace(model_fn(), likelihood, hessian_structure=structure, backend=backend, **kwargs)
    la.fit((loader_fn or loader)(likelihood))
    return la


def compare_laplace(la, ref, likelihood, tol=1e-9):
    """Same log marginal likelihood, prior optimisation and predictive."""
    for prior in (0.3, torch.tensor(2.0, dtype=DT)):
        kw = {"sigma_noise": torch.tensor(0.7, dtype=DT)} if likelihood == "regression" else {}
        close(la.log_marginal_likelihood(prior, **kw), ref.log_marginal_likelihood(prior, **kw), tol)
    for a in (la, ref):
        a.optimize_prior_precision(pred_type="glm", method="marglik", n_steps=15)
    close(la.prior_precision, ref.prior_precision, 1e-7)
    X, _ = data(likelihood, seed=5, n=6)
    if likelihood == "classification":
        close(la(X, link_approx="probit"), ref(X, link_approx="probit"), 1e-7)
    else:
        for a, b in zip(la(X), ref(X)):
            close(a, b, 1e-7)




def linear_inputs(model, X):
    """``{module name: input}`` of every ``nn.Linear`` in ``model`` for ``X`` (hooks removed after)."""
    inputs = {}
    hooks = [
        m.register_forward_hook(lambda m, i, o, name=name: inputs.__setitem__(name, i[0].detach()))
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
    ]
    try:
        model(X)
    finally:
        for h in hooks:
            h.remove()
    return inputs


def param_slices(model):
    """``{name: slice}`` of every parameter in the flattened parameter vector."""
    offsets, start = {}, 0
    for name, p in model.named_parameters():
        offsets[name] = slice(start, start + p.numel())
        start += p.numel()
    return offsets


def brute_force_ef_kron(model, X, y, likelihood, N):
    """laplace's empirical-Fisher Kron of an MLP of biased Linear layers: ``[[B, A], [B], ...]``.

    ``B = factor * Σ_n g_n g_nᵀ`` with ``g_n`` the individual gradient of the bias (the
    loss gradient at the layer's output) and ``A = (1/M) Σ_n x_n x_nᵀ * M/N``. laplace
    multiplies the whole Kron by ``factor``, i.e. each factor of a pair by ``√factor``;
    compare ``torch.kron(B, A)``.
    """
    G = brute_force_grads(model, X, y, likelihood)
    sl = param_slices(model)
    inputs = linear_inputs(model, X)
    out = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            g = G[:, sl[f"{name}.bias"]]
            B = FACTOR[likelihood] * g.T @ g
            x = inputs[name]
            out += [[B, x.T @ x / N], [B]]
    return out
