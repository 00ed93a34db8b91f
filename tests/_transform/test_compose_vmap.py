"""Every extension under ``torch.func.vmap``, and ensembles of models with buffers.

``vmap`` is specified as a loop (``vmap(g)(xs) == stack([g(x) for x in xs])``), so the
oracle of a vmapped call is the Python loop of per-member calls, which the rest of the
suite checks against brute force (per-sample ``vmap(grad)``, ``torch.func.hessian``, ...);
a few quantities are also checked here directly against the brute force vmapped.

Three ways to vmap ``f`` (``M`` members or tasks):

* ``params``: over stacked parameters (``torch.func.stack_module_state``),
  ``vmap(lambda p, b: f(X, y, params=p, buffers=b))``;
* ``task``: over a leading task dimension of ``X``/``y``, ``vmap(lambda X, y: f(X, y))``;
* ``both``: over both at once.

Models: an MLP, an MLP with LayerNorm, one with a functional ``F.layer_norm``, a CNN, a
GroupNorm CNN, a BatchNorm CNN (eval), ``nn.TransformerEncoderLayer`` (eval), a GRU, an
Embedding model and a ResNet block (BatchNorm, eval). Every member is its own model (its
own parameters and, for the BatchNorm models, its own running statistics), so a member
that silently used the base model's buffers fails.
Monte-Carlo extensions run with ``randomness="same"`` and the same seed as each loop
call (the default ``"error"`` refuses with torch's message, checked below). Block
products are applied to fixed vectors inside the vmapped function.
"""

from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import Tensor, nn
from torch.func import stack_module_state, vmap
from torch.utils import _pytree as pytree

from curvlib import CurvatureError, curvature
from curvlib.extensions import (
    GGNMP, HMP, KFAC, KFLR, KFRA, PCHMP, BatchDiagGGNExact, BatchDiagGGNMC, BatchDiagHessian, BatchGrad,
    BatchL2Grad, DiagGGNExact, DiagGGNMC, DiagHessian, SqrtGGNExact, SqrtGGNMC, SumGradSquared, Variance,
)
from oracles.models import BasicBlock, randomise_batchnorm
from oracles.on_device import CPU_ONLY, ON_CPU, seeded

DT = torch.float64
MODES = ("params", "task", "both")
PRODUCTS = ("ggnmp", "hmp", "pchmp")


def all_extensions() -> list:
    """One instance of every extension."""
    return [BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance(), DiagGGNExact(), DiagGGNMC(),
            BatchDiagGGNExact(), BatchDiagGGNMC(), DiagHessian(), BatchDiagHessian(), KFAC(), KFLR(), KFRA(),
            SqrtGGNExact(), SqrtGGNMC(), GGNMP(), HMP(), PCHMP()]


# ----------------------------------------------------------------------------- models


class Embedder(nn.Module):
    """``lin(tanh(emb(ids))).mean(1)``: token ids ``[N, T]``."""

    def __init__(self):
        super().__init__()
        self.emb, self.lin = nn.Embedding(7, 4), nn.Linear(4, 3)

    def forward(self, ids: Tensor) -> Tensor:
        return self.lin(torch.tanh(self.emb(ids))).mean(1)


class Recurrent(nn.Module):
    """A GRU over ``[N, T, 3]``, the last step's state into a Linear head."""

    def __init__(self):
        super().__init__()
        self.gru, self.head = nn.GRU(3, 4, batch_first=True), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.gru(x)[0][:, -1])


