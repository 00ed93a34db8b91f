"""curvlib's laplace-torch backends: empirical-Fisher Kron, mapping and tuple inputs,
soft labels, and models that another library has put hooks on.

(the core's ``KFACEmpirical``, mappings and tuples as ``X``, class-probability
targets for ``CrossEntropyLoss``, modules judged by their class, not their hooks),
against laplace-torch's curvlinops/BackPACK backends and brute force.
"""

from __future__ import annotations

from collections import UserDict

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from oracles.on_device import seeded

pytest.importorskip(
    "laplace",
    reason="optional dependency laplace-torch is not installed "
    "(pip install --no-deps laplace-torch==0.3 and its requirements)",
)

from laplace.curvature import BackPackGGN, CurvlinopsEF, CurvlinopsGGN

from curvlib import CurvatureError
from curvlib.laplace import CurvlibEF, CurvlibGGN
from oracles.laplace_torch import (
    C,
    D_IN,
    DT,
    FACTOR,
    LIKELIHOODS,
    N_DATA,
    brute_force_ef_kron,
    brute_force_ggn,
    brute_force_grads,
    close,
    compare_laplace,
    data,
    fitted,
    layernorm,
    mlp,
    param_slices,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:Full backward hook:UserWarning",
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning",
    "ignore:By default `link_approx`:UserWarning",
)


class DictModel(nn.Module):
    """Hugging Face style: the whole batch mapping as one argument."""

    def __init__(self, seed=0):
        super().__init__()
        self.net = mlp(seed)

    def forward(self, batch):
        return self.net(batch["input_ids"])


