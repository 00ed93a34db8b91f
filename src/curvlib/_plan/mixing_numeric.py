"""Numeric tests for what the graph does not explain (see :mod:`curvlib._plan.independence`).

*Pending* nodes (parametrized modules run by the generic rule, parameter-free modules and
operations outside curvlib's tables) are run once more on their real inputs from one extra
forward (no gradients, forked random state):

* **leak test**: sample ``j``'s rows of every batched input are changed (floats: noise of the
  input's scale; integers: another sample's rows), for ``j = 0`` and ``j = N - 1``; every other
  sample's output rows must stay the same, within ``64 ε`` of the output's scale. Both runs draw
  the same random numbers (same seed, same shapes), so dropout masks agree and a module with
  active dropout is tested as well;
* **alone test** (generic layers, when two runs with different seeds agree: no active dropout):
  sample 0 run as a batch of one, as the generic rule recomputes it, must give its row of the
  batched output within ``√ε`` of the output's scale (a layer whose code fails on it: refused).

A model without a graph is tested on its own forward: its generic layers' sites as above, and a
noise added to sample ``j``'s rows of every layer output must not reach other samples' model
outputs. With ``N = 1`` nothing is tested.
"""

from __future__ import annotations

import functools
from typing import Callable, List, Optional

import torch
from torch import Tensor, fx

from .._core import inputs as _inputs
from .._core.errors import CurvatureError
from . import mixing_index as _index
from .mixing_ops import Batch
from .mixing_checks import label
from .mixing_probe import SEED, FailsAlone, leak, probe, sample_rows, seeded
from .._core.site import Recorder
from .._core.tensors import inside_transform
from ..rules import FAMILY_OF
from ..rules.generic import join_args, stateless_call
from .._interpret.graph import run_graph

__all__ = ["gather_problem", "pending_problem", "untraced_problem"]

def _plain(t):
    """Inside a torch.func transform: the plain value of a wrapped tensor (under ``vmap``, its
    first member), so that the tests run outside the transform on ordinary tensors."""
    functorch = torch._C._functorch
    while isinstance(t, Tensor) and functorch.is_functorch_wrapped_tensor(t):
        bdim = functorch.maybe_get_bdim(t) if functorch.is_batchedtensor(t) else -1
        t = functorch.get_unwrapped(t)
        t = t.select(bdim, 0) if bdim >= 0 else t
    return t


def outside_transforms(test: Callable) -> Callable:
    """Run ``test(program, ..., X, params, ...)`` on plain tensors, with functorch disabled."""

    @functools.wraps(test)
    def run(program, found_or_plan, X, params, *rest):
        # (only under a transform: a model calling torch.vmap itself cannot run with functorch disabled)
        if not inside_transform():
            return test(program, found_or_plan, X, params, *rest)
        with torch._C._DisableFuncTorch():
            plain = {name: _plain(v) for name, v in params.items()}
            try:
                return test(program, found_or_plan, _inputs.map_tensors(_plain, X), plain, *rest)
            except RuntimeError as exc:
                raise CurvatureError(_outside_failed(program, exc)) from exc

    return run


def _outside_failed(program, exc: Exception) -> str:
    model = program.root.get_submodule(program.prefix[:-1]) if program.prefix else program.root
    why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (f"Model {type(model).__name__} could not run outside the enclosing torch.func transform for "
            f"curvlib's numeric test of sample mixing (torch: {why}). A model that calls torch.vmap (or "
            "another torch.func transform) in its forward is not supported when curvature is itself "
            "called inside a torch.func transform (vmap, grad, jacrev): there it must run with functorch "
            "switched off. Call curvature outside the transform, or build the model's masks without vmap.")


def _map_leaves(value, leaves: list, fn: Callable):
    """``value`` with its tensor leaves replaced by ``fn(tensor, layout)``, in order."""
    it = iter(leaves)

    def go(v):
        if isinstance(v, Tensor):
            return fn(v, next(it, None))
        if isinstance(v, (tuple, list)):
            return type(v)(go(x) for x in v) if not hasattr(v, "_fields") else type(v)(*(go(x) for x in v))
        return v

    return go(value)


def _node_call(program, node: fx.Node, params) -> Callable:
    """``(args, kwargs) -> value`` of a node, with the plan's parameters and copies of buffers."""
    if node.op == "call_module":
        module = program.root.get_submodule(node.target)
        layer = program.layers.get(node.target)
        tensors = {role: params[name] for role, name in layer.names.items()} if layer is not None else {}

        def call(args, kwargs):
            buffers = {name: b.clone() for name, b in module.named_buffers()}  # never update the model's
            return stateless_call(module, {**tensors, **buffers}, args, kwargs)

        return call
    if node.op == "call_method":
        return lambda args, kwargs: getattr(args[0], node.target)(*args[1:], **kwargs)
    return lambda args, kwargs: node.target(*args, **kwargs)


@outside_transforms
def pending_problem(program, found, X: Tensor, params, trainable) -> Optional[str]:
    """The first pending node that fails its test, in words (``None``: all pass)."""
    n = _inputs.batch_size(X)
    if n < 2 or not found.pending:
        return None
    env: dict = {}
    with seeded(_inputs.first(X).device, SEED):
        run_graph(program, X, params, trainable, Recorder(None), env=env)
    for node in found.pending:
        def load(fn, node=node):
            one = lambda a: _map_leaves(env[a], found.layouts.get(a, []), fn)  # noqa: E731
            return fx.node.map_arg(node.args, one), fx.node.map_arg(node.kwargs, one)

        module = program.root.get_submodule(node.target) if node.op == "call_module" else None
        layer = program.layers.get(node.target) if node.op == "call_module" else None
        # only layers with trainable parameters are recomputed per sample (by the generic rule)
        alone = layer is not None and any(name in trainable for name in layer.names.values())
        try:
            why = probe(_node_call(program, node, params), load, found.layouts[node], n, _inputs.first(X).device, alone)
        except FailsAlone as exc:
            raise CurvatureError(  # (not a mixing verdict: the layer's own code fails on a batch of one)
                f"Layer '{layer.path}' ({type(module).__name__}, graph node '{node.name}') has no curvlib rule: its per-"
                f"sample quantities run it on each sample alone, which fails in its own code ({exc}). They are refused; "
                "loss, grad, GGNMP and HMP (whole-batch) are not. Freeze its parameters to get the others.") from exc
        if why:
            name = getattr(node.target, "__name__", str(node.target))
            return f"graph node '{node.name}' ({label(node, name, module)}{why})"
    return None


