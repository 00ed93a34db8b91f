"""curvlib beyond Sequential: an architecture zoo and random graphs, against brute force.

Every architecture of :mod:`models` (ResNet with BatchNorm, a transformer
encoder block, a tied autoencoder, in-place activations, gating, concatenated
branches, module reuse, functional ops) and random DAGs drawn by hypothesis
(Linear layers, smooth and piecewise-linear activations, skip additions,
``torch.cat``, a module used several times, products of two branches, means)
are checked for

* first order against ``oracles.checks.check_first_order`` (per-sample copies);
* the GGN family (DiagGGNExact, BatchDiagGGNExact, SqrtGGNExact, GGNMP) and
  HMP against ``oracles.checks.check_second_order``;
* the Hessian family (DiagHessian, BatchDiagHessian, PCHMP): where the
  residual oracle of ``oracles.second_order`` is complete (every smooth
  nonlinearity an activation module) by ``check_second_order(hessian=True)``;
  elsewhere by :func:`check_hessian_family` (exact diagonals from
  ``torch.func`` Hessians; PCHMP's full blocks against ``oracles.pchmp``,
  or, for in-place operations, symmetric and above both the GGN and the
  Hessian in the Loewner order).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import Tensor, nn

from curvlib import curvature
from curvlib.extensions import DiagHessian

from oracles import models
from oracles.checks import check_first_order, check_hessian_family, check_second_order
from oracles.on_device import seeded

DT = torch.float64
# ----------------------------------------------------------------------------- the zoo

ZOO = sorted(models.ZOO)

# Per architecture: its non-element-wise nonlinear nodes (where PCHMP modifies the
# eigenvalues of a dense or structured residual; None: element-wise only), and whether the residual
# oracle is complete for it (every smooth nonlinearity a module). DiagHessian and
# BatchDiagHessian are exact on every architecture.
HESSIAN = {
    "resnet": (None, True),
    "branch_cat": (None, True),
    "functional": (None, False),  # F.gelu: functional smooth nonlinearity
    "standardised_conv": ("weight standardisation (a dense residual per functional convolution)", False),
    # relu_ after a Linear: RuntimeError "Output 0 of View is a view and is being modified inplace"
    "inplace": ("in-place tensor methods (relu_)", True),
    # nn.ELU(inplace=True): also the bug of test_inplace_smooth_activation_hessian
    # (and the residual oracle reads the overwritten input, hence not exact_pchmp)
    "inplace_smooth": ("in-place tensor methods (relu_), in-place smooth activations", False),
    "gated": ("products of two branches (x * σ(gate(x)))", False),
    "reused": ("a module used twice", True),
    "autoencoder_shared": ("tied weights (generic rule, shared Parameter)", True),
    "autoencoder_functional": ("tied weights (parameter read in the forward)", True),
    "transformer": ("softmax, q·kᵀ products, LayerNorm, a parameter module (generic rule)", False),
    "transformer_per_token": ("softmax, q·kᵀ products, LayerNorm, a parameter module (generic rule)", False),
}


def _hessian_param(name):
    return pytest.param(name, id=name)


@pytest.mark.parametrize("name", ZOO)
@pytest.mark.parametrize("seed", [0, 1])
def test_zoo_first_order(name, seed):
    c = models.ZOO[name](seed)
    check_first_order(c.model, c.lossfn, c.X, c.y)


@pytest.mark.parametrize("name", ZOO)
def test_zoo_ggn_family(name):
    c = models.ZOO[name](0)
    check_second_order(c.model, c.lossfn, c.X, c.y, hessian=False, hmp=True)


@pytest.mark.parametrize("name", [_hessian_param(n) for n in ZOO])
def test_zoo_hessian_family(name):
    c = models.ZOO[name](0)
    blocked, exact = HESSIAN[name]
    check_hessian_family(c.model, c.lossfn, c.X, c.y, exact_pchmp=exact, pchmp_optional=blocked is not None)


def test_inplace_smooth_activation_hessian():
    """``nn.ELU(inplace=True)`` (no in-place tensor method). The Hessian family
    needs ``φ''`` at the activation's *input*, which the in-place op
    overwrites (curvlib keeps a copy taken before the node runs, and aliases
    the overwritten input to the output); compared with ``torch.func``
    Hessians directly, since the residual oracle's hook sees the overwritten input."""
    gen, X = models._float(0, 3, 4)
    c = models._case(models.InplaceNet(smooth=True, method=False).to(DT), nn.CrossEntropyLoss(), X, gen)
    check_first_order(c.model, c.lossfn, c.X, c.y)
    check_second_order(c.model, c.lossfn, c.X, c.y, hessian=False, hmp=True)
    check_hessian_family(c.model, c.lossfn, c.X, c.y, exact_pchmp=False)


