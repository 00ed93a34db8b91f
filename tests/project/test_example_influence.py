"""``examples/influence.py`` against brute force on its tiny configuration.

Oracles, independent of curvlib's machinery: per-sample gradients from ``torch.func``
(``vmap(grad)``, float64), each factor's eigenvectors from ``torch.linalg.eigh`` in float64,
and the EK-FAC matrix of each parameter built densely,

    M_p = (Q_1 ⊗ Q_2) diag(s) (Q_1 ⊗ Q_2)ᵀ + λ I,   s = (1/N) Σ_i ((Q_1 ⊗ Q_2)ᵀ ĝ_i)²,

(``Q_k`` the eigenvectors of the k-th listed factor, the identity for a 1-D one: the
Kronecker product of the listed factors approximates the block of the parameter flattened
row-major), then solved with ``torch.linalg.solve``. The example's streamed eigenvalues and
its inverse-vector products must equal these; and on the same data its planted copies of
each query must be the two most influential training sequences.
"""

import os
import sys

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "examples"))

import influence  # noqa: E402


@pytest.fixture(autouse=True)
def _on_cpu():
    """A CPU script (its own CPU generators), whatever ``CURVLIB_TEST_DEVICE`` says."""
    with torch.device("cpu"):
        yield


@pytest.fixture(scope="module")
def tiny():
    """The tiny configuration trained once: data, model, EK-FAC pieces (on the CPU: a
    module fixture runs before the function-scoped ``_on_cpu``)."""
    cfg = influence.TINY
    with torch.device("cpu"):
        seqs, queries, planted = influence.make_data(cfg)
        model = influence.train(cfg, seqs)
        factors = influence.kfac_factors(model, seqs, 64, influence.VOCAB - 1,
                                         torch.Generator(device="cpu").manual_seed(0))
        eigenvalues = influence.fit_eigenvalues(model, factors, seqs, 64, torch.Generator(device="cpu").manual_seed(1))
    return dict(cfg=cfg, seqs=seqs, queries=queries, planted=planted, model=model, factors=factors,
                eigenvalues=eigenvalues)


def per_sample_grads(model, X, y):
    """``name -> [N, P]`` float64 gradients of each sequence's summed token loss (torch.func)."""
    twin = influence.copy.deepcopy(model).double().train()  # dropout 0: same function
    params = {n: p.detach() for n, p in twin.named_parameters()}

    def loss(ps, x, t):
        return nn.functional.cross_entropy(functional_call(twin, ps, (x[None],)), t[None], reduction="sum")

    with sdpa_kernel(SDPBackend.MATH):  # flash attention has no vmap rule on the CPU
        grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, X, y)
    return {n: g.flatten(1) for n, g in grads.items()}


def basis(factors):
    """``Q_1 ⊗ Q_2 ⊗ ...`` in float64, the identity for a 1-D (diagonal) factor."""
    q = torch.ones(1, 1, dtype=torch.float64)
    for f in factors:
        f = f.double()
        qf = torch.linalg.eigh(f)[1] if f.dim() == 2 else torch.eye(len(f), dtype=torch.float64)
        q = torch.kron(q, qf.contiguous())  # (kron refuses eigh's column-major output)
    return q


def in_parameter_order(values, factors):
    """EK-FAC eigenvalues (the core ``[G, o, a]``) flattened as the parameter is: a layout
    whose 1-D factor comes first (Embedding, ``pos``, a diagonal head side) keeps the
    parameter transposed in its core (``curvlib.precondition._kronbasis``'s table)."""
    if len(factors) == 2 and factors[0].dim() == 1 and factors[1].dim() == 2:
        return values.reshape(len(factors[1]), len(factors[0])).T.flatten()
    return values.flatten()


def sampled_rows(tiny):
    """The rows ``ĝ_i`` the example fits with: same generator, same batches, same draws."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    model, seqs = tiny["model"], tiny["seqs"]
    rows = []
    for start in range(0, len(seqs), 64):
        X, _ = influence.split(seqs[start:start + 64])
        rows.append(per_sample_grads(model, X, influence.sampled_targets(model, X, gen)))
    return {n: torch.cat([r[n] for r in rows]) for n in rows[0]}


def test_streamed_eigenvalues_and_inverse_vector_products_match_dense_ekfac(tiny):
    model, factors, s = tiny["model"], tiny["factors"], tiny["eigenvalues"]
    rows = sampled_rows(tiny)
    damping = influence.heuristic_damping(s)
    queries = influence.query_gradients(model, tiny["queries"])
    got = influence.preconditioned(factors, s, damping, queries, model)
    b = per_sample_grads(model, *influence.split(tiny["queries"]))
    assert (1 <= sum(f.dim() == 1 for fs in factors.values() for f in fs)), "a diagonal factor is exercised"
    assert [f.dim() for f in factors["head.weight"]] == [1, 2]  # max_factor_dim: the vocabulary side
    for name, g in rows.items():
        q = basis(factors[name])
        s_dense = ((g @ q) ** 2).mean(0)  # (1/N) Σ_i (Qᵀ ĝ_i)²
        torch.testing.assert_close(in_parameter_order(s[name], factors[name]).double(), s_dense, rtol=1e-3,
                                   atol=1e-6 * float(s_dense.max()), msg=name)
        dense = q @ torch.diag(s_dense) @ q.T + damping * torch.eye(len(q), dtype=torch.float64)
        want = torch.linalg.solve(dense, b[name].T).T
        torch.testing.assert_close(got[name].flatten(1).double(), want, rtol=2e-3,
                                   atol=2e-4 * float(want.abs().max()), msg=name)


def test_planted_copies_rank_first_and_second(tiny):
    scores, _, _, _ = influence.ekfac_influence(tiny["model"], tiny["seqs"], tiny["queries"])
    ranks = influence.planted_ranks(scores, tiny["planted"])
    assert all(sorted(r) == [1, 2] for r in ranks.tolist()), ranks
    # the rank helper against a plain argsort
    order = scores[0].argsort(descending=True)
    assert order[ranks[0, 0] - 1] == tiny["planted"][0, 0]


def test_spearman_helper():
    a = torch.tensor([0.1, 0.5, 0.3, 0.9])
    assert influence.spearman(a, a) == pytest.approx(1.0)
    assert influence.spearman(a, -a) == pytest.approx(-1.0)
    assert influence.spearman(a, torch.tensor([1.0, 2.0, 4.0, 3.0])) == pytest.approx(0.4)
