"""examples/pruning.py: OBD saliencies against a brute-force diagonal, and the masks' bookkeeping.

Oracle (float64): the Hessian of the loss w.r.t. the flattened parameters by
``torch.func.hessian``; the GGN as ``Jᵀ (∇²_f L) J`` with ``J`` from ``jacrev``.
"""

import os
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.func import functional_call, hessian, jacrev

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
import pruning  # noqa: E402


@pytest.fixture(autouse=True)
def _on_cpu():
    with torch.device("cpu"):
        yield


def brute_force_diagonals(model, X, y):
    names = [k for k, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])

    def unflatten(v):
        return dict(zip(names, [t.view(s) for t, s in zip(v.split([s.numel() for s in shapes]), shapes)]))

    def out(v):
        return functional_call(model, unflatten(v), (X,))

    H = hessian(lambda v: nn.functional.cross_entropy(out(v), y))(flat)
    J = jacrev(out)(flat).flatten(0, 1)  # [N*C, P]
    H_f = hessian(lambda f: nn.functional.cross_entropy(f.view(len(X), -1), y))(out(flat).detach().flatten())
    G = J.T @ H_f @ J
    return unflatten(torch.diagonal(H)), unflatten(torch.diagonal(G))


@settings(max_examples=8, deadline=None)
@given(n=st.integers(1, 6), hidden=st.integers(1, 4), seed=st.integers(0, 1000))
def test_saliencies_match_brute_force(n, hidden, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, hidden), nn.Tanh(), nn.Linear(hidden, 4)).double()
    X, y = torch.randn(n, 3, dtype=torch.float64), torch.randint(0, 4, (n,))
    got = pruning.saliencies(model, nn.CrossEntropyLoss(), X, y)
    diag_h, diag_g = brute_force_diagonals(model, X, y)
    params = dict(model.named_parameters())
    for label, diag in (("OBD (Hessian)", diag_h), ("OBD (GGN)", diag_g)):
        want = {k: 0.5 * params[k].detach() ** 2 * d for k, d in diag.items()}
        scale = max(float(w.abs().max()) for w in want.values())
        for k in want:
            assert float((got[label][k] - want[k]).abs().max()) <= 1e-10 * scale + 1e-300, (label, k)
    assert all(torch.equal(got["magnitude"][k], p.detach().abs()) for k, p in params.items())


def test_hessian_and_ggn_saliencies_differ():
    """A Tanh net: the Hessian's residual term makes the two OBD scores differ (the test can tell them apart)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    X, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 4, (5,))
    got = pruning.saliencies(model, nn.CrossEntropyLoss(), X, y)
    assert not torch.allclose(got["OBD (Hessian)"]["0.weight"], got["OBD (GGN)"]["0.weight"])


def test_masks_remove_exactly_the_lowest_and_keep_earlier_rounds():
    scores = {"a.weight": torch.tensor([[3.0, -1.0], [2.0, 5.0]]), "a.bias": torch.tensor([0.0, 0.0]),
              "b.weight": torch.tensor([4.0, 0.5, 6.0])}
    m = pruning.prune_masks(scores, 0.4)  # 7 weights -> 3 go: -1, 0.5, 2
    assert set(m) == {"a.weight", "b.weight"}
    assert m["a.weight"].tolist() == [[True, False], [False, True]] and m["b.weight"].tolist() == [True, False, True]
    rescored = {"a.weight": torch.tensor([[3.0, 9.0], [9.0, 5.0]]), "b.weight": torch.tensor([4.0, 9.0, 1.0])}
    m2 = pruning.prune_masks(rescored, 4 / 7, m)  # earlier 3 stay out whatever their new score, then 1.0
    assert m2["a.weight"].tolist() == [[True, False], [False, True]] and m2["b.weight"].tolist() == [True, False, False]
