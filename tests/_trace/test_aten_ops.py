"""The ATen graph's vocabulary (src/curvlib/_trace/aten_ops.py) on parameter uses that are no module's forward.

Models that need the ATen-level front end (keyword inputs) and

* own a parameter that ``F.linear``/``F.conv1d`` uses although the module is no Linear/Conv
  (transformers 5's MoE router applying its own weight, returning a tuple): a Linear or
  functional site, never a crash;
* hold a ``weight_norm``-parametrized layer (wav2vec2's positional convolution: parameters
  ``original0``/``original1``, the weight a function of them): a functional site (torch
  forbids copying such a module);
* call ``Tensor.to`` with its full argument list (``dtype=``, ``device=``, ``copy=``,
  ``memory_format=``, another tensor).

BatchGrad, DiagGGNExact and KFLR against the float64 brute force of
tests/oracles/zoo_reference.py, over drawn layouts and wrappers (hypothesis).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from oracles.on_device import seeded
from oracles.zoo import Problem
from oracles.zoo_checks import check_exact

DT = torch.float64


class Router(nn.Module):
    """Owns ``weight`` and applies it with ``F.linear`` (or ``F.conv1d`` over tokens); returns a tuple."""

    def __init__(self, op):
        super().__init__()
        self.op = op
        self.weight = nn.Parameter(torch.randn(4, 4, 1 if op == "conv1d" else 4)[..., 0] if op != "conv1d"
                                   else torch.randn(4, 4, 1))

    def forward(self, h):
        if self.op == "conv1d":
            logits = F.conv1d(h.transpose(1, 2), self.weight).transpose(1, 2)
        else:
            logits = F.linear(h, self.weight)
        return logits, logits.softmax(-1)


class Net(nn.Module):
    def __init__(self, op, part):
        super().__init__()
        self.emb, self.head, self.part = nn.Linear(3, 4), nn.Linear(4, 3), part
        self.router = Router(op)
        self.conv = weight_norm(nn.Conv1d(4, 4, 3, padding=1))

    def forward(self, inp, scale):
        scale = scale.to(dtype=inp.dtype, device=inp.device) * scale.to(torch.float64, copy=True,
                                                                        memory_format=torch.contiguous_format)
        h = self.emb(inp) * scale  # [N, T, 4]
        logits, probs = self.router(h)
        h = h + (probs if self.part == "probs" else logits)
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2).to(h, copy=True)
        return self.head(h).mean(1)


class Wrapper(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, inp, scale):
        return {"out": self.net(inp=inp, scale=scale)}


@settings(max_examples=6, deadline=None)
@given(op=st.sampled_from(["linear", "conv1d"]), part=st.sampled_from(["logits", "probs"]),
       wrap=st.booleans(), seed=st.integers(0, 50))
def test_parameter_uses_that_are_no_modules_forward(op, part, wrap, seed):
    torch.manual_seed(seed)
    g = seeded(seed)
    net = Net(op, part).to(DT).eval()
    X = {"inp": torch.randn(3, 5, 3, generator=g, dtype=DT), "scale": torch.rand(3, 5, 1, generator=g) + 0.5}
    y = torch.randint(0, 3, (3,), generator=g)
    check_exact(Problem(Wrapper(net) if wrap else net, X, y, nn.CrossEntropyLoss(), "out" if wrap else None, ""))


def test_weight_norm_layer_is_not_copied_nor_changed():
    """The parametrized convolution's parameters get entries; the model keeps its parametrization."""
    from curvlib import curvature
    from curvlib.extensions import BatchGrad

    net = Net("linear", "logits").to(DT).eval()
    X = {"inp": torch.randn(3, 5, 3, dtype=DT), "scale": torch.rand(3, 5, 1)}
    qs = curvature(net, nn.CrossEntropyLoss(), [BatchGrad()])(X, torch.tensor([0, 1, 2]))
    assert {"conv.parametrizations.weight.original0", "conv.parametrizations.weight.original1"} <= set(qs["grad_batch"])
    assert type(net.conv).__name__ == "ParametrizedConv1d" and "weight" not in net.conv._parameters


