"""``examples/influence.py``: its exact reference against a dense solve, and its checks.

The example fits and scores through ``curvlib.influence`` (tested against dense influence in
``tests/influence``); what is its own is the exact damped-GGN reference (``cg`` on ``GGN``
products, preconditioned by ``EKFAC``), the planted-copies check and the helpers. The oracle
here, independent of curvlib: on a micro configuration, the dense GGN of the whole model from
``torch.func`` (each sequence's logit Jacobian ``J_n``, float64),

    G = (1/N) Σ_n Σ_t J_ntᵀ (diag(p_nt) − p_nt p_ntᵀ) J_nt,

and the scores ``g_qᵀ (G + λ I)⁻¹ g_n`` by ``torch.linalg.solve``.
"""

import os
import sys

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from oracles.on_device import ON_CPU

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "examples"))

import influence  # noqa: E402

MICRO = influence.Config(d=4, layers=1, hidden=8, length=6, n_train=16, n_queries=2, steps=30)


@pytest.fixture(autouse=True)
def _on_cpu():
    """A CPU script (its own CPU generators), whatever ``CURVLIB_TEST_DEVICE`` says."""
    with torch.device("cpu"):
        yield


def trained(cfg):
    with torch.device("cpu"):
        seqs, queries, planted = influence.make_data(cfg)
        return seqs, queries, planted, influence.train(cfg, seqs)


@pytest.fixture(scope="module")
def micro():
    return trained(MICRO)


def dense_influence(model, seqs, queries, damping):
    """``[Q, N]`` from the dense GGN and per-sequence gradients, float64 (module doc)."""
    twin = influence.copy.deepcopy(model).double().train()  # dropout 0: the same function
    params = {n: p.detach() for n, p in twin.named_parameters()}
    names = list(params)

    def logits(flat, x):  # [V, T] for one sequence
        shaped, offset = {}, 0
        for n in names:
            shaped[n] = flat[offset:offset + params[n].numel()].view_as(params[n])
            offset += params[n].numel()
        return functional_call(twin, shaped, (x[None],))[0]

    flat = torch.cat([params[n].reshape(-1) for n in names])
    X, _ = influence.split(seqs)
    G = torch.zeros(len(flat), len(flat), dtype=torch.float64)
    with sdpa_kernel(SDPBackend.MATH):  # flash attention has no vmap rule on the CPU
        for x in X:
            J = jacrev(logits)(flat, x).transpose(0, 1)            # [T, V, P]
            p = logits(flat, x).softmax(0).T.detach()               # [T, V]
            HJ = p[..., None] * (J - torch.einsum("tv,tvp->tp", p, J)[:, None])
            G += torch.einsum("tvp,tvq->pq", J, HJ)

        def loss(w, x, t):
            return nn.functional.cross_entropy(logits(w, x)[None], t[None], reduction="sum")

        per = vmap(grad(loss), in_dims=(None, 0, 0))
        g_train, g_query = per(flat, *influence.split(seqs)), per(flat, *influence.split(queries))
    G /= len(seqs)
    x = torch.linalg.solve(G + damping * torch.eye(len(flat), dtype=torch.float64), g_query.T)
    return x.T @ g_train.T


def test_exact_influence_matches_a_dense_solve(micro):
    seqs, queries, _, model = micro
    damping = influence.global_damping(influence.fit(model, seqs, "ekfac", 0))
    got, residual = influence.exact_influence(model, seqs, queries, damping, iters=200, seed=0)
    want = dense_influence(model, seqs, queries, damping)
    assert residual < (1e-4 if ON_CPU else 2e-4)  # (CUDA's float32 products round differently)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_vocabulary_sides_are_diagonal_and_the_rest_dense(micro):
    seqs, _, _, model = micro
    blocks = influence.fit(model, seqs, "ekfac", 0)["blocks"]
    sides = {n: [q.shape[-1] for q in (b["q_out"], b["q_in"]) if q is not None] for n, b in blocks.items()}
    assert all(max(s, default=0) <= influence.MAX_FACTOR_DIM for s in sides.values()), sides
    assert sides["head.weight"] == [MICRO.d] and sides["embed.weight"] == [MICRO.d]  # the 128 side: diagonal
    assert sides["blocks.layers.0.linear1.weight"] == [MICRO.hidden, MICRO.d]          # both sides dense


def test_planted_copies_rank_first_and_second():
    seqs, queries, planted, model = trained(influence.TINY)
    scores = influence.score(model, influence.fit(model, seqs, "ekfac", 0), seqs, queries)
    ranks = influence.planted_ranks(scores, planted)
    assert all(sorted(r) == [1, 2] for r in ranks.tolist()), ranks
    assert influence.copy_margin(scores, planted) > 1
    # the rank helper against a plain argsort
    order = scores[0].argsort(descending=True)
    assert order[ranks[0, 0] - 1] == planted[0, 0]


def test_spearman_helper():
    a = torch.tensor([0.1, 0.5, 0.3, 0.9])
    assert influence.spearman(a, a) == pytest.approx(1.0)
    assert influence.spearman(a, -a) == pytest.approx(-1.0)
    assert influence.spearman(a, torch.tensor([1.0, 2.0, 4.0, 3.0])) == pytest.approx(0.4)
