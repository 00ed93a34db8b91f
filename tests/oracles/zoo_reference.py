"""Brute-force float64 references for the model zoo (tests/oracles/zoo.py), from plain autograd.

Nothing here batches samples: sample ``i``'s loss ``ℓ_i = c · lossfn(f(x_i), y_i)`` (``c = 1/N``
for ``reduction="mean"``, so ``Σ_i ℓ_i`` is the batch loss and the individual gradients
carry BackPACK's ``1/N``) is evaluated by running the model on that sample alone, and
every derivative is a loop of ``torch.autograd.grad`` calls (``is_grads_batched`` where
the model allows it, else one call per column), since these models' own Python (masks,
``ModelOutput``s, keyword inputs) need not run under ``torch.func`` transforms.

* ``individual_gradients``: ``{p: [N, *p]}``;
* ``ggn_parts``: per sample, the output Jacobian ``J_i [C, *p]`` and ``H_i [C, C]``;
  the GGN diagonal, its per-sample diagonals and dense blocks follow;
* ``hessian_diagonals``: per-sample Hessian diagonals ``[N, *p]`` (one double backward
  per parameter entry and sample);
* ``hessian_block``: the batch loss's dense Hessian block of one parameter;
* ``kflr_factors``: ``[B [O, O], A [I·K, I·K]]`` for every Linear / Conv2d (and GPT-2
  ``Conv1D``) weight, as ``tests/oracles/compose_kron.py`` defines them (``A = (1/N)
  Σ_{n,s} x xᵀ``, unfolded patches for convolutions; ``B`` the exact GGN block of an
  offset added to the layer's output at every position, KFAC's "expand").
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from curvlib.rules.generic import restored
from oracles.torch_fixes import exact_backward
from oracles.zoo import select


@contextmanager
def _math():
    """SDPA's math kernel (the fused ones lack double backward)."""
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)


def sample(X, i: int):
    return {k: v[i : i + 1] for k, v in X.items()} if isinstance(X, dict) else X[i : i + 1]


def batch_size(X) -> int:
    return next(iter(X.values())).shape[0] if isinstance(X, dict) else X.shape[0]


def forward(model, X, output):
    """The model's output on ``X``, computed afresh: a cache the forward fills (timm's attention
    biases in eval mode) is emptied for the call and restored after it, so that no call reads
    another call's values or graph (the oracles differentiate each call on its own). A cache
    filled before, by a forward under ``torch.no_grad`` (the sweep's logit-scale probe), would hand
    every call a constant: the oracle's gradient of those parameters was zero
    (EfficientFormer's ``attention_biases``), where the model's is not."""
    with _math(), restored(model):
        _empty_caches(model)
        o = model(**X) if isinstance(X, dict) else model(X)
    return select(o, output)


def _empty_caches(model: nn.Module) -> None:
    """Empty every dict attribute of a submodule that holds tensors only (a cache its forward
    fills: timm's ``attention_bias_cache``, keyed by device); call inside ``restored``."""
    for m in model.modules():
        for k, v in vars(m).items():
            if k not in _MODULE_SLOTS and isinstance(v, dict) and v and all(isinstance(t, Tensor) for t in v.values()):
                v.clear()


_MODULE_SLOTS = frozenset(vars(nn.Module()))  # nn.Module's own tables (parameters, buffers, hooks)


def scale(lossfn, n: int) -> float:
    return 1.0 / n if getattr(lossfn, "reduction", "mean") == "mean" else 1.0


def trainable(model) -> Dict[str, Tensor]:
    return {k: p for k, p in model.named_parameters() if p.requires_grad}


def _grads(out: Tensor, params: List[Tensor], cotangents: Tensor) -> List[Tensor]:
    """``[K, *p]`` per parameter: the vector-Jacobian products of ``out`` with ``K`` cotangents."""
    try:
        gs = torch.autograd.grad(out, params, cotangents, retain_graph=True, allow_unused=True,
                                 is_grads_batched=True)
        return [torch.zeros(cotangents.shape[0], *p.shape, dtype=p.dtype) if g is None else g
                for g, p in zip(gs, params)]
    except Exception:
        rows = [torch.autograd.grad(out, params, c, retain_graph=True, allow_unused=True) for c in cotangents]
        return [torch.stack([torch.zeros_like(p) if r[j] is None else r[j] for r in rows])
                for j, p in enumerate(params)]