class Encoder(nn.Module):
    """``nn.TransformerEncoderLayer`` (eval, no dropout), mean-pooled into a Linear head."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.layer(x).mean(1))


class Residual(nn.Module):
    """A ResNet basic block (conv-bn-relu-conv-bn + shortcut, BatchNorm in eval) and a head."""

    def __init__(self):
        super().__init__()
        self.block, self.head = BasicBlock(2, 2), nn.Linear(2 * 16, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.flatten(self.block(x), 1))


class FunctionalNorm(nn.Module):
    """``F.layer_norm`` with a weight called in the forward (not a module): a graph node."""

    def __init__(self):
        super().__init__()
        self.inner, self.gain, self.head = nn.Linear(4, 5), nn.Parameter(torch.ones(5)), nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(torch.nn.functional.layer_norm(self.inner(x), (5,), self.gain)))


class Zoo(NamedTuple):
    build: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator, int], Tensor]  # (generator, N) -> X
    refused: tuple = ()  # extensions refused for the model at curvature(...) time


def _floats(*shape):
    return lambda gen, n: torch.randn((n,) + shape, generator=gen, dtype=DT)


ZOO: Dict[str, Zoo] = {
    "mlp": Zoo(lambda: nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)), _floats(4)),
    "layernorm": Zoo(lambda: nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 3)), _floats(4),
                     ("kfra",)),
    "cnn": Zoo(lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 3)), _floats(2, 4, 4)),
    "batchnorm": Zoo(lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Tanh(), nn.Flatten(),
                                           nn.Linear(12, 3)), _floats(2, 4, 4), ("kfra",)),
    "transformer": Zoo(Encoder, _floats(3, 4), ("kfra",)),
    "gru": Zoo(Recurrent, _floats(3, 3), ("kfra",)),
    "embedding": Zoo(Embedder, lambda gen, n: torch.randint(0, 7, (n, 3), generator=gen), ("kfra",)),
    "resnet": Zoo(Residual, _floats(2, 4, 4), ("kfra",)),
    "functional_layernorm": Zoo(FunctionalNorm, _floats(4), ("kfra",)),
    "groupnorm": Zoo(lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten(),
                                           nn.Linear(16, 3)), _floats(2, 4, 4), ("kfra",)),
}


def members(name: str, seed: int, m: int) -> List[nn.Module]:
    """``m`` float64 models in eval mode, each with its own parameters and BatchNorm statistics."""
    out = []
    for i in range(m):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1000 * seed + i)
            model = ZOO[name].build().to(DT).eval()
        out.append(randomise_batchnorm(model, seeded(1000 * seed + i)))
    return out


# ----------------------------------------------------------------------------- helpers


def directions(model: nn.Module, seed: int) -> Dict[str, Tensor]:
    """Two fixed vectors ``[2, *p.shape]`` per parameter, for the block products."""
    gen = seeded(seed + 7)
    return {k: torch.randn((2,) + tuple(p.shape), generator=gen, dtype=DT) for k, p in model.named_parameters()}


def evaluated(qs: Dict[str, object], vectors: Dict[str, Tensor]) -> Dict[str, object]:
    """``qs`` with every block product applied to ``vectors`` (a pytree of tensors)."""
    return {key: ({k: fn(vectors[k]) for k, fn in value.items()} if key in PRODUCTS else value)
            for key, value in qs.items()}


def seeded_call(fn: Callable, seed: int):
    """``fn()`` with the global random state seeded (Monte-Carlo draws), restored after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return fn()


def assert_member(got, ref, what: str) -> None:
    """Every leaf of ``got`` equals ``ref``'s, to 1e-10 of the largest entry of each result."""
    for key in ref:
        g, r = pytree.tree_leaves(got[key]), pytree.tree_leaves(ref[key])
        assert len(g) == len(r), (what, key)
        scale = max([float(t.abs().max()) for t in r if t.numel()] + [1e-30])
        for a, b in zip(g, r):
            assert a.shape == b.shape, (what, key, a.shape, b.shape)
            err = float((a - b).abs().max()) if a.numel() else 0.0
            assert err <= 1e-10 * scale, f"{what} {key}: {err:.3e} off (largest entry {scale:.3e})"


def member(tree, i: int):
    return pytree.tree_map(lambda t: t[i], tree)