def test_inplace_piecewise_linear_hessian():
    gen, X = models._float(0, 3, 4)
    c = models._case(models.InplaceNet(smooth=False, method=False).to(DT), nn.CrossEntropyLoss(), X, gen)
    check_second_order(c.model, c.lossfn, c.X, c.y, hessian=True, hmp=True)


@pytest.mark.parametrize("pool", ["mean", "none"])
def test_transformer_without_attention_parameters_frozen(pool):
    """Quantities only for the trainable subset (frozen embedding and positions)."""
    c = models.transformer(2, pool=pool)
    c.model.embed.weight.requires_grad_(False)
    c.model.positions.pos.requires_grad_(False)
    qs = check_first_order(c.model, c.lossfn, c.X, c.y)
    assert "embed.weight" not in qs["grad_batch"] and "attn.q.weight" in qs["grad_batch"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_resnet_seeds_all_families(seed):
    c = models.resnet(seed, n=3)
    check_first_order(c.model, c.lossfn, c.X, c.y)
    check_second_order(c.model, c.lossfn, c.X, c.y, hessian=True, hmp=True)


# ----------------------------------------------------------------------------- random graphs

WIDTH, POSITIONS, CLASSES = 3, 2, 2
ACTIVATIONS = {
    "relu": nn.ReLU,
    "leaky": lambda: nn.LeakyReLU(0.3),
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "gelu": nn.GELU,
    "elu": nn.ELU,
    "softplus": nn.Softplus,
    "silu": nn.SiLU,
}
FUNCTIONAL = {"f_relu": F.relu, "f_tanh": torch.tanh, "f_gelu": F.gelu}


class RandomDAG(nn.Module):
    """Interprets a spec: a list of nodes, each ``(op, arg, i, j)`` on earlier values.

    Values are ``[N, POSITIONS, WIDTH]``; value 0 is a Linear stem applied to
    the input (so that every nonlinearity has parameters upstream). Ops:
    ``linear`` (a fresh Linear on value ``i``), ``shared`` (one Linear shared
    by every such node), ``act`` (activation ``arg``, a module or a function),
    ``add`` (skip connection ``h_i + h_j``), ``mul`` (``h_i * h_j``), ``cat``
    (a Linear on ``cat([h_i, h_j], -1)``), ``mean`` (``h_i`` minus half its
    mean over the positions). The head maps the last value to
    ``[N, POSITIONS * CLASSES]``.
    """

    def __init__(self, spec: Sequence[Tuple[str, str, int, int]]):
        super().__init__()
        assert all(i <= k and j <= k for k, (_, _, i, j) in enumerate(spec)), spec
        self.spec = list(spec)
        self.layers = nn.ModuleDict()
        self.acts = nn.ModuleDict()
        for k, (op, arg, _, _) in enumerate(self.spec):
            if op == "linear":
                self.layers[str(k)] = nn.Linear(WIDTH, WIDTH)
            elif op == "cat":
                self.layers[str(k)] = nn.Linear(2 * WIDTH, WIDTH)
            elif op == "act" and arg in ACTIVATIONS:
                self.acts[str(k)] = ACTIVATIONS[arg]()
        if any(op == "shared" for op, *_ in self.spec):
            self.shared = nn.Linear(WIDTH, WIDTH)
        self.stem = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        h: List[Tensor] = [self.stem(x)]
        for k, (op, arg, i, j) in enumerate(self.spec):
            if op == "linear":
                v = self.layers[str(k)](h[i])
            elif op == "shared":
                v = self.shared(h[i])
            elif op == "act":
                v = self.acts[str(k)](h[i]) if arg in ACTIVATIONS else FUNCTIONAL[arg](h[i])
            elif op == "add":
                v = h[i] + h[j]
            elif op == "mul":
                v = h[i] * h[j]
            elif op == "cat":
                v = self.layers[str(k)](torch.cat([h[i], h[j]], dim=-1))
            else:  # mean
                v = h[i] - 0.5 * h[i].mean(dim=1, keepdim=True)
            h.append(v)
        return self.head(h[-1]).flatten(1)


OPS_ALL = ("act", "linear", "shared", "add", "mul", "cat", "mean")


@st.composite
def dags(draw, ops=OPS_ALL, require=(), functional=True):
    """A spec of 1-4 nodes, most followed by an activation; ``require``: one
    of these ops must occur. Inputs shrink towards the latest value (a chain)."""
    size = draw(st.integers(1, 4))
    act_names = sorted(ACTIVATIONS, key=lambda a: a in ("relu", "leaky")) + (sorted(FUNCTIONAL) if functional else [])
    spec: List[Tuple[str, str, int, int]] = []
    forced = draw(st.sampled_from(require)) if require else None
    forced_at = draw(st.integers(0, size - 1)) if require else -1
    for k in range(size):
        op = forced if k == forced_at else draw(st.sampled_from(ops))
        last = len(spec)
        i = last - draw(st.integers(0, last))
        j = last - draw(st.integers(0, last))
        arg = draw(st.sampled_from(act_names)) if op == "act" else ""
        spec.append((op, arg, i, j))
        if op != "act" and not draw(st.booleans()):  # shrinks towards "followed by an activation"
            spec.append(("act", draw(st.sampled_from(act_names)), len(spec), 0))
    return spec


LOSSES = {"mse": nn.MSELoss, "ce": nn.CrossEntropyLoss, "bce": nn.BCEWithLogitsLoss}


def _dag_case(spec, n, loss, reduction, seed):
    torch.manual_seed(seed)
    model = RandomDAG(spec).to(DT)
    gen = seeded(seed + 1)
    X = torch.randn(n, POSITIONS, WIDTH, generator=gen, dtype=DT)
    lossfn = LOSSES[loss](reduction=reduction)
    with torch.no_grad():
        out = model(X)
    return model, lossfn, X, models._targets(lossfn, out, gen)


_draws = dict(
    n=st.integers(1, 3),
    loss=st.sampled_from(sorted(LOSSES)),
    reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**16),
)


