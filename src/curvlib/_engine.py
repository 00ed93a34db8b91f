"""Run a traced :class:`~curvlib._program.Program` functionally and differentiate it.

One evaluation is

1. *plan* (once per input signature, cached): run the graph on fake tensors
   for batch sizes ``N`` and ``N + 1`` to learn every site's output shape and
   which of its dimensions is the batch, and the model's output shape, so
   that targets and layers are checked before any real work;
2. *forward*: run the graph with real tensors under :func:`torch.func.vjp`,
   adding a zero probe to every site's output;
3. *backward*: ``g_k = ∂L/∂probe_k`` for all sites in one vector-Jacobian
   product seeded with ``∂L/∂output``;
4. *read off*: each site's rule turns ``(saved inputs, g_k)`` into per-sample
   quantities; a parameter used by several sites sums its individual
   gradients over the sites before any square or norm is taken.

Everything here is a pure function of ``(params, X, y)``; it composes with
:func:`torch.func.vmap` because it only uses torch.func transforms.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor, fx, nn
from torch.func import vjp
from torch.utils import _pytree as pytree

from . import _dropout, _independence, _inputs, _residuals
from ._errors import CurvatureError
from ._program import Program
from .rules import call_without_hooks, functional
from .rules._site import Recorder, Site

__all__ = ["Plan", "make_plan", "run_graph", "forward_with_probes", "first_order", "has_inplace"]


def _lookup(root: nn.Module, target: str):
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def run_graph(
    program: Program,
    X: Tensor,
    params: Mapping[str, Tensor],
    trainable: frozenset,
    rec: Recorder,
    fake_tensor: Optional[Callable[[Tensor], Tensor]] = None,
    env: Optional[Dict[fx.Node, object]] = None,
    preserve_inputs: bool = False,
) -> Tensor:
    """Interpret the program's graph on input ``X``.

    Args:
        program: the traced model.
        X: input ``[N, *]``.
        params: canonical name -> tensor for *every* parameter of the model.
        trainable: names whose quantities are wanted (their sites get probes).
        rec: collects the sites.
        fake_tensor: during planning, turns a real buffer read by ``get_attr``
            into a fake one (``None`` otherwise).

        env: if given, filled with every node's value.
        preserve_inputs: run in-place nodes on copies of their inputs, so that ``env``
            keeps every node's own value (only for chains, where nobody reads an
            in-place node's input again: KFRA).

    Returns:
        The model output.
    """
    env = {} if env is None else env
    where: List[Optional[fx.Node]] = [None]  # the node being run
    try:
        return _interpret(program, X, params, trainable, rec, fake_tensor, env, where, preserve_inputs)
    except (CurvatureError, NodeFailure):
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with the graph node that failed
        raise NodeFailure(program, where[0], exc) from exc


class NodeFailure(RuntimeError):
    """The model's forward raised at a graph node: the node and the original error."""

    def __init__(self, program: Program, node: Optional[fx.Node], exc: BaseException):
        self.program, self.node, self.exc = program, node, exc
        where = f" at graph node '{node.name}'" if node is not None else ""
        super().__init__(f"{type(exc).__name__}{where}: {exc}")


