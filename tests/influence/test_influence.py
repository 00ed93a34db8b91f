"""``curvlib.influence`` against dense float64 influence written out with ``torch.func``
(:mod:`oracles.influence`): every strategy and deterministic Fisher type, both reductions, CE
and MSE, loaders of unequal batches, parameter subsets, heuristic and fixed damping, low-rank
queries, self-influence; Monte-Carlo fits by their mean; saving; refusals."""

import io

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import CurvatureError, CurvatureTypeError, influence
from curvlib.operators.data import parameter_groups
from oracles import influence as oracle
from oracles.models import tiny_gpt2
from oracles.on_device import seeded

DT = torch.float64


def _mlp(sizes, seed, bias=True):
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers += [nn.Linear(a, b, bias=bias)] + ([nn.Tanh()] if i < len(sizes) - 2 else [])
    return nn.Sequential(*layers).to(DT)


def _data(loss, n, n_in, n_out, gen):
    X = torch.randn(n, n_in, dtype=DT, generator=gen)
    y = torch.randint(0, n_out, (n,), generator=gen) if loss == "ce" else torch.randn(n, n_out, dtype=DT, generator=gen)
    return X, y


def _lossfn(loss, reduction):
    return (nn.CrossEntropyLoss if loss == "ce" else nn.MSELoss)(reduction=reduction)


def _split(X, y, sizes):
    out, start = [], 0
    for s in sizes:
        out.append((X[start:start + s], y[start:start + s]))
        start += s
    return out


@settings(max_examples=12)
@given(strategy=st.sampled_from(influence.STRATEGIES), fisher_type=st.sampled_from(["exact", "empirical"]),
       loss=st.sampled_from(["ce", "mse"]), reduction=st.sampled_from(["mean", "sum"]),
       bias=st.booleans(), heuristic=st.booleans(), seed=st.integers(0, 10_000))
def test_scores_and_self_influence_equal_dense_influence(strategy, fisher_type, loss, reduction, bias, heuristic, seed):
    gen = seeded(seed)
    model, lossfn = _mlp([3, 4, 3], seed, bias), _lossfn(loss, reduction)
    X, y = _data(loss, 14, 3, 3, gen)
    Xq, yq = _data(loss, 3, 3, 3, gen)
    train = _split(X, y, [5, 9])  # unequal batches: the reduction's weights matter
    factors = influence.fit(model, lossfn, train, strategy=strategy, fisher_type=fisher_type)

    problem = oracle.Problem(model, lossfn, X, y)
    S = oracle.strategy_matrix(problem, strategy, fisher_type)
    if strategy == "identity":
        dampings, damping = [0.0] * len(problem.sizes), None
    elif heuristic:
        dampings, damping = oracle.heuristic_dampings(problem, S), None
    else:
        damping = 0.05
        dampings = [damping] * len(problem.sizes)
    gq, gn = problem.gradients(Xq, yq), problem.gradients()

    got = influence.scores(model, lossfn, factors, (Xq, yq), train, damping=damping)
    torch.testing.assert_close(got, oracle.scores(problem, S, dampings, gq, gn), rtol=1e-7, atol=1e-9)
    self_got = influence.self_influence(model, lossfn, factors, train, damping=damping)
    torch.testing.assert_close(self_got, oracle.self_scores(problem, S, dampings, gn), rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("strategy", ["diagonal", "kfac", "ekfac"])
def test_a_parameter_subset_is_influence_over_those_parameters(strategy):
    gen = seeded(3)
    model, lossfn = _mlp([3, 5, 3], 3), nn.CrossEntropyLoss()
    X, y = _data("ce", 16, 3, 3, gen)
    Xq, yq = _data("ce", 2, 3, 3, gen)
    subset = {n: p for n, p in model.named_parameters() if n.startswith("2.")}
    factors = influence.fit(model, lossfn, (X, y), strategy=strategy, fisher_type="exact", params=subset)
    assert set(factors["blocks"]) == {"2.weight", "2.bias"}
    problem = oracle.Problem(model, lossfn, X, y, params=subset)
    S = oracle.strategy_matrix(problem, strategy, "exact")
    want = oracle.scores(problem, S, [0.1, 0.1], problem.gradients(Xq, yq), problem.gradients())
    got = influence.scores(model, lossfn, factors, (Xq, yq), (X, y), damping=0.1, params=subset)
    torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)