def run_modes(name: str, seed: int, m: int, n: int, modes=MODES, exts=None) -> None:
    """vmapped ``f`` (each of ``modes``) equals the loop of per-member calls, member by member."""
    ens = members(name, seed, m)
    refused = ZOO[name].refused
    exts = [e for e in (exts or all_extensions()) if e.name not in refused]
    lossfn = nn.CrossEntropyLoss()
    f = curvature(ens[0], lossfn, exts)
    params, buffers = stack_module_state(ens)
    params = {k: v.detach() for k, v in params.items()}
    gen = seeded(seed)
    X, y = ZOO[name].inputs(gen, n), torch.randint(0, 3, (n,), generator=gen)
    Xs = torch.stack([ZOO[name].inputs(gen, n) for _ in range(m)])
    ys = torch.randint(0, 3, (m, n), generator=gen)
    vec = directions(ens[0], seed)
    # per member: its own model (own parameters and buffers), its own curvature object
    own = [curvature(model, lossfn, exts) for model in ens]
    calls = {
        "params": (lambda p, b: evaluated(f(X, y, params=p, buffers=b), vec), (params, buffers),
                   lambda i: evaluated(own[i](X, y), vec)),
        "task": (lambda X_, y_: evaluated(f(X_, y_), vec), (Xs, ys),
                 lambda i: evaluated(f(Xs[i], ys[i]), vec)),
        "both": (lambda p, b, X_, y_: evaluated(f(X_, y_, params=p, buffers=b), vec), (params, buffers, Xs, ys),
                 lambda i: evaluated(own[i](Xs[i], ys[i]), vec)),
    }
    for mode in modes:
        g, args, one = calls[mode]
        got = seeded_call(lambda: vmap(g, randomness="same")(*args), seed)
        for i in range(m):
            assert_member(member(got, i), seeded_call(lambda: one(i), seed), f"{name} vmap over {mode}, member {i}")


# ----------------------------------------------------------------------------- every extension, every model


HEAVY = ("transformer", "gru")  # ~10 s an example: fewer, smaller draws


@pytest.mark.parametrize("name", sorted(set(ZOO) - set(HEAVY)))
@settings(max_examples=2)
@given(seed=st.integers(0, 2**16), m=st.integers(2, 3), n=st.integers(2, 4))
def test_every_extension_under_vmap_equals_the_loop(name, seed, m, n):
    """vmap over params, over a task dimension and both: every extension (KFRA where the
    model is a chain) equals the per-member call, every member with its own buffers."""
    run_modes(name, seed, m, n)


@pytest.mark.parametrize("name", HEAVY)
@settings(max_examples=1)
@given(seed=st.integers(0, 2**16), n=st.integers(2, 3))
def test_every_extension_under_vmap_equals_the_loop_heavy(name, seed, n):
    """As above, for the transformer layer and the GRU: two members, vmapped over params
    and tasks at once (the three modes separately: the slow test below)."""
    run_modes(name, seed, 2, n, modes=("both",))


@pytest.mark.slow
@pytest.mark.parametrize("name", HEAVY)
@settings(max_examples=2)
@given(seed=st.integers(0, 2**16), m=st.integers(2, 3), n=st.integers(2, 4))
def test_every_extension_under_vmap_equals_the_loop_heavy_all_modes(name, seed, m, n):
    run_modes(name, seed, m, n)


@pytest.mark.parametrize("name", sorted(n for n, z in ZOO.items() if "kfra" in z.refused))
def test_refused_extensions_are_refused_before_any_work(name):
    """Where an extension is not defined for the model, it is a CurvatureError at
    ``curvature(...)`` or at the first call (inside vmap as outside), naming it."""
    model = members(name, 0, 1)[0]
    with pytest.raises(CurvatureError, match="KFRA"):
        f = curvature(model, nn.CrossEntropyLoss(), [KFRA()])
        X = ZOO[name].inputs(seeded(0), 2)
        vmap(lambda X_: f(X_, torch.zeros(2, dtype=torch.long))["kfra"])(X.unsqueeze(0))


def test_mse_and_bce_under_vmap():
    """Other losses' closed forms (their sampled roots included) under all three modes."""
    ens = members("layernorm", 3, 2)
    params = {k: v.detach() for k, v in stack_module_state(ens)[0].items()}
    gen = seeded(3)
    X = torch.randn(3, 4, generator=gen, dtype=DT)
    for lossfn, y in ((nn.MSELoss(), torch.randn(3, 3, generator=gen, dtype=DT)),
                      (nn.BCEWithLogitsLoss(), torch.rand(3, 3, generator=gen, dtype=DT))):
        exts = [BatchGrad(), DiagGGNExact(), DiagGGNMC(), DiagHessian(), KFAC(), SqrtGGNExact()]
        f = curvature(ens[0], lossfn, exts)
        got = seeded_call(lambda: vmap(lambda p: f(X, y, params=p), randomness="same")(params), 0)
        for i, model in enumerate(ens):
            ref = seeded_call(lambda: curvature(model, lossfn, exts)(X, y), 0)
            assert_member(member(got, i), ref, f"{type(lossfn).__name__} member {i}")


