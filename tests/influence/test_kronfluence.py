"""``curvlib.influence`` side by side with kronfluence 1.0 (float64 throughout), where the
definitions agree: each example's loss summed over its positions, the empirical Fisher
(kronfluence's ``use_empirical_fisher=True``; Monte-Carlo labels differ by their draws), bias-free
Linear layers (kronfluence puts a bias in its weight's Kronecker block), its heuristic or a fixed
damping, full-SVD low-rank queries.

* An MLP on scikit-learn's digits: every strategy's pairwise and self-influence scores equal.
* A small transformer of bias-free Linear layers (kronfluence tracks only those; curvlib gets
  them as ``params``): identity, diagonal and EK-FAC equal; KFAC is the documented difference,
  kronfluence's factors being both means over the ``T`` positions: its scores are ``T`` times
  curvlib's under the heuristic damping (``T (S + λ)⁻¹ = (S/T + λ/T)⁻¹``).
"""

import pytest
import torch
from torch import nn

from curvlib import influence
from oracles.models import TinyCausalLM

kronfluence = pytest.importorskip("kronfluence")
from oracles.kronfluence_peer import kronfluence_scores  # noqa: E402

DT = torch.float64


def _relative(a, b):
    a, b = a.detach().cpu().double(), b.detach().cpu().double()  # (kronfluence's scores: on the CPU)
    return float((a - b).abs().max() / b.abs().max())


def _digits(n_train, n_query):
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    X = torch.tensor(digits.data / 16.0, dtype=DT)
    y = torch.tensor(digits.target)
    return (X[:n_train], y[:n_train]), (X[n_train:n_train + n_query], y[n_train:n_train + n_query])


def _train_briefly(model, X, y, steps=30):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        opt.step()
    for p in model.parameters():
        p.grad = None
    return model


@pytest.mark.parametrize("strategy", influence.STRATEGIES)
@pytest.mark.parametrize("damping, rank", [(None, None), (1e-3, None), (None, 3)])
def test_an_mlp_on_digits_scores_as_kronfluence(strategy, damping, rank, tmp_path):
    (X, y), queries = _digits(96, 4)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 12, bias=False), nn.Tanh(), nn.Linear(12, 10, bias=False)).to(DT)
    _train_briefly(model, X, y)
    peer = kronfluence_scores(model, (X, y), queries, str(tmp_path), strategy=strategy, damping=damping,
                              query_rank=rank, batch_size=32)
    train = [(X[i:i + 32], y[i:i + 32]) for i in range(0, 96, 32)]
    lossfn = nn.CrossEntropyLoss()
    factors = influence.fit(model, lossfn, train, strategy=strategy, fisher_type="empirical")
    got = influence.scores(model, lossfn, factors, queries, train, damping=damping, query_rank=rank)
    assert _relative(got, peer["pairwise"]) < 1e-6
    assert _relative(influence.self_influence(model, lossfn, factors, train, damping=damping), peer["self"]) < 1e-6


class _Logits(nn.Module):
    """``[N, T, V]`` -> ``[N, V, T]``, as ``nn.CrossEntropyLoss`` takes a sequence's logits."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, ids):
        return self.inner(ids).transpose(1, 2)


@pytest.mark.parametrize("strategy", influence.STRATEGIES)
def test_a_transformer_of_linear_layers_scores_as_kronfluence(strategy, tmp_path):
    torch.manual_seed(0)
    T, V = 5, 11
    lm = TinyCausalLM(vocab=V, d=8, length=T).to(DT)
    gen = torch.Generator(device="cpu").manual_seed(0)
    X, y = torch.randint(0, V, (16, T), generator=gen), torch.randint(0, V, (16, T), generator=gen)
    queries = (torch.randint(0, V, (3, T), generator=gen), torch.randint(0, V, (3, T), generator=gen))
    tracked = [n for n, m in lm.named_modules() if isinstance(m, nn.Linear)]
    peer = kronfluence_scores(lm, (X, y), queries, str(tmp_path), strategy=strategy, tracked=tracked)
    model, lossfn = _Logits(lm), nn.CrossEntropyLoss()
    linear = {f"inner.{n}.weight": lm.get_submodule(n).weight for n in tracked}
    train = [(X[:8], y[:8]), (X[8:], y[8:])]
    factors = influence.fit(model, lossfn, train, strategy=strategy, fisher_type="empirical", params=linear)
    got = influence.scores(model, lossfn, factors, queries, train, params=linear)
    self_got = influence.self_influence(model, lossfn, factors, train, params=linear)
    scale = T if strategy == "kfac" else 1
    assert _relative(scale * got, peer["pairwise"]) < 1e-6
    assert _relative(scale * self_got, peer["self"]) < 1e-6