class MatmulLinear(nn.Module):
    """``lin``'s weight applied by a ``matmul`` instead of ``lin(x)``: ``x @ W.T`` (Falcon's
    ``FalconLinear``), ``x @ Wᵀ`` with ``Wᵀ`` stored ``[in, out]`` (``"x_w"``), or ``W @ h`` with the
    features in dim -2 and the positions last (Mamba's ``dt_proj.weight @ h``); ``use_module``:
    the twin calling ``lin(x)``. An assertion on the input's shape keeps torch.fx out."""

    def __init__(self, form, d, h, c=3, use_module=False):
        super().__init__()
        self.form, self.use_module = form, use_module
        self.lin, self.head = nn.Linear(d, h), nn.Linear(h, c)
        self.w = nn.Parameter(self.lin.weight.detach().t().clone()) if form == "x_w" else None

    def _apply_lin(self, x):
        if self.use_module:
            return self.lin(x)
        if self.form == "x_wt":
            return x @ self.lin.weight.T + self.lin.bias
        if self.form == "x_w":
            return x @ self.w + self.lin.bias
        return (self.lin.weight @ x.transpose(1, 2)).transpose(1, 2) + self.lin.bias

    def forward(self, x):
        if not isinstance(x.shape[-1], int):  # pragma: no cover - fx gives a proxy: make_fx traces
            raise TypeError
        return self.head(torch.tanh(self._apply_lin(x))).sum(1)


@settings(max_examples=8, deadline=None)
@given(form=st.sampled_from(["x_wt", "x_w", "w_x"]), n=st.integers(1, 3), s=st.integers(1, 3),
       approx=st.sampled_from([None, "expand"]), seed=st.integers(0, 2**16))
def test_a_weight_applied_by_matmul_has_the_kronecker_factors_of_its_linear(form, n, s, approx, seed):
    """``x @ W.T``, ``x @ Wᵀ`` and ``W @ x`` are ``F.linear`` sites: ``W``'s KFLR factors are the
    brute-force ``B`` (per-position output offsets) and ``A`` (the inputs) of the ``nn.Linear`` twin
    (oracles.kron), ``[A, B]`` for the weight stored ``[in, out]``."""
    from curvlib import curvature
    from curvlib.extensions import KFLR
    from oracles.kron import input_factors, output_factors
    from oracles.reference import assert_close

    g = seeded(seed)
    torch.manual_seed(seed)
    model = MatmulLinear(form, 3, 4).to(DT)
    twin = MatmulLinear(form, 3, 4, use_module=True).to(DT)
    twin.load_state_dict(model.state_dict())
    X, y = torch.randn(n, s, 3, generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g)
    lossfn = nn.CrossEntropyLoss()
    got = curvature(model, lossfn, [KFLR(kfac_approx=approx)])(X, y)["kflr"]
    B_expand, B_reduce = output_factors(twin, lossfn, X, y, "lin")
    A_backpack, A_expand, _ = input_factors(twin, X, "lin")
    B, A = (B_expand, A_expand) if approx == "expand" else (B_reduce, A_backpack)
    factors = got["w"] if form == "x_w" else got["lin.weight"]
    want = [A, B] if form == "x_w" else [B, A]
    assert [tuple(f.shape) for f in factors] == [tuple(f.shape) for f in want]
    for f, w, what in zip(factors, want, "12"):
        assert_close(f, w, f"{form} factor {what}")


class ComputedBiasLinear(nn.Module):
    """``F.linear(x, lin.weight, b)`` with the bias computed in ``forward`` from a smaller parameter
    and zeros (BEiT's ``cat((q_bias, zeros, v_bias))``); ``use_module``: the twin ``lin(x) + b``;
    ``aten``: torch.fx cannot trace it (the ATen front end runs), else it can."""

    def __init__(self, d, h, c=3, use_module=False, aten=True):
        super().__init__()
        self.use_module, self.aten = use_module, aten
        self.lin, self.head = nn.Linear(d, h, bias=False), nn.Linear(h, c)
        self.q_bias = nn.Parameter(torch.randn(h // 2 + 1))

    def forward(self, x):
        if self.aten and not isinstance(x.shape[-1], int):  # pragma: no cover - fx gives a proxy: make_fx traces
            raise TypeError
        b = torch.cat((self.q_bias, self.q_bias.new_zeros(self.lin.out_features - self.q_bias.numel())))
        h = self.lin(x) + b if self.use_module else F.linear(x, self.lin.weight, b)
        return self.head(torch.tanh(h)).sum(1)


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 3), s=st.integers(1, 3), h=st.integers(2, 5), approx=st.sampled_from([None, "expand"]),
       aten=st.booleans(), seed=st.integers(0, 2**16))