# ----------------------------------------------------------------------------- against brute force


def test_vmapped_against_brute_force():
    """Individual gradients and the Hessian diagonal of every member, vmapped, equal
    ``vmap`` over members of per-sample ``vmap(grad)`` and of ``torch.func.hessian``."""
    ens = members("layernorm", 5, 3)
    base = ens[0]
    params, _ = stack_module_state(ens)
    params = {k: v.detach() for k, v in params.items()}
    gen = seeded(5)
    X, y = torch.randn(4, 4, generator=gen, dtype=DT), torch.randint(0, 3, (4,), generator=gen)
    lossfn = nn.CrossEntropyLoss()
    f = curvature(base, lossfn, [BatchGrad(), DiagHessian()])
    got = vmap(lambda p: f(X, y, params=p))(params)

    def loss(p, x, t):
        return lossfn(torch.func.functional_call(base, p, (x,)), t)

    def per_sample(p):  # ℓ_n / N (reduction="mean")
        return vmap(torch.func.grad(lambda p_, x, t: loss(p_, x[None], t[None]) / X.shape[0]),
                    in_dims=(None, 0, 0))(p, X, y)

    def hessian_diag(p):
        flat, unflatten = torch.cat([v.reshape(-1) for v in p.values()]), _unflattener(p)
        return unflatten(torch.func.hessian(lambda v: loss(unflatten(v), X, y))(flat).diagonal())

    for key, brute in (("grad_batch", vmap(per_sample)(params)), ("diag_h", vmap(hessian_diag)(params))):
        scale = max(float(t.abs().max()) for t in brute.values())
        for k in brute:
            assert (got[key][k] - brute[k]).abs().max() <= 1e-10 * scale, (key, k)


def _unflattener(p: Dict[str, Tensor]):
    shapes = [(k, v.shape, v.numel()) for k, v in p.items()]

    def unflatten(flat: Tensor) -> Dict[str, Tensor]:
        out, i = {}, 0
        for k, shape, numel in shapes:
            out[k] = flat[i:i + numel].reshape(shape)
            i += numel
        return out

    return unflatten


# ----------------------------------------------------------------------------- randomness


def test_monte_carlo_randomness_modes():
    """Default ``randomness="error"`` refuses with torch's message; ``"different"`` draws
    per member (identical members then differ); ``"same"`` equals the loop (above)."""
    ens = members("mlp", 2, 1) * 3  # three identical members
    params = {k: v.detach() for k, v in stack_module_state(ens)[0].items()}
    gen = seeded(2)
    X, y = torch.randn(4, 4, generator=gen, dtype=DT), torch.randint(0, 3, (4,), generator=gen)
    f = curvature(ens[0], nn.CrossEntropyLoss(), [DiagGGNMC()])
    with pytest.raises(RuntimeError, match="randomness"):
        vmap(lambda p: f(X, y, params=p))(params)
    got = vmap(lambda p: f(X, y, params=p)["diag_ggn_mc"], randomness="different")(params)
    assert not torch.equal(got["0.weight"][0], got["0.weight"][1])


# ----------------------------------------------------------------------------- buffers


def _bn_ensemble(m: int = 3, seed: int = 4):
    ens = members("batchnorm", seed, m)
    params, buffers = stack_module_state(ens)
    gen = seeded(seed)
    X, y = torch.randn(4, 2, 4, 4, generator=gen, dtype=DT), torch.randint(0, 3, (4,), generator=gen)
    return ens, {k: v.detach() for k, v in params.items()}, buffers, X, y