def test_sequences_take_each_examples_summed_loss():
    """Positions share the weights: each example's gradient is its tokens' summed loss's, and
    EK-FAC's spectrum is ``(1/N) Σ_n (Qᵀ g_n)²`` in the fitted basis."""
    gen = seeded(5)
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT)

    class Tokens(nn.Module):  # [N, T, D] -> [N, C, T], as a language model's logits
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x).transpose(1, 2)

    wrapped, lossfn = Tokens(model), nn.CrossEntropyLoss()
    X, y = torch.randn(6, 4, 3, dtype=DT, generator=gen), torch.randint(0, 3, (6, 4), generator=gen)
    factors = influence.fit(wrapped, lossfn, [(X[:2], y[:2]), (X[2:], y[2:])], strategy="ekfac", fisher_type="empirical")
    per_example = torch.stack([
        torch.cat([g.reshape(-1) for g in torch.autograd.grad(
            nn.CrossEntropyLoss(reduction="sum")(wrapped(x[None]), t[None]), list(wrapped.parameters()))])
        for x, t in zip(X, y)])
    block = factors["blocks"]["inner.0.weight"]
    Q = torch.kron(block["q_out"][0], block["q_in"][0])
    g = per_example[:, :12]  # inner.0.weight [4, 3], row-major
    torch.testing.assert_close(block["spectrum"].reshape(-1), ((g @ Q) ** 2).mean(0), rtol=1e-8, atol=1e-12)
    self_identity = influence.self_influence(wrapped, lossfn, influence.fit(wrapped, lossfn, (X, y), strategy="identity"), (X, y))
    torch.testing.assert_close(self_identity, (per_example ** 2).sum(1), rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_low_rank_queries_are_the_truncated_svd_of_each_block(rank):
    gen = seeded(7)
    model, lossfn = _mlp([4, 5, 3], 7), nn.CrossEntropyLoss()
    X, y = _data("ce", 12, 4, 3, gen)
    Xq, yq = _data("ce", 3, 4, 3, gen)
    factors = influence.fit(model, lossfn, (X, y), strategy="kfac", fisher_type="exact")
    whole = influence.precondition_queries(model, lossfn, factors, (Xq, yq), damping=0.1)
    low = influence.precondition_queries(model, lossfn, factors, (Xq, yq), damping=0.1, query_rank=rank)
    for name, core in whole["blocks"].items():  # [Q, 1, o, a]
        if min(core.shape[-2:]) <= rank:
            assert torch.equal(low["blocks"][name], core)
            continue
        left, right = low["blocks"][name]
        u, s, vh = torch.linalg.svd(core)
        want = u[..., :rank] @ torch.diag_embed(s[..., :rank]) @ vh[..., :rank, :]
        torch.testing.assert_close(left @ right, want, rtol=1e-8, atol=1e-12)
    train = [(X[:6], y[:6]), (X[6:], y[6:])]
    grads = oracle.Problem(model, lossfn, X, y).gradients()
    flat = torch.cat([_dense(v).flatten(1) for v in low["blocks"].values()], dim=1)  # [Q, P]
    torch.testing.assert_close(influence.scores(model, lossfn, factors, low, train), flat @ grads.T, rtol=1e-8, atol=1e-10)


def _dense(v):
    return v[0] @ v[1] if isinstance(v, tuple) else v


def test_preconditioned_queries_and_saved_factors_give_the_same_scores():
    gen = seeded(11)
    model, lossfn = _mlp([3, 4, 2], 11), nn.CrossEntropyLoss()
    X, y = _data("ce", 10, 3, 2, gen)
    Xq, yq = _data("ce", 2, 3, 2, gen)
    factors = influence.fit(model, lossfn, (X, y), strategy="ekfac", fisher_type="mc", generator=seeded(0))
    buffer = io.BytesIO()
    torch.save(factors, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    direct = influence.scores(model, lossfn, factors, (Xq, yq), (X, y))
    prepared = influence.precondition_queries(model, lossfn, loaded, (Xq, yq))
    assert torch.equal(influence.scores(model, lossfn, loaded, prepared, (X, y)), direct)
    # self-influence is the diagonal of the training set's scores against itself
    torch.testing.assert_close(influence.self_influence(model, lossfn, factors, (X, y)),
                               torch.diagonal(influence.scores(model, lossfn, factors, (X, y), (X, y))))


def test_monte_carlo_fits_are_reproducible_and_unbiased():
    """``fisher_type="mc"``: the same generator seed gives the same factors; the diagonal strategy's
    spectrum over many seeds averages to the exact GGN's diagonal (CE: ``E[F_MC] = GGN``), within
    5 standard errors of the mean."""
    gen = seeded(13)
    model, lossfn = _mlp([3, 4, 3], 13), nn.CrossEntropyLoss()
    X, y = _data("ce", 8, 3, 3, gen)
    fit = lambda seed: influence.fit(model, lossfn, (X, y), strategy="diagonal", fisher_type="mc",
                                     generator=seeded(seed))["blocks"]
    a, b = fit(1), fit(1)
    assert all(torch.equal(a[n]["spectrum"], b[n]["spectrum"]) for n in a)
    draws = torch.stack([torch.cat([blk["spectrum"].reshape(-1) for blk in fit(s).values()]) for s in range(300)])
    exact = influence.fit(model, lossfn, (X, y), strategy="diagonal", fisher_type="exact")["blocks"]
    exact = torch.cat([blk["spectrum"].reshape(-1) for blk in exact.values()])
    err = (draws.mean(0) - exact).abs()
    se = draws.std(0) / 300 ** 0.5
    assert bool((err <= 5 * se + 1e-12).all()), (err / se).max()


def test_every_parameter_of_a_language_model_with_tied_embeddings_takes_part():
    """GPT-2 (transformers) from a tiny config: the tied embedding/head (its vocabulary side above
    ``max_factor_dim``: diagonal), position embeddings, norms and attention all get blocks; identity scores are the dot products of per-example gradients
    from plain autograd, and the Kronecker strategies' are finite."""
    pytest.importorskip("transformers")
    model, lossfn = tiny_gpt2(50, seed=0), nn.CrossEntropyLoss()
    gen = seeded(0)
    X, y = torch.randint(0, 50, (4, 6), generator=gen), torch.randint(0, 50, (4, 6), generator=gen)
    names = [n for n, _ in model.named_parameters()]
    identity = influence.fit(model, lossfn, (X, y), strategy="identity")
    assert list(identity["blocks"]) == names
    per_example = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        nn.CrossEntropyLoss(reduction="sum")(model(x[None]), t[None]), list(model.parameters()))])
        for x, t in zip(X, y)])
    torch.testing.assert_close(influence.scores(model, lossfn, identity, (X[:2], y[:2]), (X, y)),
                               per_example[:2] @ per_example.T, rtol=1e-8, atol=1e-8)
    for strategy in ("kfac", "ekfac"):
        factors = influence.fit(model, lossfn, [(X[:2], y[:2]), (X[2:], y[2:])], strategy=strategy,
                                fisher_type="empirical", max_factor_dim=40)
        assert list(factors["blocks"]) == names
        assert torch.isfinite(influence.scores(model, lossfn, factors, (X[:2], y[:2]), (X, y))).all()