@exact_backward
def individual_gradients(prob) -> Dict[str, Tensor]:
    params = trainable(prob.model)
    n, c = batch_size(prob.X), scale(prob.lossfn, batch_size(prob.X))
    per = []
    for i in range(n):
        loss = c * prob.lossfn(forward(prob.model, sample(prob.X, i), prob.output), prob.y[i : i + 1])
        gs = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        per.append([torch.zeros_like(p) if g is None else g for g, p in zip(gs, params.values())])
    return {k: torch.stack([g[j] for g in per]) for j, k in enumerate(params)}


@exact_backward
def ggn_parts(prob):
    """``[(J_i {p: [C, *p]}, H_i [C, C])]`` per sample."""
    params = trainable(prob.model)
    n, c = batch_size(prob.X), scale(prob.lossfn, batch_size(prob.X))
    parts = []
    for i in range(n):
        out = forward(prob.model, sample(prob.X, i), prob.output)
        flat = out.reshape(-1)
        eye = torch.eye(flat.numel(), dtype=flat.dtype)
        J = dict(zip(params, (j.double() for j in _grads(flat, list(params.values()), eye))))
        parts.append((J, loss_hessian(prob, out, prob.y[i : i + 1], c)))
    return parts


def loss_hessian(prob, out: Tensor, y: Tensor, c: float) -> Tensor:
    """``[C, C]``: the Hessian of ``c · lossfn(out, y)`` in float64 at ``out``'s values (a model
    may return float32 logits from float64 weights; the loss's curvature is still taken exactly)."""
    flat = out.detach().reshape(-1).double()
    return torch.func.hessian(lambda u: c * prob.lossfn(u.reshape(out.shape), y))(flat)


def ggn_diagonals(parts) -> Dict[str, Tensor]:
    """``{p: [N, *p]}``: per-sample GGN diagonals."""
    return {k: torch.stack([((H @ J[k].flatten(1)) * J[k].flatten(1)).sum(0).reshape(J[k].shape[1:])
                            for J, H in parts]) for k in parts[0][0]}


def ggn_block(parts, name: str) -> Tensor:
    return sum(J[name].flatten(1).T @ H @ J[name].flatten(1) for J, H in parts)


class _Hardsigmoid(nn.Module):
    def forward(self, x):
        return torch.clamp(x / 6 + 0.5, 0.0, 1.0)


class _Hardswish(nn.Module):
    def forward(self, x):
        return x * torch.clamp(x / 6 + 0.5, 0.0, 1.0)