def test_vmapped_params_without_buffers_are_refused():
    """The ensemble pattern of docs/transform.md over BatchNorm models without buffers used the base
    model's running statistics for every member (1.4 and 1.7 off); now refused before any
    work, naming the buffers and the fix."""
    ens, params, _, X, y = _bn_ensemble()
    for exts in ([BatchGrad()], [DiagGGNExact()], [HMP()]):
        f = curvature(ens[0], nn.CrossEntropyLoss(), exts)
        with pytest.raises(CurvatureError, match=r"vmap.*1\.running_mean.*stack_module_state"):
            vmap(lambda p: f(X, y, params=p))(params)


def test_buffers_in_params_or_buffers_equal_each_member():
    """``buffers=`` and buffer entries in ``params`` give each member's own results; no
    result has a buffer entry; the base model's buffers are unchanged."""
    ens, params, buffers, X, y = _bn_ensemble()
    exts = [BatchGrad(), DiagHessian(), KFLR(), HMP()]
    f = curvature(ens[0], nn.CrossEntropyLoss(), exts)
    before = {k: b.clone() for k, b in ens[0].named_buffers()}
    vec = directions(ens[0], 4)
    both = vmap(lambda p, b: evaluated(f(X, y, params=p, buffers=b), vec))(params, buffers)
    merged = vmap(lambda pb: evaluated(f(X, y, params=pb), vec))({**params, **buffers})
    for i, model in enumerate(ens):
        ref = evaluated(curvature(model, nn.CrossEntropyLoss(), exts)(X, y), vec)
        assert_member(member(both, i), ref, f"buffers=, member {i}")
        assert_member(member(merged, i), ref, f"buffers in params, member {i}")
    for qs in (both, merged):
        assert all(set(v) == set(params) for k, v in qs.items() if k != "loss")
    assert all(torch.equal(b, before[k]) for k, b in ens[0].named_buffers())


def test_buffers_outside_vmap_and_shared_buffers():
    """``f(X, y, params=q, buffers=c)`` is the model with parameters ``q`` and buffers ``c``;
    vmapped params with the model's own (unbatched) buffers are accepted; vmap over buffers
    alone and over a task dimension without params need no refusal."""
    ens, params, buffers, X, y = _bn_ensemble(2)
    f = curvature(ens[0], nn.CrossEntropyLoss(), [BatchGrad(), DiagGGNExact()])
    other = curvature(ens[1], nn.CrossEntropyLoss(), [BatchGrad(), DiagGGNExact()])
    q = {k: v.detach() for k, v in ens[1].named_parameters()}
    assert_member(f(X, y, params=q, buffers=dict(ens[1].named_buffers())), other(X, y), "one call with buffers=")
    shared = vmap(lambda p: f(X, y, params=p, buffers=dict(ens[0].named_buffers())))(params)
    mixed = curvature(ens[1], nn.CrossEntropyLoss(), [BatchGrad(), DiagGGNExact()])
    ref = mixed(X, y, params=q, buffers=dict(ens[0].named_buffers()))
    assert_member(member(shared, 1), ref, "vmapped params, shared buffers")
    # a block product evaluated after f returned swaps the call's buffers in again
    hmp = curvature(ens[0], nn.CrossEntropyLoss(), [HMP()])(X, y, params=q, buffers=dict(ens[1].named_buffers()))
    vec = directions(ens[1], 1)
    assert_member(evaluated({"hmp": hmp["hmp"]}, vec),
                  evaluated({"hmp": curvature(ens[1], nn.CrossEntropyLoss(), [HMP()])(X, y)["hmp"]}, vec), "HMP later")
    over_buffers = vmap(lambda b: f(X, y, buffers=b))(buffers)
    assert_member(member(over_buffers, 1), f(X, y, buffers=member(buffers, 1)), "vmap over buffers alone")
    Xs = torch.stack([X, X.flip(0)])
    tasks = vmap(lambda X_: f(X_, y))(Xs)
    assert_member(member(tasks, 1), f(Xs[1], y), "vmap over tasks, the model's buffers")


