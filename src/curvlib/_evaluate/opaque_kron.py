r"""Kronecker factors of the ``Linear`` layers inside a module run whole.

curvlib runs a module whole, by the generic rule, when torch.fx cannot trace it or when it
sorts the rows of the whole batch (a mixture of experts' dispatch). Such a module may hold
``Linear`` layers (a router, an attention's projections) whose Kronecker factors need each
layer's input rows $x_s$ and the pulled-back root $m_{v,s}$ at its output rows, which the
generic rule's pullback through the whole module does not give.

They are computed sample by sample, as the generic rule runs the module (a batch of one,
vmapped, or one call per sample where the module reads values into Python):

1. the module runs on sample $n$'s rows with each inner ``Linear`` call recorded by its
   family's own forward, which notes the call's output shape;
2. it runs again with a zero offset $\delta_c$ added to the output of every call $c$; the
   vector-Jacobian product of the module's output with respect to the offsets pulls each
   root column $m_v$ back to $m_{v,c} = (\partial y / \partial z_c)^\top m_v$ at the call's
   output rows, and the second run's records hold the call's input rows $x_c$;
3. a layer's rows over all its calls in the module are one sample's positions $s$ sharing
   the weight, and the family's own formulas (:func:`curvlib.rules.kron_factors`,
   :func:`curvlib.rules.kron_input_factor`) on a batch of that one sample give
   $B_n$ and $A_n$.

Over the batch, $B = \sum_n B_n$ and $A = \frac{1}{N} \sum_n A_n$: the factors of the whole
batch for each ``kfac_approx`` (``None``: $B = \sum_{v,n} (\sum_s m)(\sum_s m)^\top$,
$A = \frac{1}{N} \sum_{n,s} x x^\top$; ``"expand"``: $B = \sum_{v,n,s} m m^\top$,
$A = \frac{1}{NS} \sum_{n,s} x x^\top$; ``"reduce"``: $A = \frac{1}{N} \sum_n \bar x \bar x^\top$),
exactly what the same layer gets where the module is traced.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Dict, List, Tuple

import torch
from torch import Tensor, nn
from torch.func import vjp, vmap

from .._core.site import Site, sample_layout
from .._core.sync import LOCK
from .._core.tensors import dense
from ..rules import FAMILY_OF, forward_for, kron_factors, kron_input_factor
from ..rules.fixed_rows import unused_block
from ..rules.generic import join_args, map_samples, output_tensor, stateless_call

__all__ = ["inner_layers", "covers", "factors"]


def inner_layers(module: nn.Module) -> Dict[str, nn.Module]:
    """``{path: submodule}`` of the layers inside ``module`` whose Kronecker factors this module
    forms: those of a family whose factors come from its rows
    (:attr:`~curvlib._core.family.Family.factors_from_rows`: ``nn.Linear``)."""
    found = {}
    for path, sub in module.named_modules(remove_duplicate=False):
        if not path or path in found:
            continue
        if FAMILY_OF[forward_for(sub)[1]].factors_from_rows:
            found[path] = sub
    return found


def covers(site: Site, role: str) -> bool:
    """Whether ``role`` is a parameter of a Linear inside the module run whole at ``site`` (its
    layer's :attr:`~curvlib._trace.layer.Layer.kron_inside_rows`)."""
    return site.params.get(role) in site.meta.get("kron_rows", ())


def factors(site: Site, role: str, m: Tensor, cache: dict, approx=None, max_dim=None) -> List[Tensor]:
    """Kronecker factors of ``role`` (:func:`covers`) from the root ``m [V, N, *out]`` pulled back
    to the generic site's output, in BackPACK's order: ``[B, A]`` for a weight, ``[B]`` for a
    bias. Every inner layer's factors are formed in one pass, kept in ``cache``."""
    key = ("inner_kron", site.key, approx, max_dim)
    if key not in cache:
        cache[key] = _all_factors(site, m, approx, max_dim)
    path, own = role.rsplit(".", 1)
    B, A, calls = cache[key][path]
    if not calls:  # a layer the module never calls: zero factors, as for any unused parameter
        return unused_block(site.saved[f"param:{role}"], max_dim)
    return [B] if own == "bias" else [B, A]


class _Calls:
    """The recorder handed to the inner layers' family forwards: notes each call's site and
    output, and adds the call's offset to its output once offsets are given."""

    def __init__(self, offsets=None):
        self.offsets = offsets
        self.sites: List[Site] = []
        self.outputs: List[Tuple[torch.Size, torch.dtype]] = []

    def add(self, site: Site, out: Tensor) -> Tensor:
        k = len(self.sites)
        self.sites.append(site)
        self.outputs.append((out.shape, out.dtype))
        return out if self.offsets is None else out + self.offsets[k]


@contextlib.contextmanager
def _recorded(layers: Dict[str, nn.Module], calls: _Calls):
    """Every layer of ``layers`` run by its family's forward into ``calls`` for the block (an
    instance ``forward`` each, removed after; under :data:`~curvlib._core.sync.LOCK`, which
    :func:`~curvlib.rules.generic.stateless_call` also takes). The layer's parameters are read at
    call time: the values the generic rule substituted."""
    patched = []
    with LOCK:
        for path, sub in layers.items():
            run, _ = forward_for(sub)
            roles = [r for r, _ in sub.named_parameters(recurse=False)]

            def forward(*args, _sub=sub, _path=path, _run=run, _roles=roles, **kwargs):
                tensors = {r: getattr(_sub, r) for r in _roles}
                return _run(_sub, _path, {r: f"{_path}.{r}" for r in _roles}, tensors, args, kwargs, calls)

            patched.append((sub, sub.__dict__.get("forward")))
            sub.forward = forward
        try:
            yield
        finally:
            for sub, old in patched:
                if old is None:
                    del sub.forward
                else:
                    sub.forward = old


def _all_factors(site: Site, m: Tensor, approx, max_dim) -> Dict[str, Tuple[Tensor, Tensor]]:
    """``{inner layer path: (B, A, calls)}`` over the batch (see the module docstring); ``calls``:
    how many times the samples' runs called the layer."""
    module = site.meta["module"]
    layers = inner_layers(module)
    n = m.shape[1]
    params = {k[6:]: v for k, v in site.saved.items() if k.startswith("param:")}
    inputs = {k: dense(v) for k, v in site.saved.items() if not k.startswith("param:")}
    own, out_dim = sample_layout(site, inputs, n)
    in_dims = {k: None if d is None else 0 for k, d in own.items()}

    def run(args, kwargs, calls: _Calls) -> Tensor:
        with _recorded(layers, calls):
            return output_tensor(site, stateless_call(module, params, args, kwargs))

    def one_sample(inputs_n: Dict[str, Tensor], m_n: Tensor):
        inputs_n = {k: v if own[k] is None else v.unsqueeze(own[k]) for k, v in inputs_n.items()}
        args, kwargs = join_args(inputs_n, site.meta["pos_static"], site.meta["kw_static"])
        seen = _Calls()  # the calls' sites (their inputs) and output shapes
        with torch.no_grad():
            run(args, kwargs, seen)
        if not seen.outputs:  # the sample's run calls none of them
            return _sample_factors(layers, [], [], approx, max_dim)
        offsets = [torch.zeros(shape, dtype=dtype, device=m_n.device) for shape, dtype in seen.outputs]
        _, pullback = vjp(lambda d: run(args, kwargs, _Calls(d)), offsets)
        pulled = _pulled_columns(pullback, m_n.unsqueeze(out_dim + 1))
        return _sample_factors(layers, seen.sites, pulled, approx, max_dim)

    per_sample = map_samples(one_sample, (in_dims, 1), key=module)(inputs, dense(m))
    return {path: (B.sum(0), A.mean(0), int(calls.sum())) for path, (B, A, calls) in per_sample.items()}


def _pulled_columns(pullback, columns: Tensor) -> List[Tensor]:
    """Per call ``[V, *out_c]``: ``pullback`` of every column of ``columns [V, *out]``, vmapped, or
    one by one where the module's backward has no batching rule."""
    try:
        return vmap(lambda c: pullback(c)[0])(columns)
    except RuntimeError:
        pulled = [pullback(c)[0] for c in columns.unbind(0)]
        return [torch.stack(per_call) for per_call in zip(*pulled)]


def _sample_factors(layers: Dict[str, nn.Module], sites: List[Site], pulled: List[Tensor], approx,
                    max_dim) -> Dict[str, Tuple[Tensor, Tensor, Tensor]]:
    """``{path: (B_n, A_n, calls)}`` of one sample: each layer's rows over all its calls as the
    positions of a batch of one (input ``[1, S, I]``, root ``[V, 1, S, O]``); zero factors for a
    layer the sample's run did not call."""
    out = {}
    for path, sub in layers.items():
        mine = [k for k, s in enumerate(sites) if s.where == path]
        calls = torch.tensor(len(mine))
        if not mine:
            out[path] = (_zero(sub.weight.shape[0], max_dim, sub.weight), _zero(sub.weight.shape[1], max_dim, sub.weight),
                         calls)
            continue
        x = torch.cat([sites[k].saved["x"].reshape(-1, sites[k].saved["x"].shape[-1]) for k in mine])
        v = pulled[mine[0]].shape[0]
        root = torch.cat([pulled[k].reshape(v, -1, pulled[k].shape[-1]) for k in mine], dim=1)
        one = replace(sites[mine[0]], saved={"x": x.unsqueeze(0)})
        out[path] = (kron_factors(one, "bias", root.unsqueeze(1), approx, max_dim)[0],
                     kron_input_factor(one, approx, max_dim), calls)
    return out


def _zero(side: int, max_dim, like: Tensor) -> Tensor:
    """A zero factor of one side, diagonal (1-D) where the side exceeds ``max_dim``, as
    :func:`curvlib.rules._gram.gram` forms them."""
    return like.new_zeros((side,) if max_dim is not None and side > max_dim else (side, side))