@given(spec=dags(), **_draws)
def test_random_dag_first_order(spec, n, loss, reduction, seed):
    model, lossfn, X, y = _dag_case(spec, n, loss, reduction, seed)
    check_first_order(model, lossfn, X, y)


@given(spec=dags(), **_draws)
def test_random_dag_ggn_family(spec, n, loss, reduction, seed):
    model, lossfn, X, y = _dag_case(spec, n, loss, reduction, seed)
    check_second_order(model, lossfn, X, y, hessian=False, hmp=True, seed=seed)


SUPPORTED_OPS = ("act", "linear", "add", "cat", "mean")


@given(spec=dags(ops=SUPPORTED_OPS), **_draws)
def test_random_dag_hessian_family(spec, n, loss, reduction, seed):
    model, lossfn, X, y = _dag_case(spec, n, loss, reduction, seed)
    exact = not any(op == "act" and arg in FUNCTIONAL and arg != "f_relu" for op, arg, _, _ in spec)
    check_hessian_family(model, lossfn, X, y, exact_pchmp=exact)


def _probe(spec) -> None:
    """Run DiagHessian once on a tiny graph: raises ``ValueError`` while curvlib refuses it.

    The random-graph properties below start with this probe so that, while
    the feature is refused, the expected failure costs one call instead of
    a hypothesis search and shrink."""
    model, lossfn, X, y = _dag_case(spec, 2, "mse", "sum", 0)
    curvature(model, lossfn, [DiagHessian()])(X, y)


@settings(max_examples=10)
@given(spec=dags(ops=SUPPORTED_OPS + ("mul",), require=("mul",), functional=False), **_draws)
def _products_property(spec, n, loss, reduction, seed):
    model, lossfn, X, y = _dag_case(spec, n, loss, reduction, seed)
    check_hessian_family(model, lossfn, X, y, exact_pchmp=False, pchmp_optional=True)


@settings(max_examples=10)
@given(spec=dags(ops=SUPPORTED_OPS + ("shared",), require=("shared",), functional=False), **_draws)
def _shared_property(spec, n, loss, reduction, seed):
    model, lossfn, X, y = _dag_case(spec, n, loss, reduction, seed)
    check_hessian_family(model, lossfn, X, y, exact_pchmp=False, pchmp_optional=True)