def test_the_model_is_not_changed():
    gen = seeded(17)
    model, lossfn = _mlp([3, 4, 2], 17), nn.CrossEntropyLoss()
    X, y = _data("ce", 6, 3, 2, gen)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    factors = influence.fit(model, lossfn, (X, y), strategy="ekfac", fisher_type="exact")
    influence.scores(model, lossfn, factors, (X, y), (X, y))
    influence.self_influence(model, lossfn, factors, (X, y))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules())


def test_bad_arguments_are_refused_before_any_work():
    gen = seeded(19)
    model, lossfn = _mlp([3, 4, 2], 19), nn.CrossEntropyLoss()
    X, y = _data("ce", 6, 3, 2, gen)
    with pytest.raises(CurvatureError, match="strategy='kfc'"):
        influence.fit(model, lossfn, (X, y), strategy="kfc")
    with pytest.raises(CurvatureError, match="fisher_type='fisher'"):
        influence.fit(model, lossfn, (X, y), fisher_type="fisher")
    with pytest.raises(CurvatureError, match="each example's own loss"):
        influence.fit(model, lambda out, t: out.square().mean(), (X, y), strategy="diagonal")
    factors = influence.fit(model, lossfn, (X, y), strategy="kfac", fisher_type="exact")
    for damping in (0.0, -1.0, float("nan"), True):
        with pytest.raises(CurvatureError, match="damping="):
            influence.scores(model, lossfn, factors, (X, y), (X, y), damping=damping)
    with pytest.raises(CurvatureError, match="query_rank="):
        influence.scores(model, lossfn, factors, (X, y), (X, y), query_rank=0)
    with pytest.raises(CurvatureError, match="method='vjp'"):
        influence.scores(model, lossfn, factors, (X, y), (X, y), method="vjp")
    with pytest.raises(CurvatureError, match="chunk_size=0"):
        influence.scores(model, lossfn, factors, (X, y), (X, y), method="jvp", chunk_size=0)
    with pytest.raises(CurvatureTypeError, match="curvlib.influence.fit returns"):
        influence.scores(model, lossfn, {"kfac": {}}, (X, y), (X, y))
    prepared = influence.precondition_queries(model, lossfn, factors, (X, y))
    with pytest.raises(CurvatureError, match="already preconditioned"):
        influence.scores(model, lossfn, factors, prepared, (X, y), damping=0.1)
    other = nn.Sequential(nn.Linear(3, 2)).to(DT)
    with pytest.raises(CurvatureError, match="does not have"):
        influence.scores(other, lossfn, factors, (X, y), (X, y))


