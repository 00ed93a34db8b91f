"""KFRA: Kronecker factors from the batch-averaged GGN recursion (Botev et al., 2017).

Instead of a root, a dense matrix ``G_z [D, D]`` (``D`` the per-sample size of
a node's output) is passed backward, starting from the summed loss Hessian
``G = Σ_n c ∇²ℓ_n``, and through each node ``z = f(a)`` as the expectation
over the batch

    G_a = (1/N) Σ_n J_nᵀ G_z J_n,      J_n = ∂z_n/∂a_n.

``J_nᵀ G_z J_n`` is computed without Jacobians: with ``G_z = Σ_k λ_k u_k u_kᵀ``
(eigendecomposition), it is ``Σ_k λ_k (J_nᵀ u_k)(J_nᵀ u_k)ᵀ``, one batched
vector-Jacobian product of the node with the ``D`` vectors ``u_k``.
Residual terms are dropped (KFRA approximates the GGN), as in BackPACK.

A layer's factors are read off ``G_z`` at its output: weight ``[G_z, A]``,
bias ``[G_z]`` (convolutions sum ``G_z`` over output positions). The
recursion needs a chain of nodes (a Sequential-like graph).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor, fx, nn
from torch.func import vjp, vmap

from .._core import dropout as _dropout, param_reads
from .._interpret.graph import run_graph
from .._core.errors import CurvatureError
from ..rules import FAMILY_OF, kron_from_matrix
from .._core.site import Recorder, Site
from .._trace.graph_facts import chain_nodes, is_inplace
from ..rules.elementwise import ELEMENTWISE_MODULES
from .._core import linalg, settings
from .linearise import Forward


def _node_function(program, node: fx.Node, env: Dict[fx.Node, object], params):
    """``a -> z`` for a chain node, its other arguments fixed (the forward's own dropout
    mask; an in-place node on a copy of ``a``; modules without their hooks)."""
    (inp,) = [a for a in node.all_input_nodes if a.op != "get_attr"]
    noise = env.get(_dropout.NOISES, {}).get(node)
    inplace = is_inplace(program, node)

    def load(v, a):
        return fx.node.map_arg(v, lambda n: a if n is inp else env[n])

    def f(a: Tensor) -> Tensor:
        if noise is not None:
            kind, p, mask = noise
            return _dropout.use_noise(kind, a, p, mask)
        if inplace:
            a = a.clone()
        return program.apply(node, load(node.args, a), load(node.kwargs, a), params)

    return f


def _average_congruence(f, a: Tensor, G: Tensor) -> Tensor:
    """``(1/N) Σ_n J_nᵀ G J_n`` for ``z = f(a)``, ``G [Dz, Dz]`` -> ``[Da, Da]``."""
    n = a.shape[0]
    d_a, d_z = a[0].numel(), G.shape[0]
    limit = settings.current().kfra_max_entries
    if max(d_z * n * d_a, d_a * d_a, d_z * d_z) > limit:
        raise CurvatureError(
            f"KFRA: the dense batch-averaged recursion through an operation with {d_a} "
            f"inputs and {d_z} outputs per sample (N={n}) needs more than {limit} "
            "entries; use KFAC or KFLR for this model."
        )
    evals, evecs = linalg.eigh(G)
    z, pull = vjp(f, a)
    cols = evecs.t().reshape((-1, 1) + tuple(z.shape[1:])).expand((-1, n) + tuple(z.shape[1:]))
    w = vmap(lambda c: pull(c)[0])(cols).reshape(evecs.shape[1], n, d_a)  # [K, N, Da]
    return torch.einsum("k,kni,knj->ij", evals, w, w) / n


def kfra(fwd: Forward, curv, names: Sequence[str], sites: List[Site], reduce=None,
         values: Optional[Dict[fx.Node, object]] = None) -> Dict[str, list]:
    """KFRA factors for every parameter in ``names`` (see module doc).

    ``fwd``: the call's forward (its program, input, parameter values and dropout seed).
    ``curv``: the loss Hessian at the model output (:func:`curvlib.losses.curvature_at`).
    ``reduce(G, kind)``, if given, makes each matrix global over a process
    group where it is formed (:func:`curvlib.distributed.kfra_reducer`).
    ``values``: every node's value in the forward already run (plain autograd, no in-place
    nodes), reused instead of running the graph again (with the call's dropout seed: the same
    masks).
    """
    program, params = fwd.program, param_reads.read_values(fwd.params)  # (a sharded model's: gathered per read)
    chain = chain_nodes(program)
    if values is not None:
        env = {k: (v.detach() if isinstance(v, Tensor) else v) for k, v in values.items()}
    else:  # in a chain nobody reads an in-place node's input again: run those on copies
        env = {}
        run_graph(program, fwd.X, params, frozenset(), Recorder(None, dropout_seed=fwd.dropout_seed), env=env,
                  preserve_inputs=True)
    G = sum(sign * torch.einsum("vni,vnj->ij", S.flatten(2), S.flatten(2)) for sign, S in curv.roots())
    if reduce is not None:
        G = reduce(G, "loss")
    site_of = {site.where: site for site in sites}
    result: Dict[str, list] = {}
    for node in reversed(chain[1:]):
        layer = program.layers.get(node.target) if node.op == "call_module" else None
        if layer is not None:
            site = site_of.get(layer.path)
            for role, name in layer.names.items():
                if name in names:
                    result[name] = kron_from_matrix(site, role, G)
        if node is chain[1]:
            break
        (inp,) = [a for a in node.all_input_nodes if a.op != "get_attr"]
        G = _backprop(program, node, env, params, env[inp], env[node], G)
        if reduce is not None:
            G = reduce(G, "batch")
    return {n: result[n] for n in names}


_RESHAPES = {"view", "reshape", "flatten", "contiguous", torch.flatten, torch.reshape}
_DIAGONAL_MODULES = ELEMENTWISE_MODULES + (
    nn.ReLU, nn.LeakyReLU, nn.ReLU6, nn.Hardtanh, nn.Identity,
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,
)


def _backprop(program, node: fx.Node, env, params, a: Tensor, z: Tensor, G: Tensor) -> Tensor:
    """``G_a = (1/N) Σ_n J_nᵀ G J_n`` with closed forms where the Jacobian allows:

    * a Linear on ``[N, I]``: ``J_n = W`` for every sample, ``G_a = Wᵀ G W``;
    * an element-wise or masking node (activations, dropout): ``J_n =
      diag(d_n)``, ``G_a = G ⊙ (1/N) Σ_n d_n d_nᵀ``;
    * a reshape that keeps the per-sample order (``Flatten``, ``view``): ``G_a = G``;
    * anything else: the generic eigendecomposition route.
    """
    f = _node_function(program, node, env, params)
    module = program.root.get_submodule(node.target) if node.op == "call_module" else None
    layer = program.layers.get(node.target) if module is not None else None
    family = FAMILY_OF.get(layer.kind) if layer is not None else None
    if family is not None and family.kfra_pullback is not None and a.dim() == 2:
        return family.kfra_pullback({r: params[n] for r, n in layer.names.items()}, G)
    flat_reshape = (isinstance(module, nn.Flatten) and module.start_dim == 1 and module.end_dim == -1) or (
        node.op != "call_module" and node.target in _RESHAPES and z.dim() >= 1 and z.shape[0] == a.shape[0]
        and node.target not in ("flatten", torch.flatten)
    )
    if flat_reshape and z[0].numel() == a[0].numel():
        return G
    if isinstance(module, _DIAGONAL_MODULES) and a.shape == z.shape:
        _, pull = vjp(f, a)
        d = pull(torch.ones_like(z))[0].reshape(a.shape[0], -1)  # diagonal of each J_n
        return G * (d.t() @ d) / a.shape[0]
    return _average_congruence(f, a, G)
