"""Generic rule: any parametrized module, through torch.func.

For a module ``y = m(θ, x)`` without a hand-written rule, the individual
gradient of sample ``n`` is the vector-Jacobian product

    ∂ℓ_n/∂θ = (∂m(θ, x_n)/∂θ)ᵀ g_n,

computed with :func:`torch.func.vjp` on the module run on sample ``n`` alone
(batch of one) and vectorised over ``n`` with :func:`torch.func.vmap`.
Correct for any module that treats samples independently, slower than a
hand-written rule. The batch may be in any dim of each tensor argument and
of the output (a sequence-first ``[T, N, D]`` layer): the planner finds each
(:attr:`curvlib._core.site.Rule.saved_batch_dims`), and sample ``n`` runs as a
batch of one in the layer's own layout. Tensor arguments without the batch are
passed unchanged to every sample.

A module whose forward branches on tensor values (``if x.sum() > 0``), which
``vmap`` cannot run, is run sample by sample instead (:func:`map_samples`):
the same values, one call per sample. Each sample then takes the branch its
own values select, like autograd on that sample alone.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref
from typing import Any, Dict, Optional, Sequence

import torch
from torch import Tensor, fx, nn
from torch.func import functional_call, vjp, vmap
from torch.utils import _pytree as pytree
from torch.nn.utils.stateless import _reparametrize_module
from torch.nn.utils.parametrizations import _SpectralNorm
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from .._core.errors import CurvatureError
from .._core.sync import LOCK
from .._core.family import Family
from .._core.site import Recorder, RoleTensors, Rule, Site, sample_layout
from .._core.tensors import dense
from . import fixed_rows


def math_hooks(module: nn.Module) -> list:
    """The module's hooks that compute its parameters (old-style weight or spectral norm)."""
    return [h for h in module._forward_pre_hooks.values() if isinstance(h, (WeightNorm, SpectralNorm))]


def stateless_call(module: nn.Module, tensors: Dict[str, Tensor], args, kwargs) -> Any:
    """``module`` run with the parameter ``tensors``, provably leaving it as it found it.

    * Its buffers are passed as copies when it (or a submodule) is in training
      mode, where forwards update buffers in place (spectral norm's power
      iteration, running statistics): each evaluation starts from the model's
      own, unchanged values, like one ``model(X)`` from the current state.
    * Its hooks are not run (:func:`curvlib.rules.call_without_hooks`).
    * ``torch.func.functional_call`` can leave plain tensors in place of the
      parameters of a submodule that appears twice in the tree; every
      submodule's parameter and buffer slots are restored afterwards. The slots
      are swapped under :data:`curvlib._core.sync.LOCK` (other threads must not see them).
    * Tensors a hook stores as plain attributes (the old-style ``weight_norm`` /
      ``spectral_norm`` set ``module.weight`` on every forward) are restored too:
      left behind, they would be torch.func wrappers (the model could then not
      even be deep-copied).
    """
    if type(module) is nn.Bilinear and not kwargs:  # exactly the class: no parametrization
        return _bilinear(tensors.get("weight", module.weight), tensors.get("bias", module.bias), *args)
    if any(m.training for m in module.modules()):
        tensors = {**{name: b.clone() for name, b in module.named_buffers()}, **tensors}
    with LOCK, restored(module):
        if math_hooks(module):  # hooks that compute the weight from the parameters: run them
            return functional_call(module, tensors, tuple(args), dict(kwargs), tie_weights=False)
        with _reparametrize_module(module, tensors, tie_weights=False):
            return module.forward(*args, **kwargs)


def _bilinear(weight: Tensor, bias: Optional[Tensor], x1: Tensor, x2: Tensor) -> Tensor:
    """``nn.Bilinear``'s ``y_o = x1ᵀ W_o x2 + b_o`` as an einsum: ``F.bilinear`` calls
    ``aten::_trilinear``, which has no vmap batching rule (torch then warns of a performance
    drop at every call and loops over the batch)."""
    y = torch.einsum("...i,oij,...j->...o", x1, weight, x2)
    return y if bias is None else y + bias