def _weight_norm_mlp(seed):
    """``weight_norm``'s kernel has no forward-mode derivative: Jacobian-vector products go
    reverse over reverse."""
    import warnings
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nn.utils.weight_norm's deprecation notice
        first = nn.utils.weight_norm(nn.Linear(3, 4))
    return nn.Sequential(first, nn.Tanh(), nn.Linear(4, 3)).to(DT)


@pytest.mark.parametrize("case", ["ce-mean", "mse-sum", "weight-norm"])
@pytest.mark.parametrize("strategy", ["identity", "ekfac"])
@pytest.mark.parametrize("rank", [None, 1])
def test_scores_by_jacobian_vector_products_equal_dense_influence(case, strategy, rank):
    """``method="jvp"``: no example gradient formed, the same scores (chunks of 2 queries)."""
    gen = seeded(23)
    loss = "mse" if case == "mse-sum" else "ce"
    model = _weight_norm_mlp(23) if case == "weight-norm" else _mlp([3, 4, 3], 23)
    lossfn = _lossfn(loss, "sum" if case == "mse-sum" else "mean")
    X, y = _data(loss, 12, 3, 3, gen)
    Xq, yq = _data(loss, 3, 3, 3, gen)
    train = _split(X, y, [5, 7])
    factors = influence.fit(model, lossfn, train, strategy=strategy, fisher_type="exact")
    want = influence.scores(model, lossfn, factors, (Xq, yq), train, query_rank=rank)
    got = influence.scores(model, lossfn, factors, (Xq, yq), train, query_rank=rank, method="jvp", chunk_size=2)
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)
    if case == "ce-mean" and rank is None:  # and the gradients' path against the oracle
        problem = oracle.Problem(model, lossfn, X, y)
        S = oracle.strategy_matrix(problem, strategy, "exact")
        lam = [0.0] * 4 if strategy == "identity" else oracle.heuristic_dampings(problem, S)
        torch.testing.assert_close(got, oracle.scores(problem, S, lam, problem.gradients(Xq, yq), problem.gradients()),
                                   rtol=1e-7, atol=1e-9)