def test_bad_buffers_are_refused():
    ens, params, buffers, X, y = _bn_ensemble(1)
    f = curvature(ens[0], nn.CrossEntropyLoss(), [BatchGrad()])
    own = {k: b.clone() for k, b in ens[0].named_buffers()}
    bad = [
        ({"1.running_men": own["1.running_mean"]}, CurvatureError, "not a buffer of the model"),
        ({"1.running_mean": own["1.running_mean"][:2]}, CurvatureError, "shape"),
        ({"1.running_mean": own["1.running_mean"].float()}, CurvatureError, "dtype"),
        ({"1.running_mean": [0.0, 0.0, 0.0]}, TypeError, "must be a tensor"),
        ([own["1.running_mean"]], TypeError, "buffers must be a dict"),
    ]
    for buffers_, error, match in bad:
        with pytest.raises(error, match=match):
            f(X, y, buffers=buffers_)
    with pytest.raises(CurvatureError, match="both params and buffers"):
        f(X, y, params={"1.running_mean": own["1.running_mean"]}, buffers={"1.running_mean": own["1.running_mean"]})


def test_buffers_through_chunking_and_compiled_models():
    """``batch_chunk_size`` and a ``torch.compile``d model (``_orig_mod.`` names) take
    ``buffers=`` like the plain call."""
    ens, _, _, X, y = _bn_ensemble(2)
    q = {k: v.detach() for k, v in ens[1].named_parameters()}
    c = {k: b.clone() for k, b in ens[1].named_buffers()}
    exts = [BatchGrad(), DiagGGNExact()]
    ref = curvature(ens[1], nn.CrossEntropyLoss(), exts)(X, y)
    chunked = curvature(ens[0], nn.CrossEntropyLoss(), exts, batch_chunk_size=3)
    assert_member(chunked(X, y, params=q, buffers=c), ref, "batch_chunk_size")
    wrapped = curvature(torch.compile(ens[0]), nn.CrossEntropyLoss(), exts)
    out = wrapped(X, y, params={"_orig_mod." + k: v for k, v in q.items()},
                  buffers={"_orig_mod." + k: v for k, v in c.items()})
    assert_member(out, {k: ({"_orig_mod." + n: t for n, t in v.items()} if k != "loss" else v) for k, v in ref.items()},
                  "torch.compile'd model")


def test_buffers_through_compile():
    """``compile=True`` takes ``buffers=`` (program inputs, like the model's), also inside a
    user's ``torch.compile(step, fullgraph=True)``."""
    ens, _, _, X, y = _bn_ensemble(2)
    q = {k: v.detach() for k, v in ens[1].named_parameters()}
    c = {k: b.clone() for k, b in ens[1].named_buffers()}
    exts = [BatchGrad(), DiagGGNExact()]
    ref = curvature(ens[1], nn.CrossEntropyLoss(), exts)(X, y)
    compiled = curvature(ens[0], nn.CrossEntropyLoss(), exts, compile={"backend": "eager"})
    assert_member(compiled(X, y, params={**q, **c}), ref, "compile=True")
    assert_member(compiled(X, y), curvature(ens[0], nn.CrossEntropyLoss(), exts)(X, y), "compile=True, own")
    # a user's fullgraph step through the compiled f, buffers passed inside it
    step = torch.compile(lambda X_, p, b: compiled(X_, y, params=p, buffers=b), fullgraph=True, backend="eager")
    assert_member(step(X, q, c), ref, "compile=True inside a fullgraph step")


def test_buffered_and_own_buffer_calls_from_threads():
    """A call with ``buffers=`` swaps them into the model's slots; calls reading the
    model's own buffers from other threads at the same time never see them."""
    import threading

    ens, _, _, X, y = _bn_ensemble(2)
    f = curvature(ens[0], nn.CrossEntropyLoss(), [BatchGrad()])
    q = {k: v.detach() for k, v in ens[1].named_parameters()}
    c = {k: b.clone() for k, b in ens[1].named_buffers()}
    refs = [f(X, y, params=q), f(X, y, params=q, buffers=c)]
    errors: list = []

    def work(buffered: int):
        try:
            for _ in range(6):
                out = f(X, y, params=q, buffers=c if buffered else None)
                assert_member(out, refs[buffered], f"thread with buffers={bool(buffered)}")
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i % 2,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