class _HardsigmoidByFormula(TorchFunctionMode):
    """``F.hardsigmoid`` (module or function, timm's or torch's) as ``relu6(x + 3) / 6``: the same
    values bit for bit, and torch has no derivative of ``hardsigmoid_backward`` in either mode."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.hardsigmoid:
            return F.relu6(args[0] + 3.0) / 6.0
        return func(*args, **(kwargs or {}))


def twice_differentiable(prob):
    """``prob`` with a copy of its model whose ``nn.Hardsigmoid``/``nn.Hardswish`` are written
    with ``clamp`` (torch has no derivative of ``hardsigmoid_backward``); same values and,
    away from the kinks, the same derivatives of every order."""
    import copy

    swaps = {nn.Hardsigmoid: _Hardsigmoid, nn.Hardswish: _Hardswish}
    if not any(type(m) in swaps for m in prob.model.modules()):
        return prob
    model = copy.deepcopy(prob.model)
    for name, m in list(model.named_modules()):
        for child_name, child in list(m.named_children()):
            if type(child) in swaps:
                setattr(m, child_name, swaps[type(child)]())
    return prob._replace(model=model)


@exact_backward
def hessian_diagonals(prob, names=None) -> Dict[str, Tensor]:
    """``{p: [N, *p]}``: per-sample Hessian diagonals of ``ℓ_i``."""
    prob = twice_differentiable(prob)
    params = trainable(prob.model)
    names = list(params) if names is None else names
    plist = list(params.values())
    n, c = batch_size(prob.X), scale(prob.lossfn, batch_size(prob.X))
    result = {k: [] for k in names}
    for i in range(n):
        loss = c * prob.lossfn(forward(prob.model, sample(prob.X, i), prob.output), prob.y[i : i + 1])
        gs = torch.autograd.grad(loss, plist, create_graph=True, allow_unused=True)
        for k in names:
            j = list(params).index(k)
            g = gs[j]
            if g is None or not g.requires_grad:
                result[k].append(torch.zeros_like(params[k]))
                continue
            flat = g.reshape(-1)
            diag = []
            for start in range(0, flat.numel(), 256):
                eye = torch.zeros(min(256, flat.numel() - start), flat.numel(), dtype=flat.dtype)
                eye[torch.arange(eye.shape[0]), start + torch.arange(eye.shape[0])] = 1
                rows = _grads(flat, [params[k]], eye)[0].flatten(1)
                diag.append(rows[torch.arange(eye.shape[0]), start + torch.arange(eye.shape[0])])
            result[k].append(torch.cat(diag).reshape(params[k].shape))
    return {k: torch.stack(v) for k, v in result.items()}


@exact_backward
def hessian_block(prob, name: str) -> Tensor:
    """``[P, P]``: the batch loss's Hessian block of parameter ``name``."""
    prob = twice_differentiable(prob)
    p = trainable(prob.model)[name]
    loss = prob.lossfn(forward(prob.model, prob.X, prob.output), prob.y)
    (g,) = torch.autograd.grad(loss, [p], create_graph=True)
    flat = g.reshape(-1)
    return _grads(flat, [p], torch.eye(flat.numel(), dtype=flat.dtype))[0].flatten(1)


# ---------------------------------------------------------------------------------------- Kronecker


def kron_sites(model: nn.Module) -> Dict[str, nn.Module]:
    """``{module name: module}`` for the layers whose weight must get two Kronecker factors:
    every ``nn.Linear`` / ``nn.Conv2d`` (subclasses included) and GPT-2's ``Conv1D``."""
    from transformers.pytorch_utils import Conv1D

    return {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d, Conv1D))}