@contextlib.contextmanager
def restored(module: nn.Module):
    """Every submodule's parameter and buffer slots, its plain tensor attributes and the
    contents of its dict and list attributes (a cache a ``forward`` fills: timm's
    ``attention_bias_cache``) as they were before the block; tensor or traced-value attributes
    the block added are removed (call under :data:`curvlib._core.sync.LOCK`)."""
    slots = [(m, store, dict(getattr(m, store))) for m in module.modules() for store in ("_parameters", "_buffers")]
    attrs = [(m, {k: v for k, v in vars(m).items() if isinstance(v, _STATE)}) for m in module.modules()]
    containers = [(v, copy.copy(v)) for m in module.modules() for k, v in vars(m).items()
                  if isinstance(v, (dict, list)) and k not in _MODULE_SLOTS]
    try:
        yield
    finally:
        for m, store, saved in slots:
            current = getattr(m, store)
            current.clear()
            current.update(saved)
        for m, saved in attrs:
            for k in [k for k, v in vars(m).items() if isinstance(v, _STATE) and k not in saved]:
                del m.__dict__[k]
            m.__dict__.update(saved)
        for current, saved in containers:
            if isinstance(current, dict):
                current.clear()
                current.update(saved)
            else:
                current[:] = saved


_STATE = (Tensor, fx.Proxy)  # a module attribute holding a value of the computation
# nn.Module's own containers (slots, hooks): restored above or not the model's state; skipping
# them keeps ``restored`` cheap where it runs per call (an opaque module's forward)
_MODULE_SLOTS = frozenset(vars(nn.Module()))


def _split_args(args, kwargs):
    """Tensors go to ``saved`` (they must flow through the transforms); the rest to meta."""
    saved: Dict[str, Tensor] = {}
    pos_static: list = []
    for i, a in enumerate(args):
        if isinstance(a, Tensor):
            saved[f"arg{i}"] = a
            pos_static.append(None)
        else:
            pos_static.append(a)
    kw_static = {}
    for k, a in kwargs.items():
        if isinstance(a, Tensor):
            saved[f"kw:{k}"] = a
        else:
            kw_static[k] = a
    return saved, pos_static, kw_static


def join_args(saved: Dict[str, Tensor], pos_static: list, kw_static: dict):
    args = [saved[f"arg{i}"] if a is None else a for i, a in enumerate(pos_static)]
    kwargs = dict(kw_static)
    kwargs.update({k[3:]: v for k, v in saved.items() if k.startswith("kw:")})
    return args, kwargs


# Functions (by a key, e.g. the module) seen to branch on tensor values: looped at once.
_BRANCHING: "weakref.WeakSet" = weakref.WeakSet()
# vmap's refusals of a function that a loop over samples runs: a branch on values, ``.item()``,
# an output whose shape depends on values (``h[mask]``, ``nonzero``), values read into Python
# (``.tolist()``: a batched tensor has no storage of its own)
_UNMAPPABLE = ("data-dependent control flow", "batching operators that can support dynamic shape",
               "Cannot access data pointer of Tensor that doesn't have storage")
_LOOPING = threading.local()  # .on: map_samples runs its function sample by sample (values readable)


def map_samples(fn, in_dims, key=None):
    """``vmap(fn, in_dims)``, or, when ``fn`` branches on tensor values (data-dependent
    control flow, ``.item()`` or ``.tolist()``, which vmap cannot run), a loop over the mapped
    dimension whose results are stacked: the same values, one call per sample.
    ``key`` (weak-referenceable, e.g. the module ``fn`` runs): remembered as branching,
    so that later calls loop without trying vmap first."""

    def mapped(*args):
        if key is None or key not in _BRANCHING:
            try:
                return vmap(fn, in_dims=in_dims)(*args)
            except RuntimeError as exc:
                if not any(why in str(exc) for why in _UNMAPPABLE):
                    raise
                if key is not None:
                    _BRANCHING.add(key)
        flat, spec = pytree.tree_flatten(args)
        dims = pytree._broadcast_to_and_flatten(in_dims, spec)
        n = next(a.shape[d] for a, d in zip(flat, dims) if d is not None)
        before, _LOOPING.on = getattr(_LOOPING, "on", False), True
        try:
            outs = [fn(*pytree.tree_unflatten([a if d is None else a.select(d, i) for a, d in zip(flat, dims)], spec))
                    for i in range(n)]
        finally:
            _LOOPING.on = before
        return pytree.tree_map(lambda *xs: torch.stack(xs), outs[0], *outs[1:])

    return mapped