def test_scores_by_jvp_on_a_sequence_model_with_tied_embeddings():
    pytest.importorskip("transformers")
    model, lossfn = tiny_gpt2(30, seed=1), nn.CrossEntropyLoss()
    gen = seeded(1)
    X, y = torch.randint(0, 30, (6, 5), generator=gen), torch.randint(0, 30, (6, 5), generator=gen)
    train = [(X[:3], y[:3]), (X[3:], y[3:])]
    factors = influence.fit(model, lossfn, train, strategy="ekfac", fisher_type="empirical")
    want = influence.scores(model, lossfn, factors, (X[:2], y[:2]), train)
    got = influence.scores(model, lossfn, factors, (X[:2], y[:2]), train, method="jvp")
    torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("strategy", ["ekfac", "diagonal"])
def test_one_example_per_call_gives_the_same_factors_and_scores(strategy):
    """``batch_size=1``: the rows-heavy passes (EK-FAC's eigenvalues, each example's gradient) one
    example per ``curvature`` call, at about a backward's memory: the same results."""
    gen = seeded(29)
    model, lossfn = _mlp([3, 4, 3], 29), nn.CrossEntropyLoss()
    X, y = _data("ce", 10, 3, 3, gen)
    train = _split(X, y, [4, 6])
    whole = influence.fit(model, lossfn, train, strategy=strategy, fisher_type="exact")
    sliced = influence.fit(model, lossfn, train, strategy=strategy, fisher_type="exact", batch_size=1)
    for name, block in whole["blocks"].items():
        torch.testing.assert_close(sliced["blocks"][name]["spectrum"], block["spectrum"], rtol=1e-10, atol=1e-14)
    # one call per group of parameters, each group's sampled labels the same draws
    assert len(parameter_groups({n: p.numel() for n, p in model.named_parameters()}, 1)) > 1
    if strategy == "ekfac":
        mc = [influence.fit(model, lossfn, train, strategy=strategy, generator=seeded(3), batch_size=size)
              for size in (None, 1)]
        for name, block in mc[0]["blocks"].items():
            torch.testing.assert_close(mc[1]["blocks"][name]["spectrum"], block["spectrum"], rtol=1e-10, atol=1e-14)
    query = (X[:3], y[:3])
    torch.testing.assert_close(influence.scores(model, lossfn, whole, query, train, batch_size=1),
                               influence.scores(model, lossfn, whole, query, train), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(influence.self_influence(model, lossfn, whole, train, batch_size=3),
                               influence.self_influence(model, lossfn, whole, train), rtol=1e-10, atol=1e-12)
    with pytest.raises(CurvatureError, match="batch_size=0"):
        influence.fit(model, lossfn, train, strategy=strategy, batch_size=0)


class _OldStyleTanh(torch.autograd.Function):
    """``forward(ctx, x)`` without ``setup_context``: torch.func transforms refuse it."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)


class _OldStyleNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 3)

    def forward(self, x):
        return self.b(_OldStyleTanh.apply(self.a(x)))


@pytest.mark.parametrize("method", ["gradients", "jvp"])
def test_a_custom_function_without_setup_context_is_scored(method):
    """Bloom's GeLU is such a Function: the scores take the model's values detached (they are not
    differentiated), so curvature's plain-autograd route serves them."""
    torch.manual_seed(41)
    model, lossfn = _OldStyleNet().to(DT), nn.CrossEntropyLoss()
    gen = seeded(41)
    X, y = _data("ce", 8, 3, 3, gen)
    factors = influence.fit(model, lossfn, (X, y), strategy="identity")
    per_example = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        nn.CrossEntropyLoss(reduction="sum")(model(x[None]), t[None]), list(model.parameters()))])
        for x, t in zip(X, y)])
    got = influence.scores(model, lossfn, factors, (X[:2], y[:2]), (X, y), method=method)
    torch.testing.assert_close(got, per_example[:2] @ per_example.T, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(influence.self_influence(model, lossfn, factors, (X, y)), (per_example ** 2).sum(1))