class TupleModel(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        self.net = mlp(seed)

    def forward(self, parts):
        a, b = parts
        return self.net(torch.cat([a, b], dim=1))


def same_kron(kron, ref, tol=1e-10):
    assert [len(F) for F in kron.kfacs] == [len(F) for F in ref.kfacs]
    close(kron.to_matrix(), ref.to_matrix(), tol)


# ------------------------------------------------- empirical-Fisher Kron
@pytest.mark.parametrize("likelihood", LIKELIHOODS)
def test_ef_kron_matches_curvlinops_and_brute_force(likelihood):
    X, y = data(likelihood)
    loss, kron = CurvlibEF(mlp(), likelihood).kron(X, y, N=3 * N_DATA)
    ref_loss, ref = CurvlinopsEF(mlp(), likelihood).kron(X, y, N=3 * N_DATA)
    close(loss, ref_loss)
    same_kron(kron, ref)
    for F, G in zip(kron.kfacs, brute_force_ef_kron(mlp(), X, y, likelihood, 3 * N_DATA)):
        close(torch.kron(*F) if len(F) == 2 else F[0], torch.kron(*G) if len(G) == 2 else G[0])


def test_ef_kron_dense_blocks_of_other_layers():
    """LayerNorm's parameters get their exact empirical-Fisher block."""
    model, (X, y) = layernorm(), data("regression")
    _, kron = CurvlibEF(model, "regression").kron(X, y, N=N_DATA)
    G, sl = brute_force_grads(model, X, y, "regression"), param_slices(model)
    linear = iter(brute_force_ef_kron(model, X, y, "regression", N_DATA))
    for (name, _), F in zip(model.named_parameters(), kron.kfacs):
        if name.startswith("1."):  # LayerNorm
            g = G[:, sl[name]]
            close(F[0], FACTOR["regression"] * g.T @ g)
        else:
            ref = next(linear)
            close(torch.kron(*F) if len(F) == 2 else F[0], torch.kron(*ref) if len(ref) == 2 else ref[0])


@pytest.mark.parametrize("likelihood", LIKELIHOODS)
def test_ef_kron_laplace_matches_curvlinops(likelihood):
    la = fitted(mlp, likelihood, "kron", CurvlibEF)
    ref = fitted(mlp, likelihood, "kron", CurvlinopsEF)
    compare_laplace(la, ref, likelihood)


# ------------------------------------------------- mapping and tuple inputs
def _all_methods(backend, X, y):
    out = {"diag": backend.diag(X, y)[1], "full": backend.full(X, y)[1],
           "grads": backend.gradients(X, y)[0], "loss": backend.diag(X, y)[0]}
    out["kron"] = backend.kron(X, y, N=2 * N_DATA)[1].to_matrix()
    if isinstance(backend, CurvlibGGN):
        out["jac"] = backend.jacobians(X)[0]
    return out


@pytest.mark.parametrize("backend_cls", [CurvlibGGN, CurvlibEF])
@pytest.mark.parametrize("likelihood", LIKELIHOODS)
def test_mapping_inputs_match_tensor_inputs(likelihood, backend_cls):
    X, y = data(likelihood)
    batch = UserDict(input_ids=X, labels=y)  # laplace passes the whole batch, labels included
    ours = _all_methods(backend_cls(DictModel(), likelihood, dict_key_x="input_ids"), batch, y)
    ref = _all_methods(backend_cls(mlp(), likelihood), X, y)
    for key in ref:
        close(ours[key], ref[key])


def test_tuple_inputs_match_tensor_inputs():
    X, y = data("classification")
    ours = _all_methods(CurvlibGGN(TupleModel(), "classification"), (X[:, :1], X[:, 1:]), y)
    ref = _all_methods(CurvlibGGN(mlp(), "classification"), X, y)
    for key in ref:
        close(ours[key], ref[key])


def dict_loader(likelihood):
    X, y = data(likelihood)
    rows = [{"input_ids": X[i], "labels": y[i]} for i in range(len(X))]
    return DataLoader(rows, batch_size=5, collate_fn=lambda b: UserDict(torch.utils.data.default_collate(b)))


@pytest.mark.parametrize("structure", ["diag", "kron"])
@pytest.mark.parametrize("likelihood", LIKELIHOODS)
def test_mapping_inputs_through_laplace(likelihood, structure):
    kw = {"dict_key_x": "input_ids", "dict_key_y": "labels", "loader_fn": dict_loader}
    la = fitted(DictModel, likelihood, structure, CurvlibGGN, **kw)
    ref = fitted(DictModel, likelihood, structure, CurvlinopsGGN, **kw)
    close(la.H.to_matrix() if structure == "kron" else la.H,
          ref.H.to_matrix() if structure == "kron" else ref.H, 1e-9)
    close(la.log_marginal_likelihood(), ref.log_marginal_likelihood(), 1e-9)
    batch = next(iter(dict_loader(likelihood)))
    pred, ref_pred = la(batch, pred_type="glm"), ref(batch, pred_type="glm")
    for a, b in zip(pred if likelihood == "regression" else [pred],
                    ref_pred if likelihood == "regression" else [ref_pred]):
        close(a, b, 1e-8)


# ---------------------------------------------------------------- soft labels
def test_soft_labels_match_brute_force():
    """The logit Hessian of the cross-entropy does not depend on the targets: the GGN of
    soft labels is the GGN of hard ones; the gradients follow the probabilities."""
    X, y = data("classification")
    probs = torch.softmax(torch.randn(N_DATA, C, dtype=DT, generator=seeded(3)), 1)
    ggn = CurvlibGGN(mlp(), "classification")
    G = brute_force_ggn(mlp(), X, y, "classification")
    close(ggn.full(X, probs)[1], G)
    close(ggn.diag(X, probs)[1], torch.diagonal(G))
    same_kron(ggn.kron(X, probs, N=N_DATA)[1], ggn.kron(X, y, N=N_DATA)[1])
    grads = brute_force_grads(mlp(), X, probs, "classification")
    close(ggn.gradients(X, probs)[0], grads)
    close(CurvlibEF(mlp(), "classification").full(X, probs)[1], grads.T @ grads)
    close(ggn.diag(X, probs)[0], nn.functional.cross_entropy(mlp()(X), probs, reduction="sum").detach())


# ------------------------------------------------------------------- hooks
@pytest.mark.parametrize("likelihood", LIKELIHOODS)
def test_kron_after_backpack_extended_the_model(likelihood):
    """BackPACK's backend leaves hooks on the model; curvlib's factors are unchanged."""
    X, y = data(likelihood)
    model = mlp()
    model.output_size = C
    BackPackGGN(model, likelihood).kron(X, y, N=N_DATA)
    assert model[0]._forward_hooks  # BackPACK's
    same_kron(CurvlibGGN(model, likelihood).kron(X, y, N=N_DATA)[1],
              CurvlibGGN(mlp(), likelihood).kron(X, y, N=N_DATA)[1])


def test_targets_are_checked():
    X, _ = data("classification")
    backend = CurvlibGGN(mlp(), "classification")
    with pytest.raises(CurvatureError, match=r"class probabilities of shape \[N, C\].*shape \(12, 4\) "
                       r"and dtype torch.int64"):
        backend.diag(X, torch.zeros(N_DATA, C, dtype=torch.long))
    with pytest.raises(CurvatureError, match=r"got targets of shape \(12, 1, 4\)"):
        backend.full(X, torch.zeros(N_DATA, 1, C, dtype=DT))
    assert D_IN == X.shape[1]