def test_random_dag_hessian_family_products():  # PCHMP may be refused on products by design
    _probe([("linear", "", 0, 0), ("act", "tanh", 1, 0), ("mul", "", 1, 2)])
    _products_property()


def test_random_dag_hessian_family_shared():
    _probe([("shared", "", 0, 0), ("act", "tanh", 1, 0), ("shared", "", 2, 0)])
    _shared_property()


@pytest.mark.slow
@settings(max_examples=60)
@given(spec=dags(), **_draws)
def test_random_dag_all_families_thorough(spec, n, loss, reduction, seed):
    model, lossfn, X, y = _dag_case(spec, n, loss, reduction, seed)
    check_first_order(model, lossfn, X, y)
    check_second_order(model, lossfn, X, y, hessian=False, hmp=True, seed=seed)


@torch.fx.wrap
def _shift_in_place(h: Tensor) -> Tensor:
    """An in-place change fx cannot see (a wrapped function): curvlib's version check must."""
    return h.mul_(0.5).add_(1.0)


class _HiddenInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        return self.b(torch.tanh(_shift_in_place(self.a(x))))


def test_in_place_change_hidden_from_the_trace():
    """A site's output overwritten in place behind fx's back: curvlib notices (the
    tensor's version moved) and differentiates through zero probes instead."""
    from curvlib._trace.graph_facts import has_inplace
    from curvlib._trace.program import trace_program
    torch.manual_seed(0)
    model = _HiddenInPlace().double()
    assert not has_inplace(trace_program(model))
    X = torch.randn(6, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    check_first_order(model, nn.CrossEntropyLoss(), X, y)
    check_second_order(model, nn.CrossEntropyLoss(), X, y, hessian=False)


class _ComputedWeightConv(nn.Module):
    """``F.conv{1,2}d(x, h(W), b, stride, padding, dilation, groups)`` with ``h`` a scale and shift
    of the weight per output channel (a weight computed from parameters: the functional
    convolution's fast per-sample path, :func:`curvlib.rules.functional._conv_grad_batch`);
    ``computed``: the padding computed in ``forward`` from the weight's shape (a graph value,
    not a number written in the graph: the generic path)."""

    def __init__(self, dims, groups, stride, padding, dilation, bias, computed=False):
        super().__init__()
        self.computed = computed
        # the reduced dims written out: torch.fx traces the model (``range(1, W.dim())`` sends it to
        # the ATen-level trace, where the padding would be a number again)
        self.reduce = tuple(range(1, dims + 2)) if computed else None
        self.conv = (F.conv1d, F.conv2d)[dims - 1]
        self.options = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
        self.weight = nn.Parameter(torch.randn((4, 4 // groups) + (3,) * dims))
        self.gain = nn.Parameter(1 + 0.1 * torch.randn((4,) + (1,) * (dims + 1)))
        self.bias = nn.Parameter(torch.randn(4)) if bias else None
        self.head = nn.LazyLinear(3)

    def forward(self, x):
        dims = self.reduce if self.computed else tuple(range(1, self.weight.dim()))
        w = self.gain * (self.weight - self.weight.mean(dim=dims, keepdim=True))
        options = dict(self.options)
        if self.computed:  # (as Liquid's causal_conv1d_fn: from the computed weight's kernel size, 3)
            options["padding"] = w.shape[-1] // 3 * options["padding"]
        return self.head(torch.tanh(self.conv(x, w, self.bias, **options)).flatten(1))


@settings(max_examples=12, deadline=None)
@given(dims=st.sampled_from([1, 2]), groups=st.sampled_from([1, 2]), stride=st.integers(1, 2),
       padding=st.integers(0, 1), dilation=st.integers(1, 2), bias=st.booleans(), computed=st.booleans(),
       n=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_convolution_with_a_computed_weight_first_order(dims, groups, stride, padding, dilation, bias, computed, n,
                                                         seed):
    torch.manual_seed(seed)
    model = _ComputedWeightConv(dims, groups, stride, padding, dilation, bias, computed)
    X = torch.randn((n, 4) + (7,) * dims, generator=seeded(seed), dtype=torch.float32)
    model(X)  # (materialise the lazy head)
    model = model.to(DT)
    check_first_order(model, nn.CrossEntropyLoss(), X.to(DT), torch.randint(0, 3, (n,), generator=seeded(seed + 1)))
