"""The whole-network operators against dense float64 brute force from ``torch.func``.

Brute force: the parameters as one flat vector ``θ``; ``J = jacrev(f)(θ)``, the loss Hessian
with respect to the output ``H_out = hessian(L ∘ out)``, so ``G = Jᵀ H_out J``; ``∇²L =
hessian(L ∘ f)(θ)``; the individual gradients ``g_n`` by ``vmap(grad)`` of ``c·ℓ(f(x_n), y_n)``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import CurvatureError, CurvatureTypeError, curvature
from curvlib.extensions import DiagGGNExact, DiagHessian, SumGradSquared
from curvlib.operators import GGN, EmpiricalFisher, FisherMC, Hessian, Jacobian, plain

from oracles.on_device import seeded

D = torch.float64
ACTIVATIONS = {"tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "gelu": nn.GELU, "softplus": nn.Softplus}


def _loss(kind: str, reduction: str) -> nn.Module:
    return {"ce": nn.CrossEntropyLoss, "mse": nn.MSELoss, "bce": nn.BCEWithLogitsLoss}[kind](reduction=reduction)


def _problem(seed, widths, act, kind, reduction, n):
    torch.manual_seed(seed)
    g = seeded(seed)
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), ACTIVATIONS[act]()]
    model = nn.Sequential(*layers[:-1]).to(D)
    X = torch.randn(n, widths[0], generator=g, dtype=D)
    if kind == "ce":
        y = torch.randint(0, widths[-1], (n,), generator=g)
    elif kind == "bce":
        y = torch.randint(0, 2, (n, widths[-1]), generator=g).to(D)
    else:
        y = torch.randn(n, widths[-1], generator=g, dtype=D)
    return model, _loss(kind, reduction), X, y


class Brute:
    """Dense float64 references for one ``(model, lossfn, X, y)``."""

    def __init__(self, model, lossfn, X, y):
        self.model, self.lossfn, self.X, self.y = model, lossfn, X, y
        self.params = {n: p.detach() for n, p in model.named_parameters()}
        self.theta = torch.cat([p.reshape(-1) for p in self.params.values()])

    def unflat(self, theta):
        out, start = {}, 0
        for name, p in self.params.items():
            out[name] = theta[start:start + p.numel()].reshape(p.shape)
            start += p.numel()
        return out

    def f(self, theta, X=None):
        return torch.func.functional_call(self.model, self.unflat(theta), (self.X if X is None else X,))

    def loss(self, theta):
        return self.lossfn(self.f(theta), self.y)

    def jacobian(self):
        J = torch.func.jacrev(self.f)(self.theta)
        return J.reshape(-1, self.theta.numel())

    def ggn(self):
        out = self.f(self.theta).detach()
        H = torch.func.hessian(lambda o: self.lossfn(o, self.y))(out).reshape(out.numel(), out.numel())
        J = self.jacobian()
        return J.T @ H @ J

    def hessian(self):
        return torch.func.jacrev(torch.func.jacrev(self.loss))(self.theta)  # (reverse only: every kernel has it)

    def individual_gradients(self):
        """``g_n = ∂(c·ℓ_n)/∂θ``, ``[N, P]``."""
        summed = self.lossfn.__class__(reduction="sum")
        scale = _mean_scale(self.lossfn, self.y, self.X.shape[0])

        def one(x, y):
            return torch.func.grad(lambda t: summed(self.f(t, x[None]), y[None]))(self.theta)

        return scale * torch.func.vmap(one)(self.X, self.y)

    def empirical_fisher(self):
        G = self.individual_gradients()
        return G.T @ G


def _mean_scale(lossfn, y, n):
    if lossfn.reduction == "sum":
        return 1.0
    if isinstance(lossfn, nn.CrossEntropyLoss):
        return 1.0 / n
    return 1.0 / y.numel()


def _close(actual, expected, what, rtol=1e-9, atol=1e-11):
    err = float((actual - expected).abs().max()) if actual.numel() else 0.0
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    assert err <= atol + rtol * scale, f"{what}: max error {err:.3g} at scale {scale:.3g}"


configs = st.tuples(
    st.integers(0, 10_000),
    st.lists(st.integers(1, 4), min_size=2, max_size=4),
    st.sampled_from(sorted(ACTIVATIONS)),
    st.sampled_from(["ce", "mse", "bce"]),
    st.sampled_from(["mean", "sum"]),
    st.integers(1, 5),
)


@settings(max_examples=20)
@given(configs)
def test_dense_operators_equal_brute_force(config):
    seed, widths, act, kind, reduction, n = config
    if kind == "ce" and widths[-1] < 2:
        widths = widths[:-1] + [2]
    model, lossfn, X, y = _problem(seed, widths, act, kind, reduction, n)
    brute = Brute(model, lossfn, X, y)
    data = (X, y)
    _close(GGN(model, lossfn, data).to_dense(), brute.ggn(), "GGN")
    _close(Hessian(model, lossfn, data).to_dense(), brute.hessian(), "Hessian")
    _close(EmpiricalFisher(model, lossfn, data).to_dense(), brute.empirical_fisher(), "empirical Fisher")
    J = Jacobian(model, lossfn, data)
    _close(J.to_dense(), brute.jacobian(), "Jacobian")
    _close(J.T.to_dense(), brute.jacobian().T, "Jacobian transpose")


@settings(max_examples=15)
@given(configs, st.integers(1, 3), st.data())
def test_a_loader_gives_the_operator_of_all_its_samples(config, parts, data):
    seed, widths, act, kind, reduction, n = config
    if kind == "ce" and widths[-1] < 2:
        widths = widths[:-1] + [2]
    n = max(n, parts)
    model, lossfn, X, y = _problem(seed, widths, act, kind, reduction, n)
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), max_size=parts - 1)) if n > 1 else [])
    edges = [0] + list(cuts) + [n]
    loader = [(X[a:b], y[a:b]) for a, b in zip(edges[:-1], edges[1:])]
    for Op in (GGN, Hessian, EmpiricalFisher):
        _close(Op(model, lossfn, loader).to_dense(), Op(model, lossfn, (X, y)).to_dense(), f"{Op.__name__} over a loader")


def test_a_loader_weighs_cross_entropy_by_counted_targets():
    model, _, X, y = _problem(3, [3, 4, 3], "tanh", "ce", "mean", 6)
    y[1] = y[4] = -100  # ignored: the batches count 2 and 2 targets of 3 and 3 samples
    lossfn = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5], dtype=D))
    brute = Brute(model, lossfn, X, y)
    loader = [(X[:3], y[:3]), (X[3:], y[3:])]
    _close(GGN(model, lossfn, loader).to_dense(), brute.ggn(), "GGN, weighted and ignored targets")
    _close(Hessian(model, lossfn, loader).to_dense(), brute.hessian(), "Hessian, weighted and ignored targets")


def test_diagonals_are_curvatures_quantities():
    model, lossfn, X, y = _problem(5, [4, 5, 3], "gelu", "ce", "mean", 7)
    qs = curvature(model, lossfn, [DiagGGNExact(), DiagHessian(), SumGradSquared()])(X, y)
    flat = lambda d: torch.cat([t.reshape(-1) for t in d.values()])  # noqa: E731
    for Op, key in [(GGN, "diag_ggn_exact"), (Hessian, "diag_h"), (EmpiricalFisher, "sum_grad_squared")]:
        _close(Op(model, lossfn, (X, y)).to_dense().diagonal(), flat(qs[key]), key)


def test_monte_carlo_fisher_is_unbiased_within_its_spread():
    model, lossfn, X, y = _problem(7, [3, 4, 3], "tanh", "ce", "mean", 4)
    G = GGN(model, lossfn, (X, y)).to_dense()
    draws = torch.stack([FisherMC(model, lossfn, (X, y), generator=seeded(s), mc_samples=4).to_dense() for s in range(40)])
    mean, spread = draws.mean(0), draws.std(0) / math.sqrt(len(draws))
    assert bool(((mean - G).abs() <= 5 * spread + 1e-12).all()), float(((mean - G).abs() / (spread + 1e-30)).max())
    # the same generator state gives the same matrix; another gives another
    a = FisherMC(model, lossfn, (X, y), generator=seeded(0)).to_dense()
    b = FisherMC(model, lossfn, (X, y), generator=seeded(0)).to_dense()
    assert torch.equal(a, b) and not torch.equal(a, draws[1])
    _close(a, a.T, "Monte-Carlo Fisher symmetric", atol=1e-14)


def test_products_on_dicts_blocks_vmap_and_scipy():
    model, lossfn, X, y = _problem(11, [3, 4, 2], "tanh", "mse", "mean", 5)
    G = GGN(model, lossfn, (X, y))
    dense = G.to_dense()
    V = torch.randn(dense.shape[0], 3, dtype=D, generator=seeded(1))
    _close(G @ V, dense @ V, "matmat")
    _close(torch.func.vmap(lambda v: G @ v)(V.T).T, dense @ V, "vmap over vectors")
    as_dict = G.domain.unflatten(V[:, 0])
    _close(G.domain.flatten(G @ as_dict), dense @ V[:, 0], "dict in, dict out")
    _close(G.domain.flatten(G @ G.domain.unflatten(V)), dense @ V, "dict of [K, *p]")
    _close(torch.as_tensor(G.to_scipy() @ V[:, 0].cpu().numpy()).to(V), dense @ V[:, 0], "to_scipy")
    offsets = G.domain.offsets()
    for key, block in G.blocks().items():
        rows = torch.cat([torch.arange(offsets[n].start, offsets[n].stop) for n in block.domain.names])
        _close(block.to_dense(), dense[rows][:, rows], f"block {key!r}")
    w = model[2].weight
    only = GGN(model, lossfn, (X, y), params={"2.weight": w.detach()})
    sl = offsets["2.weight"]
    _close(only.to_dense(), dense[sl, sl], "params= a subset")


def test_the_operator_differentiates_through_its_vector():
    model, lossfn, X, y = _problem(2, [3, 3, 2], "softplus", "ce", "sum", 4)
    H = Hessian(model, lossfn, (X, y))
    dense = H.to_dense()
    v = torch.randn(dense.shape[0], dtype=D, generator=seeded(3), requires_grad=True)
    (g,) = torch.autograd.grad((H @ v).pow(2).sum(), v)
    _close(g, 2 * dense.T @ dense @ v.detach(), "gradient of |Hv|² in v")


@settings(max_examples=15)
@given(configs)
def test_one_vector_goes_reverse_over_forward(config):
    """One vector's Hessian product is the gradient of the loss's derivative along it
    (``H v = ∇_θ ⟨∇_f L, J v⟩``, reverse over forward): equal to the brute-force Hessian times
    ``v``, flat or as a dict, and the route is taken."""
    seed, widths, act, kind, reduction, n = config
    if kind == "ce" and widths[-1] < 2:
        widths = widths[:-1] + [2]
    model, lossfn, X, y = _problem(seed, widths, act, kind, reduction, n)
    brute = Brute(model, lossfn, X, y)
    H = Hessian(model, lossfn, (X, y))
    v = torch.randn(H.shape[1], dtype=D, generator=seeded(seed + 1))
    dense = brute.hessian()
    _close(H @ v, dense @ v, "H v (flat)")
    _close(H.domain.flatten(H @ H.domain.unflatten(v)), dense @ v, "H v (dict)")
    assert H.over_forward


class NormedAttention(nn.Module):
    """Tokens -> LayerNorm -> one softmax attention head -> LayerNorm -> Linear on the mean."""

    def __init__(self, d=4, c=3):
        super().__init__()
        self.norm, self.qkv, self.out_norm, self.head = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.LayerNorm(d), nn.Linear(d, c)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        a = torch.softmax(q @ k.transpose(1, 2) / 2.0, dim=-1)
        return self.head(self.out_norm(a @ v + x).mean(1))


def test_reverse_over_forward_through_softmax_and_layer_norm(monkeypatch):
    """torch's forward-mode derivatives of softmax and layer_norm cannot be differentiated again
    (the first writes into its saved result, the second's is wrong): reverse over forward runs
    them as their formulas and equals the dense Hessian. Left to torch's kernels, the probe on two
    samples sees layer_norm's wrong derivative and keeps forward over reverse, still exact."""
    torch.manual_seed(0)
    model = NormedAttention().to(D)
    X, y = torch.randn(4, 3, 4, generator=seeded(0), dtype=D), torch.randint(0, 3, (4,), generator=seeded(1))
    lossfn = nn.CrossEntropyLoss()
    brute = Brute(model, lossfn, X, y)
    # (torch.autograd's Hessian, by loops: layer_norm's second derivatives under vmap are wrong)
    dense = torch.autograd.functional.hessian(brute.loss, brute.theta)
    v = torch.randn(dense.shape[0], dtype=D, generator=seeded(2))
    H = Hessian(model, lossfn, (X, y))
    _close(H @ v, dense @ v, "H v through softmax and layer_norm")
    assert H.over_forward
    composed = plain._Composed.__torch_function__

    def torch_layer_norm(self, func, types, args=(), kwargs=None):
        if func in (nn.functional.layer_norm, torch.layer_norm):
            return func(*args, **(kwargs or {}))
        return composed(self, func, types, args, kwargs)

    monkeypatch.setattr(plain._Composed, "__torch_function__", torch_layer_norm)
    H = Hessian(model, lossfn, (X, y))
    _close(H @ v, dense @ v, "H v with torch's layer_norm kernel")
    assert H.over_forward is False


def test_reverse_over_forward_keeps_no_grad_regions_constant():
    torch.manual_seed(0)
    model = NoGradScale().to(D)
    X, y = torch.randn(5, 3, dtype=D), torch.randint(0, 4, (5,))
    H = Hessian(model, nn.CrossEntropyLoss(), (X, y))
    dense = H.to_dense()  # (several vectors: forward over reverse, checked by test_code_under_no_grad_is_constant)
    v = torch.randn(H.shape[1], dtype=D, generator=seeded(1))
    _close(H @ v, dense @ v, "H v with a no_grad region")
    assert H.over_forward


class NoGradScale(nn.Module):
    """A model whose forward computes a scale under ``no_grad``: constant, as in its own backward."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(3, 4)

    def forward(self, x):
        with torch.no_grad():
            s = torch.sigmoid(self.b(x))
        return self.a(x) * s


def test_code_under_no_grad_is_constant():
    torch.manual_seed(0)
    model = NoGradScale().to(D)
    X, y = torch.randn(5, 3, dtype=D), torch.randint(0, 4, (5,))
    lossfn = nn.CrossEntropyLoss()
    s = torch.sigmoid(model.b(X)).detach()
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(theta):
        p = dict(params)
        p.update(theta)
        return lossfn(torch.func.functional_call(model.a, {"weight": p["a.weight"], "bias": p["a.bias"]}, (X,)) * s, y)

    names = list(params)
    flat = lambda d: torch.cat([d[n].reshape(-1) for n in names])  # noqa: E731
    H = Hessian(model, lossfn, (X, y)).to_dense()
    full = torch.func.hessian(lambda t: loss(_split(t, params)))(flat(params))
    _close(H, full, "Hessian with a no_grad region")
    assert float(H[-16:].abs().max()) == 0.0  # b's rows (weight 4x3, bias 4): constant


def _split(t, params):
    out, start = {}, 0
    for n, p in params.items():
        out[n] = t[start:start + p.numel()].reshape(p.shape)
        start += p.numel()
    return out


def test_dropout_masks_are_fixed_for_the_operators_lifetime():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Dropout(0.5), nn.Linear(6, 2)).to(D).train()
    X, y = torch.randn(4, 3, dtype=D), torch.randint(0, 2, (4,))
    with pytest.warns(UserWarning, match="[Dd]ropout"):
        G = GGN(model, nn.CrossEntropyLoss(), (X, y), generator=seeded(0))
    a, b = G.to_dense(), G.to_dense()
    assert torch.equal(a, b)
    _close(a, a.T, "symmetric", atol=1e-14)


@pytest.mark.parametrize("bad, error, match", [
    (lambda G: G @ torch.zeros(3, dtype=D), CurvatureError, "shape"),
    (lambda G: G @ torch.zeros(G.shape[1]), CurvatureTypeError, "float64"),
    (lambda G: G @ [1.0], CurvatureTypeError, "tensor"),
    (lambda G: G @ {"0.weight": torch.zeros(4, 3, dtype=D)}, CurvatureError, "missing"),
    (lambda G: G.block(["nope"]), CurvatureError, "names"),
    (lambda G: G.blocks(by="layer"), CurvatureError, "module"),
])
def test_bad_vectors_are_refused(bad, error, match):
    model, lossfn, X, y = _problem(0, [3, 4, 2], "tanh", "ce", "mean", 3)
    with pytest.raises(error, match=match):
        bad(GGN(model, lossfn, (X, y)))


def test_bad_data_is_refused():
    model, lossfn, X, y = _problem(0, [3, 4, 2], "tanh", "ce", "mean", 4)
    with pytest.raises(CurvatureTypeError, match="one-pass"):
        GGN(model, lossfn, iter([(X, y)]))
    with pytest.raises(CurvatureError, match="no batches"):
        GGN(model, lossfn, [])
    with pytest.raises(CurvatureError, match="pair"):
        GGN(model, lossfn, [(X, y), X])
    with pytest.raises(CurvatureError, match="cannot know"):
        GGN(model, lambda o, t: ((o - 1) ** 2).sum(), [(X[:2], y[:2]), (X[2:], y[2:])])
    with pytest.raises(CurvatureError, match="chunk_size"):
        GGN(model, lossfn, (X, y), chunk_size=0)

    class Shuffled:
        def __init__(self):
            self.calls = 0

        def __iter__(self):
            self.calls += 1
            order = [0, 1] if self.calls == 1 else [1, 0]
            return iter([(X[2 * k:2 * k + 2], y[2 * k:2 * k + 2]) for k in order])

    G = GGN(model, lossfn, Shuffled())
    with pytest.raises(CurvatureError, match="changed between passes"):
        G @ torch.zeros(G.shape[1], dtype=D)


def test_the_model_is_not_changed():
    model, lossfn, X, y = _problem(4, [3, 4, 2], "tanh", "ce", "mean", 3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    hooks = (len(model._forward_hooks), len(model._forward_pre_hooks))
    H = Hessian(model, lossfn, (X, y))
    H @ torch.ones(H.shape[1], dtype=D)
    assert all(torch.equal(before[n], p) and p.grad is None for n, p in model.named_parameters())
    assert hooks == (len(model._forward_hooks), len(model._forward_pre_hooks))


def test_operations_without_forward_mode_use_reverse_mode():
    """``weight_norm``'s kernel has no forward-mode derivative in torch: the GGN's and the
    Jacobian's products go reverse over reverse and stay exact; the Hessian is refused (torch's
    own second derivative of that kernel is wrong, checked here by finite differences, and its
    products are not symmetric)."""
    torch.manual_seed(1)
    with pytest.warns(FutureWarning):
        model = nn.Sequential(nn.utils.weight_norm(nn.Linear(3, 4)), nn.Tanh(), nn.Linear(4, 2)).to(D)
    X, y = torch.randn(5, 3, dtype=D), torch.randint(0, 2, (5,))
    lossfn = nn.CrossEntropyLoss()
    brute = Brute(model, lossfn, X, y)
    _close(GGN(model, lossfn, (X, y)).to_dense(), brute.ggn(), "GGN")
    _close(Jacobian(model, lossfn, (X, y)).to_dense(), brute.jacobian(), "Jacobian")
    H = Hessian(model, lossfn, (X, y))
    with pytest.raises(CurvatureError, match="not symmetric"):
        H @ torch.ones(H.shape[1], dtype=D)
    assert not H.over_forward  # (the kernel has no forward mode: one vector goes the same way)
    gradient = torch.func.grad(brute.loss)
    e = torch.zeros_like(brute.theta)
    e[5] = 1e-6  # a weight_g/weight_v entry
    by_differences = (gradient(brute.theta + e) - gradient(brute.theta - e)) / 2e-6
    assert float((brute.hessian()[5] - by_differences).abs().max()) > 1e-2  # torch's own is off


@pytest.mark.parametrize("lossfn", [nn.HuberLoss(), nn.SmoothL1Loss(reduction="sum"),
                                    lambda out, y: ((out - y) ** 4).mean()], ids=["huber", "smooth_l1", "quartic"])
def test_per_sample_losses_of_any_form(lossfn):
    """A loss curvlib has no closed form for: its Hessian by autodiff (``huber_loss_backward`` has
    no forward mode: the Hessian operator goes reverse over reverse there)."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    X, y = torch.randn(5, 3, dtype=D), torch.randn(5, 2, dtype=D)
    brute = Brute(model, lossfn, X, y)
    _close(GGN(model, lossfn, (X, y)).to_dense(), brute.ggn(), "GGN")
    _close(Hessian(model, lossfn, (X, y)).to_dense(), brute.hessian(), "Hessian")


