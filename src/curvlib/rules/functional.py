"""Functional parameter uses: an op in ``forward`` that reads a parameter directly.

``F.linear(h, self.enc.weight.t())`` (a tied decoder) or ``x @ self.w`` uses
a parameter outside any parametrized module. The traced graph shows it as a
node that depends on the model input *and* on parameters (through a chain
of parameter-only nodes such as ``.t()``). Such a node is a site of its own:

    z = op(inputs, h(θ)),      ∂ℓ_n/∂θ = (∂ op(inputs_n, h(θ))/∂θ)ᵀ g_n,

computed per sample with :func:`torch.func.vjp` on the node run on sample
``n`` alone (batch of one), vectorised with :func:`torch.func.vmap`, as the
generic module rule does. The parameter-only chain ``h`` is re-evaluated
from the parameter tensors, so tied uses (the encoder's weight in the
decoder) get their own exact per-sample contribution, summed with the
module's before any square is taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from torch import Tensor, fx, nn
from torch.func import vjp, vmap

from ._site import Recorder, RoleTensors, Rule, Site


@dataclass(frozen=True)
class FunctionalUse:
    """How to recompute one graph node from parameters and its input-dependent arguments.

    Attributes:
        node: the node (depends on the model input and on parameters).
        chain: its parameter-only ancestors, in graph order (``get_attr`` and ops on them).
        params: canonical names of the parameters the chain reads.
        inputs: the node's input-dependent argument nodes.
    """

    node: fx.Node
    chain: Tuple[fx.Node, ...]
    params: Tuple[str, ...]
    inputs: Tuple[fx.Node, ...]


def _lookup(root: nn.Module, target: str):
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def evaluate(use: FunctionalUse, root: nn.Module, param_names: Dict[int, str],
             tensors: Dict[str, Tensor], inputs: Sequence[Tensor]):
    """The node's value with parameters ``tensors`` (canonical name -> tensor) and ``inputs``."""
    env: Dict[fx.Node, object] = dict(zip(use.inputs, inputs))
    load = lambda a: fx.node.map_arg(a, lambda n: env[n])  # noqa: E731
    for node in use.chain + (use.node,):
        if node.op == "get_attr":
            value = _lookup(root, node.target)
            if isinstance(value, nn.Parameter):
                value = tensors[param_names[id(value)]]
            env[node] = value
        elif node.op == "call_function":
            env[node] = node.target(*load(node.args), **load(node.kwargs))
        elif node.op == "call_method":
            self_obj, *rest = load(node.args)
            env[node] = getattr(self_obj, node.target)(*rest, **load(node.kwargs))
        else:  # call_module of a parameter-free module on parameters
            env[node] = _lookup(root, node.target)(*load(node.args), **load(node.kwargs))
    return env[use.node]


def grad_batch(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
    use, root, param_names = site.meta["use"], site.meta["root"], site.meta["param_names"]
    n = g.shape[0]
    params = {k[6:]: v for k, v in site.saved.items() if k.startswith("param:")}
    inputs = [site.saved[f"in{i}"] for i in range(len(use.inputs))]
    in_dims = [0 if (x.dim() > 0 and x.shape[0] == n) else None for x in inputs]
    wanted = set(roles)

    def one_sample(inputs_n: List[Tensor], g_n: Tensor) -> Dict[str, Tensor]:
        inputs_n = [x.unsqueeze(0) if d == 0 else x for x, d in zip(inputs_n, in_dims)]
        free = {r: p for r, p in params.items() if r in wanted}
        fixed = {r: p for r, p in params.items() if r not in wanted}

        def f(free_params):
            return evaluate(use, root, param_names, {**fixed, **free_params}, inputs_n)

        return vjp(f, free)[1](g_n.unsqueeze(0))[0]

    return vmap(one_sample, in_dims=(in_dims, 0))(inputs, g)


FUNCTIONAL = Rule(kind="generic", grad_batch=grad_batch)


def record(use: FunctionalUse, root: nn.Module, param_names: Dict[int, str], names: Dict[str, str],
           tensors: Dict[str, Tensor], inputs: Sequence[Tensor], out: Tensor, rec: Recorder) -> Tensor:
    """Record the node as a site (``out`` is its value, computed by the interpreter)."""
    saved = {f"param:{k}": v for k, v in tensors.items()}
    saved.update({f"in{i}": x for i, x in enumerate(inputs)})
    meta = {"use": use, "root": root, "param_names": param_names, "batch_dim": 0}
    where = f"{use.node.name} (op in forward using {', '.join(use.params)})"
    return rec.add(Site(FUNCTIONAL, names, where, meta=meta, saved=saved), out)