def grad_batch(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``∂ℓ_n/∂θ``: the module's vjp run on each sample alone, a batch of one in the
    module's own layout (the batch dim of each input and of the output kept where it is)."""
    return _per_sample_pullbacks(site, g, roles, columns=False)


def grad_batch_columns(site: Site, m: Tensor, roles: Sequence[str]) -> RoleTensors:
    """:func:`grad_batch` of every column of ``m [V, *out]`` at once, ``{role: [V, N, *p]}``: one
    forward of each sample alone, its pullback applied to all of that sample's columns
    (vmapped; one by one where the module's backward cannot be vmapped), instead of a forward
    and a pullback per column."""
    out = _per_sample_pullbacks(site, m, roles, columns=True)
    return {role: v.transpose(0, 1) for role, v in out.items()}  # [N, V, *p] -> [V, N, *p]


def _per_sample_pullbacks(site: Site, g: Tensor, roles: Sequence[str], columns: bool) -> RoleTensors:
    """``{role: [N, *p]}`` (``g [N, *out]``), or with ``columns`` ``{role: [N, V, *p]}`` (``g [V, N, *out]``)."""
    module = site.meta["module"]
    n = g.shape[1 if columns else 0]
    params = {k[6:]: v for k, v in site.saved.items() if k.startswith("param:")}
    inputs = {k: dense(v) for k, v in site.saved.items() if not k.startswith("param:")}  # (as in functional)
    own, out_dim = sample_layout(site, inputs, n)
    in_dims = {k: None if d is None else 0 for k, d in own.items()}  # saved batch first
    wanted = set(roles)

    batch_out = site.meta.get("out")  # the layer's output in its own layout

    def one_sample(inputs_n: Dict[str, Tensor], g_n: Tensor, out_n: Tensor) -> Dict[str, Tensor]:
        inputs_n = {k: v if own[k] is None else v.unsqueeze(own[k]) for k, v in inputs_n.items()}
        args, kwargs = join_args(inputs_n, site.meta["pos_static"], site.meta["kw_static"])
        free = {r: p for r, p in params.items() if r in wanted}
        fixed = {r: p for r, p in params.items() if r not in wanted}

        def f(free_params):
            return output_tensor(site, stateless_call(module, {**fixed, **free_params}, args, kwargs))

        alone, pullback = vjp(f, free)
        if getattr(_LOOPING, "on", False) and batch_out is not None:
            _check_same_branch(site, alone.squeeze(out_dim), out_n)
        if not columns:
            return pullback(g_n.unsqueeze(out_dim))[0]
        return _pull_columns(pullback, g_n.unsqueeze(out_dim + 1))

    out_rows = batch_out if batch_out is not None else (g[0] if columns else g)
    out_rows_dim = out_dim if batch_out is not None else 0
    g_dim = 1 if columns else 0
    return map_samples(one_sample, (in_dims, g_dim, out_rows_dim), key=module)(inputs, dense(g), out_rows)


def _pull_columns(pullback, cols: Tensor) -> Dict[str, Tensor]:
    """``{role: [V, *p]}``: ``pullback`` of each column of ``cols [V, *out]``, vmapped, or one by one
    where the module's backward has no batching rule."""
    try:
        return vmap(lambda c: pullback(c)[0])(cols)
    except RuntimeError:
        pulled = [pullback(c)[0] for c in cols.unbind(0)]
        return {role: torch.stack([p[role] for p in pulled]) for role in pulled[0]}


def _check_same_branch(site: Site, alone: Tensor, in_batch: Tensor) -> None:
    """A module that branches on tensor values, run on one sample alone, must compute what it
    computed for that sample in the batch: a branch on the whole batch's values (``if
    x.sum() > 0``) can differ, and the per-sample quantities would then be a guess."""
    scale = in_batch.abs().max()
    if alone.shape != in_batch.shape or not bool(((alone - in_batch).abs() <= 1e-5 * scale + 1e-6).all()):
        raise CurvatureError(
            f"Layer '{site.where}' ({type(site.meta['module']).__name__}, run by the generic rule) branches on "
            "tensor values and computes something else for a sample alone than for it in the batch: its "
            "forward takes a branch chosen by the whole batch's values, so the samples are not independent "
            "and per-sample quantities are not defined. Make the branch depend on each sample alone "
            "(e.g. torch.where on per-sample conditions)."
        )


GENERIC = Rule(kind="generic", grad_batch=grad_batch, grad_batch_columns=grad_batch_columns, any_batch_dim=True,
               saved_batch_dims=True)


def forward(module: nn.Module, where: str, names: dict, tensors: dict, args, kwargs, rec: Recorder):
    """Run ``module`` with substituted parameters and record a generic site. A container output
    (a ``ModelOutput``, a tuple) whose only floating-point tensor is one leaf is recorded at
    that tensor, the container rebuilt around it."""
    out = stateless_call(module, tensors, args, kwargs)
    leaves, spec = pytree.tree_flatten(out)
    floating = [k for k, v in enumerate(leaves) if isinstance(v, Tensor) and v.is_floating_point()]
    if not isinstance(out, Tensor) and len(floating) != 1:
        raise CurvatureError(
            f"Module '{where}' ({type(module).__name__}) has no hand-written curvlib "
            f"rule and returns {type(out).__name__} with {len(floating)} floating-point tensors; the generic "
            "rule, which runs it whole, needs one output tensor. It is run whole because neither torch.fx "
            "nor curvlib's ATen front end could trace through it (e.g. the model applies a custom "
            "autograd.Function); make its forward return one tensor."
        )
    leaf = None if isinstance(out, Tensor) else floating[0]
    tensor = out if leaf is None else leaves[leaf]
    saved, pos_static, kw_static = _split_args(args, kwargs)
    saved.update({f"param:{r}": t for r, t in tensors.items()})
    meta = {"module": module, "pos_static": pos_static, "kw_static": kw_static, "output_leaf": leaf,
            "out": tensor.detach()}  # (a branching module's per-sample runs are checked against it)
    recorded = rec.add(Site(GENERIC, names, where, meta=meta, saved=saved), tensor)
    if leaf is None:
        return recorded
    leaves[leaf] = recorded
    return pytree.tree_unflatten(leaves, spec)


def output_tensor(site: Site, out) -> Tensor:
    """The tensor a generic site is recorded at, from its module's output (see :func:`forward`)."""
    leaf = site.meta.get("output_leaf")
    return out if leaf is None else pytree.tree_flatten(out)[0][leaf]


# Extensions that run a generic layer's forward under forward-mode AD or ``vmap`` over
# its parameters (GGNMP's ``jvp``; the Hessian family's dense residual ``vmap(hessian)``).
def buffer_updates(module: nn.Module) -> list:
    """Submodules whose forward writes buffers in place in training mode (spectral norm's
    power iteration, as a parametrization or as the older forward pre-hook)."""
    found = []
    for path, m in module.named_modules():
        if isinstance(m, _SpectralNorm) and m.training:
            found.append(f"'{path}' (spectral_norm parametrization)")
        elif m.training and any(isinstance(h, SpectralNorm) for h in m._forward_pre_hooks.values()):
            found.append(f"'{path or type(m).__name__}' (torch.nn.utils.spectral_norm)")
    return found


def refuse_buffer_updates(program, sites, exts) -> None:
    """Refuse, before any work, an extension that would run a trainable generic layer whose
    forward updates buffers in place (training-mode spectral norm) under ``jvp``/``vmap``
    over its parameters: torch.func cannot write a dual or batched value into the buffer
    (``out=``), so these extensions cannot run it. (First order, the GGN diagonals, square
    roots and HMP run it with plain parameter values on copies of the buffers.)"""
    names = [type(e).__name__ for e in exts if "jvp" in type(e).function_needs]  # forward mode over params
    if not names:
        return
    layers = {layer.path: layer for layer in program.layers.values() if layer.kind == "generic"}
    for site in sites:
        layer = layers.get(site.where)
        found = buffer_updates(layer.module) if layer is not None else []
        if found:
            raise CurvatureError(
                f"{names[0]} runs layer '{site.where}' ({type(layer.module).__name__}, no hand-written curvlib "
                f"rule) under torch.func's forward mode or vmap over its parameters, but in training mode its "
                f"forward updates buffers in place ({', '.join(found)}: the power iteration writes u, v with "
                "out=), which torch.func cannot run. Run the model once in training mode, then call .eval() "
                "on it (the same W / σ(W), u and v now fixed), or freeze the layer, or use the first-order "
                "extensions, the GGN diagonals and square roots, or HMP."
            )


#: The family's record (:class:`~curvlib._core.family.Family`), registered in :data:`curvlib.rules.FAMILIES`.
FAMILY = Family("generic", (), forward, root_last=True, row_map=fixed_rows.row_map, runs_own_code=True,
                exact_block=True, shared_hessian=True)