class NoForwardMode(torch.autograd.Function):
    """``x ↦ x³`` with its derivatives written out in reverse mode only (no ``jvp``): a kernel
    torch has no forward mode for, whose reverse-mode second derivative is right."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x ** 3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x ** 2 * g


class CubeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(NoForwardMode.apply(self.a(x)))


def test_a_kernel_without_forward_mode_whose_second_derivative_is_right():
    """The Hessian goes reverse over reverse after its symmetry check, and is exact."""
    torch.manual_seed(3)
    model = CubeNet().to(D)
    X, y = torch.randn(5, 3, dtype=D), torch.randint(0, 2, (5,))
    lossfn = nn.CrossEntropyLoss()
    brute = Brute(model, lossfn, X, y)
    H = Hessian(model, lossfn, (X, y))
    _close(H.to_dense(), brute.hessian(), "Hessian")
    assert H.needs_symmetry and H.symmetric_checked
    _close(GGN(model, lossfn, (X, y)).to_dense(), brute.ggn(), "GGN")


class OldStyleGelu(torch.autograd.Function):
    """A custom Function written the old way (``forward(ctx, x)``, Bloom's GeLU): no ``torch.func``
    transform runs it; plain autograd does."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(1.702 * x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(1.702 * x)
        return g * (s + 1.702 * x * s * (1 - s))


class OldStyleNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(OldStyleGelu.apply(self.a(x)))


class SurrogateProduct(torch.autograd.Function):
    """``(a, b) ↦ a ⊙ b`` written the old way with a surrogate backward ``g ↦ (g ⊙ b, 2 g ⊙ a)``,
    not the forward's derivative (YOSO's attention kernel is such a Function): the model's own
    gradient field is then no gradient, and its Jacobian is not symmetric."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * b, 2 * g * a


class SurrogateNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 8), nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        return self.b(SurrogateProduct.apply(h[:, :4], h[:, 4:]))


def test_a_function_whose_backward_is_no_derivative_is_refused_by_name():
    """Reverse over reverse through a surrogate backward is not symmetric: the Hessian is
    refused, naming the Function and the cause; the GGN takes the backward as the Jacobian."""
    torch.manual_seed(5)
    model = SurrogateNet().to(D)
    X, y = torch.randn(5, 3, dtype=D), torch.randint(0, 2, (5,))
    lossfn = nn.CrossEntropyLoss()
    with pytest.raises(CurvatureError, match=r"(?s)SurrogateProduct.*not symmetric.*surrogate gradient") as info:
        Hessian(model, lossfn, (X, y)).to_dense()
    assert "weight_norm" not in str(info.value)


def test_a_function_torch_func_cannot_transform_runs_on_plain_autograd():
    torch.manual_seed(4)
    model = OldStyleNet().to(D)
    X, y = torch.randn(5, 3, dtype=D), torch.randint(0, 2, (5,))
    lossfn = nn.CrossEntropyLoss()
    params = {n: p.detach() for n, p in model.named_parameters()}
    theta = torch.cat([p.reshape(-1) for p in params.values()])
    f = lambda t: torch.func.functional_call(model, _split(t, params), (X,))  # noqa: E731
    J = torch.autograd.functional.jacobian(f, theta).reshape(-1, theta.numel())
    out = f(theta).detach()
    H_out = torch.autograd.functional.hessian(lambda o: lossfn(o.reshape(out.shape), y), out.reshape(-1))
    H = torch.autograd.functional.hessian(lambda t: lossfn(f(t), y), theta)
    _close(GGN(model, lossfn, (X, y)).to_dense(), J.T @ H_out @ J, "GGN")
    _close(Hessian(model, lossfn, (X, y)).to_dense(), H, "Hessian")
    Jop = Jacobian(model, lossfn, (X, y))
    _close(Jop.to_dense(), J, "Jacobian")
    _close(Jop.T.to_dense(), J.T, "Jacobian transpose")
    G = GGN(model, lossfn, (X, y))
    with pytest.raises(CurvatureError, match="cannot be vmapped"):
        torch.func.vmap(lambda v: G @ v)(torch.eye(G.shape[1], dtype=D))