def test_a_linear_with_a_computed_bias_keeps_the_kronecker_factors_of_its_weight(n, s, h, approx, aten, seed):
    """``F.linear(x, W, cat(q, 0))``: ``W``'s KFLR factors are the ``nn.Linear`` twin's brute-force
    ``[B, A]`` (oracles.kron); the bias's parameter gets the GGN's exact block, its diagonal the
    brute-force GGN diagonal."""
    from curvlib import curvature
    from curvlib.extensions import KFLR, DiagGGNExact
    from oracles.kron import input_factors, output_factors
    from oracles.reference import assert_close, reference

    g = seeded(seed)
    torch.manual_seed(seed)
    model = ComputedBiasLinear(3, h, aten=aten).to(DT)
    twin = ComputedBiasLinear(3, h, use_module=True).to(DT)
    twin.load_state_dict(model.state_dict())
    X, y = torch.randn(n, s, 3, generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g)
    lossfn = nn.CrossEntropyLoss()
    got = curvature(model, lossfn, [KFLR(kfac_approx=approx), DiagGGNExact()])(X, y)
    B_expand, B_reduce = output_factors(twin, lossfn, X, y, "lin")
    A_backpack, A_expand, _ = input_factors(twin, X, "lin")
    want = [B_expand, A_expand] if approx == "expand" else [B_reduce, A_backpack]
    factors = got["kflr"]["lin.weight"]
    assert [tuple(f.shape) for f in factors] == [tuple(f.shape) for f in want]
    for f, w, what in zip(factors, want, "BA"):
        assert_close(f, w, f"factor {what}")
    ref = reference(model, lossfn, X, y, hessian=False)["diag_ggn_exact"]
    for name in ("q_bias", "lin.weight"):
        assert_close(got["diag_ggn_exact"][name], ref[name], f"{name} GGN diagonal")
    assert_close(got["kflr"]["q_bias"][0].diagonal(), ref["q_bias"], "q_bias block's diagonal")


class _RMSNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(d))

    def forward(self, h):
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class NormedEmbedding(nn.Embedding):
    """An Embedding subclass with its own forward and a norm submodule with a parameter (Inkling's
    ``InklingNormedEmbedding``): the ATen front end runs its ``embedding`` op by the Embedding
    rule on a view of it, whose parameters are the Embedding's own (the norm's weight is a
    functional site of its own, not also a role of the embedding's site)."""

    def __init__(self, n: int, d: int, layer_norm: bool):
        super().__init__(n, d)
        self.embed_norm = nn.LayerNorm(d) if layer_norm else _RMSNorm(d)

    def forward(self, ids):
        return self.embed_norm(super().forward(ids))


class EmbeddingNet(nn.Module):
    def __init__(self, layer_norm: bool):
        super().__init__()
        self.emb, self.head = NormedEmbedding(7, 4, layer_norm), nn.Linear(4, 3)

    def forward(self, ids):
        if bool((ids >= 0).all()):  # a branch on values: the ATen front end
            ids = ids + 0
        return self.head(torch.tanh(self.emb(ids)).mean(1))


@settings(max_examples=4, deadline=None)
@given(layer_norm=st.booleans(), n=st.integers(2, 4), seed=st.integers(0, 50))
def test_a_subclassed_embedding_with_a_parametrized_submodule(layer_norm, n, seed):
    torch.manual_seed(seed)
    g = seeded(seed)
    net = EmbeddingNet(layer_norm).to(DT)
    X, y = torch.randint(0, 7, (n, 5), generator=g), torch.randint(0, 3, (n,), generator=g)
    check_exact(Problem(net, X, y, nn.CrossEntropyLoss(), None, ""))


class ScoringLinear(nn.Linear):
    """A Linear subclass returning a tuple (Llama 4's router: sigmoid scores and the logits)."""

    def forward(self, x):
        logits = super().forward(x)
        return torch.sigmoid(logits), logits


class ScoredNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.router, self.head = nn.Linear(3, 4), ScoringLinear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = self.emb(x)
        scores, logits = self.router(h)
        return self.head(torch.tanh(h * scores + 0.1 * logits)).mean(1)


@settings(max_examples=3, deadline=None)
@given(n=st.integers(2, 4), seed=st.integers(0, 50))
def test_a_linear_subclass_returning_a_tuple(n, seed):
    """The KFLR oracle takes such a layer for no plain Linear (its output is no ``F.linear``);
    curvlib's other layers, and every BatchGrad and GGN diagonal, equal the brute force."""
    torch.manual_seed(seed)
    g = seeded(seed)
    X, y = torch.randn(n, 5, 3, generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g)
    check_exact(Problem(ScoredNet().to(DT), X, y, nn.CrossEntropyLoss(), None, ""))