def _site_problem(site, n: int, device) -> Optional[str]:
    """The leak and alone tests of a generic site of a model without a graph."""
    module = site.meta["module"]
    tensors = {k[6:]: v for k, v in site.saved.items() if k.startswith("param:")}
    inputs = {k: v for k, v in site.saved.items() if not k.startswith("param:")}
    layout = {k: Batch(0) if v.dim() > 0 and v.shape[0] == n else None for k, v in inputs.items()}

    def load(fn):
        return join_args({k: fn(v, layout[k]) for k, v in inputs.items()}, site.meta["pos_static"],
                          site.meta["kw_static"])

    def call(args, kwargs):
        buffers = {name: b.clone() for name, b in module.named_buffers()}
        return stateless_call(module, {**tensors, **buffers}, args, kwargs)

    return probe(call, load, [Batch(0)], n, device, alone=True)


@outside_transforms
def untraced_problem(program, plan, X: Tensor, params, trainable, runner) -> Optional[str]:
    """Numeric tests of a model without a graph (see the module doc)."""
    n, device = _inputs.batch_size(X), _inputs.first(X).device
    if n < 2 or not plan.site_shapes:
        return None
    rec = Recorder(None)
    with seeded(device, SEED):
        base = runner(program, X, params, trainable, rec)
    for site in rec.sites:
        why = FAMILY_OF[site.rule.kind].runs_own_code and _site_problem(site, n, device)
        if why:  # (a generic site: the module's own code, run on one sample)
            return f"layer '{site.where}' ({type(site.meta['module']).__name__}){why}"
    gen = torch.Generator().manual_seed(SEED)

    def run(probes: List[Tensor]):
        with seeded(device, SEED):
            return runner(program, X, params, trainable,
                          Recorder(probes, batch_dims=plan.batch_dims, saved_dims=plan.saved_dims))

    for j in sorted({0, n - 1}):
        gap = leak(base, run(_noise(plan, j, n, gen, None, device)), [Batch(0)], j, n)
        if not gap:
            continue
        blamed = next((k for k in range(len(plan.site_shapes))
                       if leak(base, run(_noise(plan, j, n, gen, k, device)), [Batch(0)], j, n)), None)
        where = f"layer '{plan.sites[blamed].where}'" if blamed is not None else "its layers"
        return (f"the model's own forward (it has no graph; tested numerically): noise added to "
                f"sample {j}'s rows of the output of {where} changed other samples' model outputs by "
                f"up to {gap:.3g}, so the forward mixes samples after that layer")
    return None


def _noise(plan, j: int, n: int, gen: torch.Generator, only: Optional[int], device) -> List[Tensor]:
    """A probe per site (batch first): noise on sample ``j``'s rows of every layer output (or of
    layer ``only``), zero elsewhere."""
    probes: List[Tensor] = []
    for k, (shape, dtype) in enumerate(zip(plan.site_shapes, plan.site_dtypes)):
        p = torch.zeros(shape, dtype=dtype, device=device)
        if only is None or k == only:  # unit noise on sample j's rows
            mine = sample_rows(shape[0], Batch(0), n, j, device).reshape([-1] + [1] * (len(shape) - 1))
            p = torch.randn(shape, generator=gen, dtype=dtype, device="cpu").to(device) * mine
        probes.append(p)
    return probes


@outside_transforms
def gather_problem(program, gathers, X: Tensor, params, trainable) -> Optional[str]:
    """The sample-id test (:mod:`curvlib._plan.mixing_index`) of every indexing node whose
    batch-dim index depends on the input's values, on this call's values (computed from the
    input alone where the index allows, else by one forward)."""
    n = _inputs.batch_size(X)
    with seeded(_inputs.first(X).device, SEED):
        env = _index.input_values(program, X, [a for check in gathers for a in check.inputs])
        if env is None:  # the index needs the model's layers: the whole forward
            env = {}
            run_graph(program, X, params, trainable, Recorder(None), env=env)
    for check in gathers:
        node = check.node
        name = "getitem" if getattr(node.target, "__name__", "") == "getitem" else _index_name(node)
        found = _index.gather_slots(name, node, check.args, check.batch, len(check.shape))
        if found is None:
            continue
        items, needed = found
        flat = _index.needed_values(items, needed, lambda a: env.get(a, _index.MISSING))
        if flat is None:
            return f"graph node '{node.name}' ({label(node, name)}: its index could not be computed on this input)"
        flat = [v.cpu() if isinstance(v, Tensor) else v for v in flat]
        out = _index.run_check(name, node, check.args, check.shape, check.batch, flat, n)
        why, _ = _index.sample_check(out, check.layout, n)
        if why:
            return (f"graph node '{node.name}' ({label(node, name)} of '{check.source.name}' {why} on this "
                    "input: its index depends on the input's values, tested on every call)")
    return None


def _index_name(node: fx.Node) -> str:
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return name.split(".")[0]