def _interpret(program, X, params, trainable, rec, fake_tensor, env, where, preserve_inputs=False) -> Tensor:
    leaves = _inputs.trace_leaves(X) if program.leaf_inputs else None  # one placeholder per leaf
    dropout = _dropout.new_generator()  # None unless this call has active dropout
    noises = env.setdefault(_dropout.NOISES, {}) if dropout is not None else None
    placeholders_seen = 0
    result = None
    for node in program.graph.nodes:
        where[0] = node
        load = lambda a: fx.node.map_arg(a, lambda n: env[n])  # noqa: E731
        before = None
        if node in rec.residual_nodes and _residuals.is_inplace(program, node):
            # The node overwrites its input: keep the value it is a function of.
            before = {a: env[a].clone() for a in node.all_input_nodes if isinstance(env.get(a), Tensor)}
        dropout_kind = _dropout.node_dropout(program, node) if dropout is not None else None
        if preserve_inputs and node.op != "placeholder" and _residuals.is_inplace(program, node):
            load = lambda a: fx.node.map_arg(a, lambda n: env[n].clone() if isinstance(env[n], Tensor) else env[n])  # noqa: E731
        if node.op == "placeholder":
            env[node] = leaves[placeholders_seen] if leaves is not None else _placeholder(node, X, placeholders_seen)
            placeholders_seen += 1
        elif node.op == "get_attr":
            value = _lookup(program.root, node.target)
            if isinstance(value, nn.Parameter):
                value = params[program.param_names[id(value)]]
            elif isinstance(value, Tensor) and fake_tensor is not None:
                value = fake_tensor(value)
            env[node] = value
        elif dropout_kind is not None:  # dropout: the mask from this call's generator
            env[node] = _dropout.run_node(program, node, dropout_kind, load(node.args), load(node.kwargs), dropout, noises)
        elif node.op == "call_module":
            env[node] = _call_module(program, node, load(node.args), load(node.kwargs), params, trainable, rec)
        elif node.op == "call_function":
            env[node] = node.target(*load(node.args), **load(node.kwargs))
        elif node.op == "call_method":
            self_obj, *rest = load(node.args)
            env[node] = getattr(self_obj, node.target)(*rest, **load(node.kwargs))
        use = program.functional.get(node)
        if use is not None and any(n in trainable for n in use.params):
            env[node] = functional.record(
                use, program.root, program.param_names,
                {n: n for n in use.params if n in trainable},
                {n: params[n] for n in use.params},
                [env[a] for a in use.inputs], env[node], rec,
            )
        if node in rec.residual_nodes:
            _residuals.record(program, node, rec.residual_nodes[node], env, params, trainable, rec,
                              program.dependent, before)
            if before is not None:
                # In eager PyTorch the overwritten input *is* the output: alias it, so
                # that later uses of the input see the output's probe too.
                first = node.all_input_nodes[0]
                env[first] = env[node]
        if node.op == "output":
            result = load(node.args[0])
            if program.out_spec is not None:
                result = pytree.tree_unflatten(list(result), program.out_spec)
    if not isinstance(result, Tensor):
        raise CurvatureError(
            f"The model returns {type(result).__name__}; curvlib needs a single "
            "output tensor with the batch in dim 0."
        )
    return result


def _placeholder(node: fx.Node, X, seen: int):
    if seen == 0:
        return X
    if node.args:
        return node.args[0]  # default value of a further argument
    raise CurvatureError(
        f"The model's forward takes a second required argument '{node.target}'; curvlib calls "
        "model(X) with one argument (pass several inputs as a dict or tuple X)."
    )


def _call_module(program, node: fx.Node, args, kwargs, params, trainable, rec):
    """A module node: a layer through its rule (recording its sites), any other module
    by its own ``forward`` (hooks are not part of the math and are not run)."""
    layer = program.layers.get(node.target)
    if layer is None:
        return call_without_hooks(_lookup(program.root, node.target), args, kwargs)
    names = {r: n for r, n in layer.names.items() if n in trainable}
    tensors = {r: params[n] for r, n in layer.names.items()}
    first_site = len(rec.sites)
    out = layer.forward(layer.module, layer.path, names, tensors, args, kwargs, rec)
    for site in rec.sites[first_site:]:
        site.meta["family"] = layer.kind
    return out


@dataclass(frozen=True)
class Plan:
    """What one input signature looks like (cached).

    Attributes:
        out_shape: the model output's shape.
        site_shapes: output shape of every site, in recording order.
        site_dtypes: their dtypes.
        batch_dims: the batch dimension of every site's output.
    """

    out_shape: Tuple[int, ...]
    out_dtype: torch.dtype
    site_shapes: Tuple[Tuple[int, ...], ...]
    site_dtypes: Tuple[torch.dtype, ...]
    batch_dims: Tuple[int, ...]
    residual_shapes: Tuple[Tuple[int, ...], ...] = ()
    sites: Tuple[Site, ...] = ()
    # per residual: the batch dim of each input and of the output
    residual_dims: Tuple[Tuple[Tuple[int, ...], int], ...] = ()
    independence: Optional[_independence.Independence] = None  # samples mixed inside the model?


