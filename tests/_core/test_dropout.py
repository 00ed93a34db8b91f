"""Dropout in training mode: a legitimate random GGN, reproducible and consistent.

The oracle: curvlib documents its masks (:mod:`curvlib._core.dropout`): one seed per
call, ``randint(0, 2**62)`` from ``f``'s ``generator`` or the global random
state; every forward run starts a generator seeded with it, and each active
dropout node, in graph order, draws ``bernoulli(1 − p)`` noise of its shape
(element-wise, or per sample and channel for ``Dropout1d/2d/3d`` and
``FeatureAlphaDropout``). :func:`masks` reproduces those draws here, and
:class:`Packed` is the model with every dropout replaced by multiplication with
that noise, PyTorch's formula (checked against PyTorch's own dropout functions
in :func:`test_mask_formula_is_pytorchs`). The noise travels *inside* the input
(packed after the features), so the brute-force oracles, which run samples one by
one, see each sample's own mask. Every result is then compared with
:func:`oracles.reference.reference` on :class:`Packed`; the loss and gradient check
that the reproduced masks are the ones curvlib used.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.func import jacrev

from curvlib import CurvatureError, curvature
from curvlib.extensions import KFRA, BatchGrad, DiagGGNExact, DiagGGNMC, DiagHessian, GGNMP, HMP, PCHMP

from oracles.reference import assert_close, assert_matches, assert_same, exact_extensions, kflr_map, product_matrix, reference
from oracles.second_order import kron_input_factor, loss_hessian_blocks
from oracles.on_device import seeded

DT = torch.float64
ALPHA = 1.7580993408473766
PER_CHANNEL = {nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.FeatureAlphaDropout}
pytestmark = pytest.mark.filterwarnings("ignore:The model has dropout in training mode")


class FDrop(nn.Module):
    """Functional dropout in a user module (fx inlines it: a ``call_function`` node)."""

    def __init__(self, p, follow_mode=True):
        super().__init__()
        self.p, self.follow_mode = p, follow_mode

    def forward(self, x):
        if self.follow_mode:
            return F.dropout(x, self.p, training=self.training)
        return F.dropout(x, self.p)  # default training=True: active in eval mode too


def _is_dropout(m) -> bool:
    return isinstance(m, (nn.modules.dropout._DropoutNd, FDrop))


def _active(m) -> bool:
    return _is_dropout(m) and m.p > 0 and (m.training or (isinstance(m, FDrop) and not m.follow_mode))


def _alpha(m) -> bool:
    return isinstance(m, (nn.AlphaDropout, nn.FeatureAlphaDropout))


def fixed(m, x, noise):
    """PyTorch's dropout of ``m``'s kind with the given 0/1 noise (ATen ``_dropout_impl``)."""
    p = m.p
    if p == 1:
        return x * 0
    if _alpha(m):
        a = 1.0 / ((ALPHA**2 * p + 1) * (1 - p)) ** 0.5
        return x * (noise * a) + (noise - 1) * (ALPHA * a) + ALPHA * a * p
    return x * noise / (1 - p)


def _noise_shape(m, x_shape):
    return tuple(x_shape[:2]) + (1,) * (len(x_shape) - 2) if type(m) in PER_CHANNEL else tuple(x_shape)


def masks(model: nn.Sequential, X, generator=None):
    """The noise curvlib draws for one call (module doc), per active dropout child."""
    where = generator.device if generator is not None else "cpu"  # (the global state: the CPU's)
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=where).item())
    g = seeded(seed)
    shapes, x = {}, X
    with torch.no_grad():
        for name, m in model.named_children():
            if _active(m):
                shapes[name] = _noise_shape(m, x.shape)
            x = x if _is_dropout(m) else m(x)
    return {name: torch.empty(s, dtype=DT).bernoulli_(1 - model.get_submodule(name).p, generator=g)
            for name, s in shapes.items()}


class Packed(nn.Module):
    """``model`` (a Sequential) with its dropout replaced by fixed noise read from the input.

    Input ``[N, D + Σ noise]``: the features, then each dropout's noise per sample.
    Children keep their names, so parameter names are the model's."""

    def __init__(self, model: nn.Sequential, X, noise):
        super().__init__()
        for name, m in copy.deepcopy(model).named_children():
            self.add_module(name, m)
        self.in_shape = tuple(X.shape[1:])
        self.noise_shapes = {k: tuple(v.shape[1:]) for k, v in noise.items()}

    def pack(self, X, noise):
        return torch.cat([X.flatten(1)] + [noise[k].flatten(1) for k in self.noise_shapes], 1)

    def forward(self, xp):
        n, off = xp.shape[0], int(torch.Size(self.in_shape).numel())
        x = xp[:, :off].reshape((n,) + self.in_shape)
        for name, m in self.named_children():
            if name in self.noise_shapes:
                k = int(torch.Size(self.noise_shapes[name]).numel())
                x = fixed(m, x, xp[:, off:off + k].reshape((n,) + self.noise_shapes[name]))
                off += k
            elif not _is_dropout(m):
                x = m(x)
        return x