@pytest.mark.skipif(not ON_CPU, reason=CPU_ONLY + " (gloo in this process)")
def test_buffers_through_a_process_group(tmp_path):
    """``process_group`` (world size 1 in this process) passes ``buffers=`` on."""
    from datetime import timedelta

    import torch.distributed as dist

    if dist.is_initialized():  # pragma: no cover
        pytest.skip("a process group is already initialised in this process")
    ens, _, _, X, y = _bn_ensemble(2)
    q = {k: v.detach() for k, v in ens[1].named_parameters()}
    c = {k: b.clone() for k, b in ens[1].named_buffers()}
    exts = [BatchGrad(), DiagGGNExact()]
    ref = curvature(ens[1], nn.CrossEntropyLoss(), exts)(X, y)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        f = curvature(ens[0], nn.CrossEntropyLoss(), exts, process_group=dist.group.WORLD)
        assert_member(f(X, y, params=q, buffers=c), ref, "process_group")
        params, buffers = stack_module_state(ens)
        with pytest.raises(CurvatureError, match="process_group.*vmap"):
            vmap(lambda p, b: f(X, y, params=p, buffers=b))(params, buffers)
    finally:
        dist.destroy_process_group()


def test_chunking_and_process_group_under_vmap():
    """``batch_chunk_size`` under vmap over params (and over tasks with MSE) equals the
    unchunked call; over the targets of a mean cross-entropy (slices weighted by host-read
    counts) and with ``process_group`` (collectives have no vmap rule) it is refused
    before any work, naming the transform."""
    ens = members("mlp", 6, 2)
    params = {k: v.detach() for k, v in stack_module_state(ens)[0].items()}
    gen = seeded(6)
    X, Xs = torch.randn(5, 4, generator=gen, dtype=DT), torch.randn(2, 5, 4, generator=gen, dtype=DT)
    y, ys = torch.randint(0, 3, (5,), generator=gen), torch.randint(0, 3, (2, 5), generator=gen)
    exts = [BatchGrad(), Variance(), DiagGGNExact(), SqrtGGNExact(), KFLR()]
    chunked = curvature(ens[0], nn.CrossEntropyLoss(), exts, batch_chunk_size=2)
    whole = curvature(ens[0], nn.CrossEntropyLoss(), exts)
    got = vmap(lambda p: chunked(X, y, params=p))(params)
    assert_member(member(got, 1), whole(X, y, params=member(params, 1)), "chunked, vmap over params")
    with pytest.raises(CurvatureError, match="batch_chunk_size.*vmap over y"):
        vmap(lambda X_, y_: chunked(X_, y_))(Xs, ys)
    targets = torch.randn(2, 5, 3, generator=gen, dtype=DT)
    mse = curvature(ens[0], nn.MSELoss(), exts, batch_chunk_size=2)
    got = vmap(lambda X_, y_: mse(X_, y_))(Xs, targets)
    assert_member(member(got, 1), curvature(ens[0], nn.MSELoss(), exts)(Xs[1], targets[1]), "chunked MSE, tasks")


def test_dropout_under_vmap():
    """Dropout in training mode: ``randomness="same"`` equals each member's own call with the
    same generator state; ``"different"`` (one seed per member) is refused before any work,
    ``"error"`` fails with torch's message."""
    import warnings

    ens = members("mlp", 8, 2)
    for model in ens:
        model.insert(1, nn.Dropout(0.5))
        model.train()
    params = {k: v.detach() for k, v in stack_module_state(ens)[0].items()}
    gen = seeded(8)
    X, y = torch.randn(5, 4, generator=gen, dtype=DT), torch.randint(0, 3, (5,), generator=gen)
    exts = [BatchGrad(), DiagHessian()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # curvlib's "dropout makes results random"
        f = curvature(ens[0], nn.CrossEntropyLoss(), exts)
        got = vmap(lambda p: f(X, y, params=p, generator=seeded(3)), randomness="same")(params)
        for i, model in enumerate(ens):
            ref = curvature(model, nn.CrossEntropyLoss(), exts)(X, y, generator=seeded(3))
            assert_member(member(got, i), ref, f"dropout, member {i}")
        with pytest.raises(CurvatureError, match="randomness='different'"):
            vmap(lambda p: f(X, y, params=p), randomness="different")(params)
        with pytest.raises((RuntimeError, CurvatureError), match="randomness"):
            vmap(lambda p: f(X, y, params=p))(params)