def module_checks(program: Program) -> List[Callable[[], None]]:
    """The per-call checks of the modules the graph calls (e.g. BatchNorm's mode).

    Found once per traced program: only families with a ``check`` contribute,
    so the per-call cost is one call per such module (none for an MLP).
    """
    from .rules import checker_for

    checks, seen = [], set()
    for node in program.graph.nodes:
        if node.op == "call_module" and node.target not in seen:
            seen.add(node.target)
            module = _lookup(program.root, node.target)
            path = node.target[len(program.prefix):] if node.target.startswith(program.prefix) else node.target
            check = checker_for(module)
            if check is not None:
                checks.append(lambda check=check, module=module, where=path or type(module).__name__: check(module, where))
    return checks


def _shape_pass(program, X, params, trainable, batch, residual_nodes=None, runner=None, env=None):
    """Sites and output of a forward on fake tensors with batch size ``batch``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with _quiet_fake_tensor_log(), FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = lambda t: mode.from_tensor(t) if not isinstance(t, torch._subclasses.FakeTensor) else t  # noqa: E731
        Xf = _inputs.with_batch(X, batch, real=False)
        pf = {k: torch.empty(tuple(v.shape), dtype=v.dtype, device=v.device) for k, v in params.items()}
        rec = Recorder(None, residual_nodes=residual_nodes)
        with torch.no_grad():
            out = (runner or run_graph)(program, Xf, pf, trainable, rec, fake_tensor=fake, env=env)
        return rec, out


def _real_shape_pass(program, X, params, trainable, batch, residual_nodes=None, runner=None, env=None):
    """Fallback of :func:`_shape_pass` for ops that fake tensors do not support."""
    Xb = _inputs.with_batch(X, batch, real=True)
    device = _inputs.first(X).device
    rec = Recorder(None, residual_nodes=residual_nodes)
    # Forked random state: the passes take the same random branches as the real forward.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        out = (runner or run_graph)(program, Xb, params, trainable, rec, env=env)
    return rec, out


def _checked_shape_pass(program, X, params, trainable, batch, residual_nodes, runner, env):
    """A shape pass on fake tensors (on real ones for ops without a fake kernel); a model
    that fails on ``X`` is reported by :func:`curvlib._diagnose.forward_failure`."""
    try:
        return _shape_pass(program, X, params, trainable, batch, residual_nodes, runner, env)
    except CurvatureError:
        raise
    except Exception:  # noqa: BLE001 - an op without a fake-tensor kernel, or a real failure
        env.clear()
    try:
        return _real_shape_pass(program, X, params, trainable, batch, residual_nodes, runner, env)
    except CurvatureError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported with the node, the input and a likely cause
        from ._diagnose import forward_failure

        raise forward_failure(program, X, params, exc, batch) from exc


class _FakeTensorNoise(logging.Filter):
    """Drops the ERROR records FakeTensorMode logs for a failing op while curvlib's shape
    pass runs in this thread (curvlib reports the failure itself, naming the node)."""

    active = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(self.active, "on", False)


_FAKE_LOGGER = logging.getLogger("torch._subclasses.fake_tensor")
_FAKE_FILTER = _FakeTensorNoise()
_FAKE_LOGGER.addFilter(_FAKE_FILTER)


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    before = getattr(_FakeTensorNoise.active, "on", False)
    _FakeTensorNoise.active.on = True
    try:
        yield
    finally:
        _FakeTensorNoise.active.on = before


def _batch_dim(shape_a, shape_b, n_a, n_b, where: str) -> int:
    """The one dimension whose size is the batch size in both passes."""
    dims = [d for d, (a, b) in enumerate(zip(shape_a, shape_b)) if a != b]
    if len(dims) == 1 and shape_a[dims[0]] == n_a and shape_b[dims[0]] == n_b:
        return dims[0]
    if not dims:
        why = "does not change with the batch size"
    else:
        why = f"changes with the batch size in dims {dims}, not in exactly one dim of size N"
    raise CurvatureError(
        f"Layer '{where}': its output (shape {list(shape_a)} for N={n_a}) {why}. curvlib "
        "needs every parametrized layer to act on each sample of the batch separately, "
        "with the batch as one dimension of its output (e.g. do not merge the batch "
        "with another axis before a layer)."
    )


def _check_generic_inputs(site: Site, site_b: Site, n: int) -> None:
    """Generic sites slice their inputs per sample along dim 0: check that is the batch."""
    for key, a in site.saved.items():
        b = site_b.saved.get(key)
        if key.startswith("param:") or not isinstance(a, Tensor) or not isinstance(b, Tensor):
            continue
        if tuple(a.shape) == tuple(b.shape):
            continue  # not batched: passed unchanged to every sample
        if a.shape[0] == n and b.shape[0] == n + 1 and tuple(a.shape[1:]) == tuple(b.shape[1:]):
            continue
        raise CurvatureError(
            f"Layer '{site.where}': an input of shape {list(a.shape)} (for N={n}) does not "
            "carry the batch in dim 0, which curvlib's generic rule needs to split it per "
            "sample. Move the batch to dim 0 before this operation."
        )


def make_plan(program: Program, X: Tensor, params, trainable, residual_nodes=None, runner=None) -> Plan:
    """Learn shapes and batch dimensions (see the module docstring)."""
    n = _inputs.batch_size(X)
    env_a, env_b = {}, {}  # every node's value in both passes (for _independence)
    rec_a, out_a = _checked_shape_pass(program, X, params, trainable, n, residual_nodes, runner, env_a)
    rec_b, out_b = _checked_shape_pass(program, X, params, trainable, n + 1, residual_nodes, runner, env_b)
    calls_a, calls_b = [s.where for s in rec_a.sites], [s.where for s in rec_b.sites]
    if calls_a != calls_b:  # only possible without a graph (control flow in forward)
        raise CurvatureError(
            f"The model calls its parametrized layers differently for a batch of N={n} "
            f"({calls_a}) and of N={n + 1} ({calls_b}) samples: its forward takes a path "
            "that depends on the whole batch (or on random numbers drawn after batch-sized "
            "ones), so the samples are not independent and per-sample quantities are not "
            "defined. Make the control flow depend on each sample alone (or on nothing)."
        )
    if out_a.dim() == 0 or out_a.shape[0] != n or out_b.shape[0] != n + 1:
        raise CurvatureError(
            f"The model output has shape {list(out_a.shape)} for an input batch of "
            f"N={n}; curvlib needs the batch in dim 0 of the output."
        )
    batch_dims = []
    for site, sa, sb in zip(rec_a.sites, rec_a.out_shapes, rec_b.out_shapes):
        d = _batch_dim(sa, sb, n, n + 1, site.where)
        if d != 0 and not site.rule.any_batch_dim:
            raise CurvatureError(
                f"Layer '{site.where}' ({site.rule.kind}): the batch is in dim {d} of its "
                f"output (shape {list(sa)}), but this layer needs it in dim 0."
            )
        batch_dims.append(d)
    residual_dims = _residuals.batch_dims(rec_a, rec_b)
    _residuals.check_sizes(rec_a.residuals, residual_dims, n)
    for site, site_b in zip(rec_a.sites, rec_b.sites):
        if site.rule.kind == "generic":
            _check_generic_inputs(site, site_b, n)
    return Plan(
        out_shape=tuple(out_a.shape),
        out_dtype=out_a.dtype,
        site_shapes=tuple(rec_a.out_shapes),
        site_dtypes=tuple(rec_a.out_dtypes),
        batch_dims=tuple(batch_dims),
        residual_shapes=tuple(rec_a.residual_shapes),
        residual_dims=residual_dims,
        independence=_independence.analyse(program, env_a, env_b, n, trainable),  # samples mixed?
        sites=tuple(Site(s.rule, dict(s.params), s.where, meta=dict(s.meta), key=s.key) for s in rec_a.sites),
    )


@dataclass
class Linearization:
    """The forward pass of one evaluation, ready to pull vectors back.

    Attributes:
        out: model output ``[N, *]``.
        sites: recorded sites (saved tensors filled in).
        residuals: recorded element-wise nonlinearities (Hessian only).
        taps: their inputs ``a``, in the same order.
        pullback: ``(cot_out, cot_taps) -> (site_grads, residual_grads)``.
    """

    out: Tensor
    sites: List[Site]
    residuals: list
    taps: List[Tensor]
    pullback: Callable
    batched_pullback: Optional[Callable] = None
    pull_loss: Optional[Callable] = None
    values: Optional[Dict[fx.Node, object]] = None

    def pull(self, cot_out: Tensor, cot_taps: Optional[Sequence[Tensor]] = None):
        """Pull one cotangent back to every site output and residual output."""
        if cot_taps is None:
            cot_taps = [torch.zeros_like(t) for t in self.taps]
        return self.pullback((cot_out, list(cot_taps)))

    def pull_batched(self, cot_out: Optional[Tensor], cot_taps: Optional[Dict[int, Tensor]] = None):
        """Pull ``V`` cotangents at once (``cot_out [V, *out]`` and/or taps ``{i: [V, *a_i]}``).

        Returns the list of site gradients ``[V, *site_out]`` (residual
        gradients are dropped).
        """
        cot_taps = cot_taps or {}
        batched_out = cot_out is not None
        if self.batched_pullback is not None:  # plain autograd: is_grads_batched
            v = (cot_out if batched_out else next(iter(cot_taps.values()))).shape[0]
            if v == 1:  # one column: a plain backward is cheaper than a batched one
                c_out = cot_out[0] if batched_out else torch.zeros_like(self.out)
                c_taps = [cot_taps[i][0] if i in cot_taps else torch.zeros_like(t) for i, t in enumerate(self.taps)]
                return [g.unsqueeze(0) for g in self.pullback((c_out, c_taps))[0]]
            c_out = cot_out if batched_out else self.out.new_zeros((v,) + tuple(self.out.shape))
            c_taps = [cot_taps[i] if i in cot_taps else t.new_zeros((v,) + tuple(t.shape)) for i, t in enumerate(self.taps)]
            return self.batched_pullback(c_out, c_taps)
        out_arg = cot_out if batched_out else torch.zeros_like(self.out)
        tap_args = [cot_taps.get(i, torch.zeros_like(t)) for i, t in enumerate(self.taps)]
        tap_dims = [0 if i in cot_taps else None for i in range(len(self.taps))]

        def one(c_out, c_taps):
            return self.pullback((c_out, list(c_taps)))[0]

        return torch.func.vmap(one, in_dims=(0 if batched_out else None, tap_dims))(out_arg, tap_args)


def _inside_transform() -> bool:
    """Whether we run under a torch.func transform (vmap over an ensemble, grad, ...)."""
    try:
        return torch._C._functorch.maybe_current_level() is not None
    except AttributeError:  # pragma: no cover - older torch
        return True


def forward_with_probes(program: Program, plan: Plan, X: Tensor, params, trainable, residual_nodes=None, runner=None,
                        direct: bool = False, keep_values: bool = False, functorch: bool = False) -> Linearization:
    """Run the forward, differentiable with respect to the probes.

    Outside any torch.func transform this uses plain autograd (less overhead,
    the common case); inside one (``vmap`` over an ensemble of parameters) it
    uses :func:`torch.func.vjp`, which composes. Both give the same pullback.
    ``direct=True`` (plain autograd only; for graphs without in-place
    operations, see :func:`has_inplace`) differentiates with respect to the
    sites' outputs themselves instead of zero probes added to them.
    ``keep_values=True`` (plain autograd only) keeps every graph node's value in
    ``Linearization.values`` (KFRA's recursion reuses them). ``functorch=True``
    takes the torch.func route outside transforms too: its results stay
    differentiable w.r.t. inputs and parameter values that require grad.
    """
    if functorch or _inside_transform():
        return _forward_functorch(program, plan, X, params, trainable, residual_nodes, runner)
    if direct:
        lin = _forward_autograd(program, plan, X, params, trainable, residual_nodes, runner, True, keep_values)
        if lin is not None:
            return lin
    return _forward_autograd(program, plan, X, params, trainable, residual_nodes, runner, False, keep_values)


_INPLACE_OPERATORS = frozenset(
    getattr(operator, name) for name in (
        "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul",
        "iand", "ior", "ixor", "ilshift", "irshift",
    )
)


def has_inplace(program: Program) -> bool:
    """Whether any node of the graph may overwrite a tensor (``inplace=True``,
    ``x.relu_()``, ``x += y``). Such graphs keep the zero probes, which in-place
    operations cannot disturb (and a version check catches anything missed here)."""
    if program.graph is None:
        return True
    return any(
        _residuals.is_inplace(program, node)
        or (node.op == "call_function" and node.target in _INPLACE_OPERATORS)
        for node in program.graph.nodes
        if node.op in ("call_module", "call_method", "call_function")
    )


class _LazyProbes:
    """Zero probes created on first use (direct mode needs few or none)."""

    def __init__(self, plan: Plan, X: Tensor):
        self._plan, self._X = plan, X
        self._made: Dict[int, Tensor] = {}

    def __len__(self) -> int:
        return len(self._plan.site_shapes)

    def __getitem__(self, k: int) -> Tensor:
        if k not in self._made:
            self._made[k] = torch.zeros(
                self._plan.site_shapes[k], dtype=self._plan.site_dtypes[k], device=_inputs.first(self._X).device, requires_grad=True
            )
        return self._made[k]


def _zero_probes(plan: Plan, X: Tensor, requires_grad: bool):
    probes = [
        torch.zeros(shape, dtype=dtype, device=_inputs.first(X).device, requires_grad=requires_grad)
        for shape, dtype in zip(plan.site_shapes, plan.site_dtypes)
    ]
    rprobes = [
        torch.zeros(shape, dtype=plan.out_dtype, device=_inputs.first(X).device, requires_grad=requires_grad)
        for shape in plan.residual_shapes
    ]
    return probes, rprobes


def _finish(rec: Recorder, plan: Plan, saved, taps) -> None:
    if len(rec.sites) != len(plan.site_shapes):  # pragma: no cover - internal invariant
        raise RuntimeError("curvlib internal error: the forward recorded a different set of sites")
    for site, s in zip(rec.sites, saved):
        site.saved = s
        site.meta["batch_dim"] = plan.batch_dims[site.key]
    for r, (in_dims, out_dim) in zip(rec.residuals, plan.residual_dims):
        r.inputs = [taps[k] for k in r.taps]
        r.in_dims, r.out_dim = in_dims, out_dim


def _forward_functorch(program, plan, X, params, trainable, residual_nodes, runner) -> Linearization:
    probes, rprobes = _zero_probes(plan, X, requires_grad=False)
    recorded: List[Recorder] = []

    def forward(probes_, rprobes_):
        rec = Recorder(probes_, rprobes_ if residual_nodes else None, residual_nodes)
        out = (runner or run_graph)(program, X, params, trainable, rec)
        recorded.append(rec)
        return (out, [a for r in rec.residuals for a in r.inputs]), [s.saved for s in rec.sites]

    (out, taps), pullback, saved = vjp(forward, probes, rprobes, has_aux=True)
    rec = recorded[-1]
    _finish(rec, plan, saved, taps)
    return Linearization(out=out, sites=rec.sites, residuals=rec.residuals, taps=list(taps), pullback=pullback)


def _forward_autograd(program, plan, X, params, trainable, residual_nodes, runner, direct: bool = False,
                      keep_values: bool = False):
    """The forward under plain autograd (``None`` if ``direct`` and an in-place
    operation overwrote a site's output: the caller then runs it with probes)."""
    if direct:
        probes = _LazyProbes(plan, X)
        rprobes = [
            torch.zeros(shape, dtype=plan.out_dtype, device=_inputs.first(X).device, requires_grad=True)
            for shape in plan.residual_shapes
        ]
        # A floating input that requires grad puts the first layers' outputs into the
        # autograd graph (the engine never computes the input's own gradient).
        X = _inputs.map_tensors(lambda t: t.detach().requires_grad_(True) if t.is_floating_point() else t, X)
    else:
        probes, rprobes = _zero_probes(plan, X, requires_grad=True)
    rec = Recorder(probes, rprobes if residual_nodes else None, residual_nodes, direct=direct)
    values: Optional[Dict[fx.Node, object]] = {} if keep_values and runner is None else None
    with torch.enable_grad():
        if values is not None:
            out = run_graph(program, X, params, trainable, rec, env=values)
        else:
            out = (runner or run_graph)(program, X, params, trainable, rec)
    if direct and rec.overwritten():
        return None
    taps = [a for r in rec.residuals for a in r.inputs]
    inputs = list(rec.targets) + (rprobes if residual_nodes else [])
    n_sites = len(rec.targets)

    def pullback(cotangents, batched: bool = False):
        cot_out, cot_taps = cotangents
        pairs = [(o, c) for o, c in zip([out] + taps, [cot_out] + list(cot_taps)) if o.requires_grad]
        if not inputs or not pairs:
            grads = [None] * len(inputs)
        else:
            grads = torch.autograd.grad(
                [o for o, _ in pairs], inputs, [c for _, c in pairs],
                retain_graph=True, allow_unused=True, is_grads_batched=batched,
            )
        lead = (cot_out.shape[0],) if batched else ()
        grads = [torch.zeros(lead + tuple(i.shape), dtype=i.dtype, device=i.device) if g is None else g
                 for g, i in zip(grads, inputs)]
        return grads[:n_sites], grads[n_sites:]

    def pull_loss(loss_of: Callable[[Tensor], Tensor], retain: bool):
        """The loss and its gradient at every site in *one* backward from the loss
        (no separate backward for ``∂L/∂out``); ``retain=False`` frees the graph."""
        with torch.enable_grad():
            loss = loss_of(out)
        if not inputs or not loss.requires_grad:
            grads = [None] * len(inputs)
        else:
            grads = torch.autograd.grad(loss, inputs, retain_graph=retain, allow_unused=True)
        grads = [torch.zeros_like(i) if g is None else g for g, i in zip(grads, inputs)]
        return loss.detach(), (grads[:n_sites], grads[n_sites:])

    saved = [{k: v.detach() for k, v in site.saved.items()} for site in rec.sites]
    _finish(rec, plan, saved, [t.detach() for t in taps])
    lin = Linearization(out=out.detach(), sites=rec.sites, residuals=rec.residuals, taps=[t.detach() for t in taps], pullback=pullback)
    lin.batched_pullback = lambda c_out, c_taps: pullback((c_out, c_taps), batched=True)[0]
    lin.pull_loss = pull_loss
    lin.values = values
    return lin


FIRST_ORDER = ("grad_batch", "batch_l2", "sum_grad_squared", "variance")


def first_order(
    sites: Sequence[Site],
    gs: Sequence[Tensor],
    names: Sequence[str],
    params: Mapping[str, Tensor],
    wanted: Sequence[str],
    batch_size: int,
) -> Dict[str, Dict[str, Tensor]]:
    """The gradient and the first-order quantities, per parameter.

    Args:
        sites: recorded sites.
        gs: ``gs[k]``: gradient of the loss w.r.t. the output of site ``k``.
        names: trainable parameter names, in result order.
        params: name -> tensor.
        wanted: subset of :data:`FIRST_ORDER`.
        batch_size: ``N``.

    Returns:
        ``{"grad": {...}, "grad_batch": {...}, ...}`` for ``"grad"`` and each
        wanted quantity.
    """
    uses: Dict[str, List[Tuple[Site, str]]] = defaultdict(list)
    for site in sites:
        for role, name in site.params.items():
            uses[name].append((site, role))

    need = set(wanted)
    if "variance" in need:
        need.add("sum_grad_squared")
    results: Dict[str, Dict[str, Tensor]] = {"grad": {}}
    results.update({q: {} for q in need})

    # Single-use parameters: ask each site's rule once for all its roles.
    single: Dict[int, List[str]] = defaultdict(list)
    site_of: Dict[int, Site] = {}
    for name in names:
        if len(uses.get(name, ())) == 1:
            site, role = uses[name][0]
            single[id(site)].append(role)
            site_of[id(site)] = site
    for sid, roles in single.items():
        site = site_of[sid]
        rule, g = site.rule, gs[site.key]
        batch = rule.grad_batch(site, g, roles) if "grad_batch" in need else None
        per_q = {"grad": (rule.grad(site, g, roles) if rule.grad else None)}
        if "batch_l2" in need:
            per_q["batch_l2"] = rule.batch_l2(site, g, roles) if rule.batch_l2 else None
        if "sum_grad_squared" in need:
            per_q["sum_grad_squared"] = (
                rule.sum_grad_squared(site, g, roles) if rule.sum_grad_squared else None
            )
        if batch is None and any(v is None for v in per_q.values()):
            batch = rule.grad_batch(site, g, roles)
        for role in roles:
            name = site.params[role]
            b = batch[role] if batch is not None else None
            _store(results, name, b, {q: (v[role] if v is not None else None) for q, v in per_q.items()})

    # Parameters used by several sites (shared modules, tied weights, RNN
    # steps handled outside one site): sum individual gradients first.
    for name in names:
        u = uses.get(name, ())
        if len(u) == 1:
            continue
        if not u:
            p = params[name]
            b = p.new_zeros((batch_size,) + tuple(p.shape))
        else:
            b = sum(site.rule.grad_batch(site, gs[site.key], [role])[role] for site, role in u)
        _store(results, name, b, {q: None for q in ["grad", *need - {"grad_batch", "variance"}]})

    if "variance" in need:
        for name in names:
            g_sum, sgs = results["grad"][name], results["sum_grad_squared"][name]
            # sgs/N − (g/N)² in two kernels; ≥ 0 exactly, so clamp the rounding below zero
            # (N = 1: g² − g² from two different computations)
            results["variance"][name] = torch.addcmul(
                sgs / batch_size, g_sum, g_sum, value=-1.0 / batch_size**2).clamp_(min=0)
        if "sum_grad_squared" not in wanted:
            del results["sum_grad_squared"]
    # Keep the model's parameter order in every dict.
    return {q: {n: d[n] for n in names} for q, d in results.items()}


def _store(results, name, batch: Optional[Tensor], given: Dict[str, Optional[Tensor]]):
    """Fill ``results[q][name]`` from a rule's direct answers or from ``batch``."""
    for q, value in given.items():
        if q == "variance":
            continue
        if value is None:
            if q == "grad":
                value = batch.sum(0)
            elif q == "batch_l2":
                value = (batch**2).flatten(1).sum(1)
            elif q == "sum_grad_squared":
                value = (batch**2).sum(0)
        results[q][name] = value
    if "grad_batch" in results:
        results["grad_batch"][name] = batch