def _model(kind: str, p: float, act=nn.Tanh):
    """Linear → (reshape) → dropout of ``kind`` → activation → Linear, on 3 features."""
    drop = {"plain": nn.Dropout, "alpha": nn.AlphaDropout, "functional": FDrop, "1d": nn.Dropout1d,
            "2d": nn.Dropout2d, "feature_alpha": nn.FeatureAlphaDropout}[kind](p)
    shape = {"1d": (2, 2), "2d": (1, 2, 2), "feature_alpha": (2, 2)}.get(kind)
    layers = [nn.Linear(3, 4), act()]
    layers += [nn.Unflatten(1, shape), drop, nn.Flatten()] if shape else [drop]
    return nn.Sequential(*layers, nn.Linear(4, 2)).to(DT).train()


def _data(n, loss, seed):
    g = seeded(seed)
    X = torch.randn(n, 3, generator=g, dtype=DT)
    y = torch.randint(0, 2, (n,), generator=g) if loss == "ce" else torch.randn(n, 2, generator=g, dtype=DT)
    return X, y


LOSSES = {"ce": nn.CrossEntropyLoss, "mse": nn.MSELoss}
KINDS = ["plain", "alpha", "functional", "1d", "2d", "feature_alpha"]


@pytest.mark.parametrize("kind", KINDS)
def test_mask_formula_is_pytorchs(kind):
    """Oracle self-check: :func:`fixed` with the noise PyTorch drew reproduces PyTorch's
    dropout, and that noise has :func:`_noise_shape` (per channel where it should)."""
    m = _model(kind, 0.4)[2 if kind in ("plain", "alpha", "functional") else 3]
    x = torch.randn(64, 2, 3, 3, dtype=DT) if kind in ("2d",) else torch.randn(64, 4, 5, dtype=DT)
    torch.manual_seed(0)
    out = m(x)
    if _alpha(m):
        a = 1.0 / ((ALPHA**2 * m.p + 1) * (1 - m.p)) ** 0.5
        noise = torch.isclose(out, x * a + ALPHA * a * m.p).to(DT)
    else:
        noise = (out != 0).to(DT)
    per = noise.reshape(noise.shape[:2] + (-1,))
    if type(m) in PER_CHANNEL:
        assert (per == per[..., :1]).all(), "PyTorch's noise is per channel"
        noise = noise.flatten(2)[..., :1].reshape(_noise_shape(m, x.shape))
    assert 0.3 < noise.mean() < 0.9
    assert_close(fixed(m, x, noise), out, f"{kind} dropout with PyTorch's noise")


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=2)
@given(p=st.sampled_from([0.2, 0.5, 0.8]), loss=st.sampled_from(sorted(LOSSES)), n=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_results_equal_the_oracle_with_the_same_masks(kind, p, loss, n, seed):
    """Every exact extension (products, KFLR included) equals the brute force on the
    model with curvlib's masks, drawn from ``generator=``."""
    torch.manual_seed(seed)
    model, lossfn = _model(kind, p), LOSSES[loss]()
    X, y = _data(n, loss, seed)
    noise = masks(model, X, seeded(seed))
    packed = Packed(model, X, noise)
    ref = reference(packed, lossfn, packed.pack(X, noise), y, kflr=kflr_map(packed))
    f = curvature(model, lossfn, exact_extensions(kflr=True))
    qs = f(X, y, generator=seeded(seed))
    assert_matches(qs, ref, f"{kind} p={p}")


def test_global_random_state_reproduces_and_advances():
    model, lossfn, (X, y) = _model("plain", 0.5), nn.CrossEntropyLoss(), _data(6, "ce", 0)
    f = curvature(model, lossfn, [BatchGrad(), DiagGGNExact()])
    torch.manual_seed(11)
    noise = masks(model, X)
    torch.manual_seed(11)
    a = f(X, y)
    b = f(X, y)  # the global state moved on: other masks
    torch.manual_seed(11)
    c = f(X, y)
    assert_same(a, c, "manual_seed reproduces")
    assert not torch.equal(a["grad"]["0.weight"], b["grad"]["0.weight"])
    packed = Packed(model, X, noise)
    assert_matches(a, reference(packed, lossfn, packed.pack(X, noise), y, hessian=False), "global state")


def test_generator_state_decides_the_masks():
    """Same generator state: identical results (every extension, products evaluated,
    Monte-Carlo with its own generator); another state: other results. The generator
    advances, so a second call with the same generator differs."""
    model, lossfn, (X, y) = _model("alpha", 0.3), nn.MSELoss(), _data(5, "mse", 1)

    def run(gen):
        exts = exact_extensions(kflr=True) + [DiagGGNMC(generator=seeded(4))]
        return curvature(model, lossfn, exts)(X, y, generator=gen)

    shapes = {n: tuple(q.shape) for n, q in model.named_parameters()}
    torch.manual_seed(0)
    a = run(seeded(7))
    torch.manual_seed(1)  # the global state does not matter with a generator
    b = run(seeded(7))
    assert_same(a, b, "same generator state", shapes)
    g = seeded(7)
    run(g)
    for other in (run(g), run(seeded(8))):
        for key in ("grad", "diag_ggn_exact", "diag_h", "diag_ggn_mc"):
            assert not torch.equal(a[key]["0.weight"], other[key]["0.weight"]), f"{key}: same masks"


def test_products_use_the_masks_of_their_call():
    """GGNMP and HMP on the identity have DiagGGNExact's and DiagHessian's diagonals of the
    same call, also when evaluated after other calls (other masks) and after the global
    random state changed; PCHMP equals the oracle with those masks."""
    model, lossfn, (X, y) = _model("plain", 0.5, act=nn.Sigmoid), nn.CrossEntropyLoss(), _data(5, "ce", 2)
    f = curvature(model, lossfn, [GGNMP(), HMP(), PCHMP(), DiagGGNExact(), DiagHessian()])
    first = f(X, y, generator=seeded(3))
    noise = masks(model, X, seeded(3))
    later = [f(X, y, generator=seeded(s)) for s in (4, 5)]
    torch.manual_seed(123)
    packed = Packed(model, X, noise)
    ref = reference(packed, lossfn, packed.pack(X, noise), y)
    for name, p in model.named_parameters():
        for prod, diag in (("ggnmp", "diag_ggn_exact"), ("hmp", "diag_h")):
            M = product_matrix(first[prod][name], p.shape)
            assert_close(M.diagonal().reshape(p.shape), first[diag][name], f"diag {prod}[{name}] = {diag}")
            assert not torch.equal(M.diagonal().reshape(p.shape), later[0][diag][name])
        assert_close(product_matrix(first["pchmp"][name], p.shape), ref["pchmp"][name], f"pchmp[{name}]")


@pytest.mark.parametrize("product", ["ggnmp", "hmp", "pchmp"])
def test_products_refuse_a_changed_training_mode(product):
    """A product re-runs its call's forward, whose modules read their training flag when it
    runs: after ``model.eval()`` it would silently use no dropout; it is refused, naming the
    module, and works again once the mode is back."""
    model, lossfn, (X, y) = _model("plain", 0.5, act=nn.Sigmoid), nn.CrossEntropyLoss(), _data(5, "ce", 2)
    ext = {"ggnmp": GGNMP(), "hmp": HMP(), "pchmp": PCHMP()}[product]
    qs = curvature(model, lossfn, [ext])(X, y, generator=seeded(3))
    name, p = next(iter(model.named_parameters()))
    V = torch.randn(2, *p.shape, dtype=p.dtype)
    before = qs[product][name](V)
    model.eval()
    with pytest.raises(CurvatureError, match="training mode of .* changed"):
        qs[product][name](V)
    model.train()
    assert torch.equal(qs[product][name](V), before), "the call's mode again"


def test_warned_once_per_curvature_object():
    model, (X, y) = _model("functional", 0.5), _data(4, "ce", 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f = curvature(model, nn.CrossEntropyLoss(), [BatchGrad()])
        for _ in range(3):
            f(X, y)
        curvature(model, nn.CrossEntropyLoss(), [BatchGrad()])(X, y)  # a new object warns again
    msgs = [str(w.message) for w in caught if "dropout in training mode" in str(w.message)]
    assert len(msgs) == 2, msgs
    assert "graph node" in msgs[0] and "generator=" in msgs[0] and "model.eval()" in msgs[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = curvature(model.eval(), nn.CrossEntropyLoss(), [BatchGrad()])
        assert_same(g(X, y), g(X, y), "eval mode: deterministic")
        model[2].follow_mode = False  # F.dropout(x, p): training=True whatever the mode
        with pytest.raises(UserWarning, match=r"dropout in training mode \(graph node"):
            curvature(model, nn.CrossEntropyLoss(), [BatchGrad()])(X, y)


@pytest.mark.parametrize("kind", ["plain", "2d"])
def test_kfra_with_dropout(kind):
    """KFRA through a dropout node: ``(1/N) Σ_n D_nᵀ G D_n`` with each sample's own mask
    ``D_n``, the KFRA recursion written out here on the masked chain."""
    torch.manual_seed(0)
    model, lossfn, (X, y) = _model(kind, 0.5), nn.CrossEntropyLoss(), _data(5, "ce", 3)
    noise = masks(model, X, seeded(9))
    qs = curvature(model, lossfn, [KFRA()])(X, y, generator=seeded(9))
    acts, mods = [X], list(model.named_children())
    with torch.no_grad():
        for name, m in mods:
            acts.append(fixed(m, acts[-1], noise[name]) if name in noise else m(acts[-1]))
    G = loss_hessian_blocks(lossfn, acts[-1], y).sum(0)
    packed = Packed(model, X, noise)
    Xp = packed.pack(X, noise)
    for k in reversed(range(len(mods))):
        name, m = mods[k]
        if isinstance(m, nn.Linear):
            B = G
            assert_close(qs["kfra"][f"{name}.bias"][0], B, f"kfra[{name}.bias]")
            assert_close(qs["kfra"][f"{name}.weight"][0], B, f"kfra[{name}.weight] B")
            assert_close(qs["kfra"][f"{name}.weight"][1], kron_input_factor(packed, Xp, name), f"kfra[{name}.weight] A")
        a = acts[k]
        total = 0
        for i in range(X.shape[0]):
            fn = (lambda t: fixed(m, t, noise[name][i:i + 1])) if name in noise else m  # noqa: E731
            J = jacrev(fn)(a[i:i + 1]).reshape(acts[k + 1][0].numel(), a[0].numel())
            total = total + J.T @ G @ J
        G = total / X.shape[0]


class Block(nn.Module):
    """A parametrized module without a rule (generic), with dropout inside."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(x * self.scale)


def test_dropout_inside_a_generic_layer_is_refused():
    model = nn.Sequential(nn.Linear(3, 4), Block(), nn.Linear(4, 2)).to(DT)
    X, y = _data(4, "ce", 0)
    with pytest.raises(CurvatureError, match=r"Layer '1' has no hand-written curvlib rule and holds dropout .*'1\.drop'"):
        curvature(model, nn.CrossEntropyLoss(), [BatchGrad()])(X, y)
    model[1].scale.requires_grad_(False)  # frozen: nothing recomputed per sample
    qs = curvature(model, nn.CrossEntropyLoss(), [BatchGrad()])(X, y)
    assert "1.scale" not in qs["grad_batch"]
    model[1].requires_grad_(True)
    model[1].drop.eval()
    curvature(model, nn.CrossEntropyLoss(), [BatchGrad()])(X, y)


class Untraced(nn.Sequential):
    """The chain with data-dependent control flow (run eagerly, first order)."""

    def forward(self, x):
        for m in self:
            x = m(x)
            if x.sum() < -1e9:
                x = x * 0
        return x


def test_untraced_model_masks_follow_the_generator():
    torch.manual_seed(0)
    model = Untraced(*_model("plain", 0.5)).to(DT)
    lossfn, (X, y) = nn.CrossEntropyLoss(), _data(6, "ce", 4)
    f = curvature(model, lossfn, exact_extensions(hessian=False)[:4])
    torch.manual_seed(1)
    a = f(X, y, generator=seeded(2))
    torch.manual_seed(2)
    assert_same(a, f(X, y, generator=seeded(2)), "untraced, same generator")
    noise = masks(model, X, seeded(2))
    packed = Packed(nn.Sequential(*model), X, noise)
    assert_matches(a, reference(packed, lossfn, packed.pack(X, noise), y, hessian=False), "untraced")


def test_batch_chunks_with_dropout():
    """Each slice draws its own masks (from the same generator): reproducible, and the
    individual gradients still sum to the gradient of the returned loss."""
    model, lossfn, (X, y) = _model("plain", 0.5), nn.CrossEntropyLoss(reduction="sum"), _data(7, "ce", 5)
    f = curvature(model, lossfn, [BatchGrad(), DiagGGNExact()], batch_chunk_size=3)
    a = f(X, y, generator=seeded(0))
    assert_same(a, f(X, y, generator=seeded(0)), "chunked")
    for name, g in a["grad"].items():
        assert_close(a["grad_batch"][name].sum(0), g, f"Σ grad_batch[{name}]")