def plain(m: nn.Module, x: Optional[Tensor] = None) -> bool:
    """A layer that computes its base class's map (the oracle's ``A``/``B`` apply): its forward
    is the base class's, or (given its input ``x``) a Linear subclass's own forward that equals
    ``F.linear(x, W, b)`` there (Falcon's ``FalconLinear``: ``x @ W.T + b``); not a subclass that
    returns a tuple (Llama 4's router), not timm's
    weight-standardised ``StdConv2d``/``ScaledStdConv2d`` or a ``Conv2dSame``."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(m, Conv1D):
        return True
    base = nn.Conv2d if isinstance(m, nn.Conv2d) else nn.Linear
    if type(m).forward is base.forward:
        return getattr(m, "padding_mode", "zeros") == "zeros"
    if base is not nn.Linear or x is None:
        return False
    with torch.no_grad():
        out = m(x)
        # (a subclass returning more than the map, Llama 4's router ``(scores, logits)``, or another
        # map, DeepSeek-V4's grouped projection, whose weight F.linear cannot apply: no plain Linear)
        if not isinstance(out, Tensor) or x.shape[-1] != m.weight.shape[-1]:
            return False
        want = F.linear(x, m.weight, m.bias)
        return out.shape == want.shape and bool(torch.allclose(out, want, rtol=1e-12, atol=1e-12))


def _unfold(conv: nn.Conv2d, x: Tensor) -> Tensor:
    """``[N, I·K, S]`` patches (as ``oracles.second_order.unfold_conv_input``, with groups=1);
    ``padding="valid"`` is none, ``"same"`` pads ``d·(k − 1)`` per dim, the odd one at the end."""
    if conv.padding == "valid":
        return F.unfold(x, conv.kernel_size, dilation=conv.dilation, stride=conv.stride)
    if conv.padding == "same":
        total = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size)]
        x = F.pad(x, [p for t in reversed(total) for p in (t // 2, t - t // 2)])
        return F.unfold(x, conv.kernel_size, dilation=conv.dilation, stride=conv.stride)
    return F.unfold(x, conv.kernel_size, dilation=conv.dilation, padding=conv.padding, stride=conv.stride)


def _shared(model: nn.Module) -> set:
    """ids of parameters owned by more than one module (tied weights: GPT-2's lm_head)."""
    seen, shared = set(), set()
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                (shared if id(p) in seen else seen).add(id(p))
    return shared


def site_inputs(prob) -> Dict[str, Tensor]:
    """``{module name: its input on the batch}`` for the untied, trainable, groups=1 sites of
    :func:`kron_sites` the forward calls once (a frozen LoRA base has no factors; a parametrized
    weight, ``weight_norm``'s, is a function of its parameters, not a parameter; a module the
    forward calls several times, CoAT's shared MLPs: :func:`repeated_sites`)."""
    inputs, calls = _site_calls(prob)
    return {k: x for k, x in inputs.items() if calls[k] == 1 and getattr(prob.model.get_submodule(k), "groups", 1) == 1}


def repeated_sites(prob) -> List[str]:
    """The untied trainable sites of :func:`kron_sites` (grouped convolutions included) that the
    forward calls several times."""
    _, calls = _site_calls(prob)
    return [k for k, c in calls.items() if c > 1]


def merged_row_sites(prob) -> List[str]:
    """The sites of :func:`kron_sites` whose input holds more rows than samples in dim 0 (a
    convolution on heads merged into the batch, MViTv2's pooling of ``[N·H, C, h, w]``)."""
    inputs, _ = _site_calls(prob)
    n = batch_size(prob.X)
    return [k for k, x in inputs.items() if isinstance(x, Tensor) and x.dim() and x.shape[0] != n]


def _site_calls(prob) -> Tuple[Dict[str, Tensor], Dict[str, int]]:
    """Each site's first input and its number of calls in one forward."""
    shared = _shared(prob.model)
    sites = {k: m for k, m in kron_sites(prob.model).items()
             if "weight" in m._parameters and id(m.weight) not in shared and m.weight.requires_grad}
    inputs, calls = {}, dict.fromkeys(sites, 0)

    def record(k, args):  # returns None: a pre-hook's return value would replace the input
        inputs.setdefault(k, args[0].detach().clone())
        calls[k] += 1

    hooks = [m.register_forward_pre_hook(lambda mod, a, k=k: record(k, a)) for k, m in sites.items()]
    try:
        with torch.no_grad():
            forward(prob.model, prob.X, prob.output)
    finally:
        for h in hooks:
            h.remove()
    return inputs, calls


def constant_sites(prob) -> List[str]:
    """The sites of :func:`site_inputs` whose input is the same whatever the samples (MarkupLM's
    xpath layers on the default xpath ids, the position-bias MLPs of Swin V2 and timm's relative
    position MLPs on a table of coordinates): layers on constants, part of a parameter-only
    chain (docs/supported-models.md: the diagonal of its exact block), not sites of their own.
    Decided by running the forward again on the batch in reverse order: an input that depends on
    the samples changes (their rows are drawn at random), a constant one does not."""
    n = prob.y.shape[0]
    flip = lambda x: x.flip(0) if isinstance(x, Tensor) and x.dim() and x.shape[0] == n else x  # noqa: E731
    reversed_X = {k: flip(v) for k, v in prob.X.items()} if isinstance(prob.X, dict) else flip(prob.X)
    first, _ = _site_calls(prob)
    second, _ = _site_calls(prob._replace(X=reversed_X))
    # (to rounding: a batched matmul may round rows differently)
    same = lambda a, b: a.shape == b.shape and float((a - b).abs().max()) <= 1e-12 * max(float(a.abs().max()), 1e-300)  # noqa: E731
    return [k for k, x in first.items() if n > 1 and k in second and same(x, second[k])]


def kflr_sites(prob) -> Dict[str, Tensor]:
    """The sites :func:`kflr_factors` defines factors for, with their inputs: plain layers
    (:func:`plain`) on inputs that vary with the sample."""
    constant = constant_sites(prob)
    return {k: x for k, x in site_inputs(prob).items() if plain(prob.model.get_submodule(k), x) and k not in constant}


def _input_factor(m: nn.Module, x: Tensor, n: int, approx) -> Tuple[Tensor, int, int, int]:
    """``(A, S, dim, O)``: ``A = (1/N) Σ_{n,s} x xᵀ`` (``"expand"``: ``/ (N·S)``), the positions
    ``S``, the output's feature dim and size."""
    from transformers.pytorch_utils import Conv1D

    x = x.double()
    if isinstance(m, nn.Conv2d):
        u = _unfold(m, x)
        A, S, dim, O = torch.einsum("nis,njs->ij", u, u), u.shape[-1], 1, m.out_channels
    else:
        x = x.reshape(-1, x.shape[-1])
        A, S, dim, O = x.T @ x, x.shape[0] // n, -1, (m.nf if isinstance(m, Conv1D) else m.out_features)
    return (A / (n * S) if approx == "expand" else A / n), S, dim, O


@exact_backward
def _output_factors(prob, layers: Dict[str, Tuple[nn.Module, int, int]], i: int, approx) -> Dict[str, Tensor]:
    """Sample ``i``'s ``Σ J_sᵀ H J_s`` (``"expand"``, per position ``s``) or ``Jᵀ H J`` of one offset
    added at every position, for every layer of ``layers`` (``{name: (module, output's channel
    dim, channels)}``) from one forward: a zero offset at each layer's output changes nothing, and
    the Jacobian with respect to each offset is the one it has alone. float64, the offsets in the
    layers' output dtypes."""
    c = scale(prob.lossfn, batch_size(prob.X))
    shapes: Dict[str, tuple] = {}
    def note(k, o):  # (returns None: a hook's return value would replace the output)
        shapes.setdefault(k, (o.shape, o.dtype))

    probes = [m.register_forward_hook(lambda mod, a, o, k=k: note(k, o)) for k, (m, _, _) in layers.items()]
    try:
        with torch.no_grad():
            forward(prob.model, sample(prob.X, i), prob.output)
    finally:
        for h in probes:
            h.remove()
    deltas = {k: torch.zeros(list(shapes[k][0]) if approx == "expand" else [O], dtype=shapes[k][1], requires_grad=True)
              for k, (_, _, O) in layers.items()}

    def add(k, dim, o):
        if approx == "expand":
            return o + deltas[k]
        shape = [1] * o.dim()
        shape[dim] = -1
        return o + deltas[k].reshape(shape)

    hooks = [m.register_forward_hook(lambda mod, a, o, k=k, dim=dim: add(k, dim, o)) for k, (m, dim, _) in layers.items()]
    try:
        out = forward(prob.model, sample(prob.X, i), prob.output)
    finally:
        for h in hooks:
            h.remove()
    flat = out.reshape(-1)
    names = list(deltas)
    Js = _grads(flat, [deltas[k] for k in names], torch.eye(flat.numel(), dtype=flat.dtype))  # [C, *delta] each
    H = loss_hessian(prob, out, prob.y[i : i + 1], c)
    result = {}
    for k, J in zip(names, Js):
        J, (_, dim, O) = J.double(), layers[k]
        if approx == "expand":
            J = J.movedim(dim if dim < 0 else dim + 1, -1).reshape(J.shape[0], -1, O)  # [C, S, O]
            result[k] = torch.einsum("csi,cd,dsj->ij", J, H, J)
        else:
            result[k] = J.T @ H @ J
    return result


def kflr_factors(prob, approx=None, sites: Optional[Dict[str, Tensor]] = None) -> Dict[str, List[Tensor]]:
    """``{weight or bias name: factors}`` for ``sites`` (``{module name: its input}``, default
    :func:`kflr_sites`; named as ``named_parameters``
    names them: a bias tied to another module's, LUKE's ``lm_head.decoder.bias``, by its first
    name); a weight ``[B, A]`` (``Conv1D``'s ``[I, O]`` weight: ``[A, B]``, row-major), a bias
    ``[B]``. ``approx=None`` (curvlib's default): ``B`` the exact GGN block of an offset added at
    every position, ``A = (1/N) Σ_{n,s} x xᵀ``; ``"expand"`` (docs/conventions.md): ``B = Σ_{n,s}
    J_sᵀ H J_s`` with ``J_s`` the Jacobian of an offset at position ``s`` alone, ``A = (1/(N·S))
    Σ_{n,s} x xᵀ``."""
    from transformers.pytorch_utils import Conv1D

    model, n = prob.model, batch_size(prob.X)
    names = {id(p): k for k, p in model.named_parameters()}
    result, inputs, layers = {}, {}, {}
    for k, x in (kflr_sites(prob) if sites is None else sites).items():
        m = model.get_submodule(k)
        A, S, dim, O = _input_factor(m, x, n, approx)
        inputs[k], layers[k] = A, (m, dim, O)
    per_sample = [_output_factors(prob, layers, i, approx) for i in range(n)] if layers else []
    for k, (m, _, _) in layers.items():
        A, B = inputs[k], sum(b[k] for b in per_sample)
        result[names[id(m.weight)]] = [A, B] if isinstance(m, Conv1D) else [B, A]
        if getattr(m, "bias", None) is not None and m.bias.requires_grad and id(m.bias) in names:
            result[names[id(m.bias)]] = [B]
    return result


def kron(factors: List[Tensor]) -> Tensor:
    out = torch.ones(1, 1, dtype=factors[0].dtype)
    for f in factors:
        out = torch.kron(out, torch.diag(f) if f.dim() == 1 else f)
    return out


def operator_products(prob, v: Dict[str, Tensor]):
    """``(G v, H v)`` over every trainable parameter by plain reverse-mode autograd on the model's
    own forward (some kernels have no forward mode): ``J v`` as the derivative of ``⟨Jᵀu, v⟩`` in
    ``u``, the loss Hessian at the output by a double backward, ``H v`` as the gradient of
    ``⟨∇L, v⟩``. Parameters the loss does not reach get zeros; ``hardsigmoid`` is run by its
    formula (:class:`_HardsigmoidByFormula`)."""
    with _HardsigmoidByFormula():
        return _operator_products(prob, v)


def _operator_products(prob, v: Dict[str, Tensor]):
    params = trainable(prob.model)
    names = list(params)
    out = forward(prob.model, prob.X, prob.output)
    u = torch.zeros_like(out, requires_grad=True)
    jtu = torch.autograd.grad(out, [params[n] for n in names], u, create_graph=True, allow_unused=True)
    used = [k for k, g in enumerate(jtu) if g is not None]
    jv = torch.autograd.grad([jtu[k] for k in used], u, [v[names[k]] for k in used])[0]
    o = out.detach().requires_grad_(True)
    (g_out,) = torch.autograd.grad(prob.lossfn(o, prob.y), o, create_graph=True)
    (hjv,) = torch.autograd.grad(g_out, o, jv)
    gv = torch.autograd.grad(out, [params[n] for n in names], hjv, allow_unused=True, retain_graph=True)
    grads = torch.autograd.grad(prob.lossfn(out, prob.y), [params[n] for n in names], create_graph=True, allow_unused=True)
    reached = [k for k, g in enumerate(grads) if g is not None and g.requires_grad]
    hv = torch.autograd.grad([grads[k] for k in reached], [params[names[k]] for k in reached],
                             [v[names[k]] for k in reached], allow_unused=True)
    hv_of = dict(zip([names[k] for k in reached], hv))
    zero = {n: torch.zeros_like(p) for n, p in params.items()}
    return ({n: (g.detach() if g is not None else zero[n]) for n, g in zip(names, gv)},
            {n: (hv_of[n].detach() if hv_of.get(n) is not None else zero[n]) for n in names})
