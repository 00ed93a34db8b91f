"""Second-order quantities from one linearised forward pass.

GGN family. A symmetric factor ``S [V, N, *out]`` of the scaled loss Hessian
(exact: ``V = C``; Monte Carlo: ``V = M``) is pulled back through the graph
in one batched vector-Jacobian product, ``m_k = J_kᵀ S`` at every site ``k``
(``[V, *site_out]``). A site's rule then gives, per vector ``v``, the
per-sample parameter factor ``J_pᵀ m_v`` (its ``grad_batch`` applied to
``m_v``), so

* ``sqrt``       = ``[V, N, *p]``: ``grad_batch(m_v)`` for every ``v``,
* ``diag``       = ``Σ_v sum_grad_squared(m_v)`` (never forms ``[N, *p]`` where
  the rule avoids it),
* ``batch_diag`` = ``Σ_v grad_batch(m_v)²``,
* ``kron``       = ``[B, A]`` from the rule's Kronecker statistics (other layouts,
  e.g. the exact block ``[Σ sqrt sqrtᵀ]`` of a normalisation's scale: :mod:`curvlib._kronlayout`).

A parameter used by several sites sums ``J_pᵀ m`` over its sites before any
square is taken.

Hessian diagonal. ``∇²L = G + Σ_a J_aᵀ diag(φ''(a) ⊙ g_z) J_a`` over the
element-wise nonlinearities ``z = φ(a)`` (``g_z = ∂L/∂z``), for graphs whose
other nodes are piecewise linear. Each residual is split into its positive
and negative parts, ``r = r₊ − r₋``; the columns ``e_d √r±[n, d]`` (one per
feature ``d`` of ``a``) are pulled back from ``a`` like ``S``, and their
``diag``/``batch_diag`` are added with the sign.

Products (``GGNMP``, ``HMP``, ``PCHMP``) return callables that re-run the
forward with the parameter as the only variable (same random state, so the
same dropout masks), using forward-mode and reverse-mode autodiff; they
form no Jacobian or Hessian.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Mapping, Optional, Sequence

import torch
from torch import Tensor
from torch.func import vmap

from ._core import is_concrete
from ._engine import Linearization
from ._errors import CurvatureError
from .extensions.secondorder import SecondOrder
from ._kronlayout import add_root_factor
from .rules import OWN_KRON_KINDS, SPLIT_KRON_KINDS, kron_factors, kron_input_factor, kron_weight_output
from .rules import fixed_rows
from .rules.fixed_rows import tied_across_layers
from .rules._gram import gram
from .rules._site import uses_of
from ._batch_merges import per_sample
from ._residual_math import factor
from ._rootbuffers import RootBuffers, write_sqrt
from ._streamed import read_when_passed
from .rules import linear

def _sqrt(uses, m_by_site, name) -> Tensor:
    """``[V, N, *p]``: ``Σ_sites J_pᵀ m_v`` per sample."""
    total = None
    for site, role in uses[name]:
        m = m_by_site[site.key]
        if LOOP_SQRT_COLUMNS and is_concrete(m) and not _one_outer_product(site) and not site.rule.vmap_columns:
            # column by column into one buffer: the rules' own batched kernels (e.g. the
            # grouped convolution of a convolution's per-sample gradients) instead of
            # their vmapped versions (a Linear without shared positions stays vmapped:
            # there all columns are one broadcast product)
            part = None
            for v in range(m.shape[0]):
                col = site.rule.grad_batch(site, m[v], [role])[role]
                if part is None:
                    part = col.new_empty((m.shape[0],) + tuple(col.shape))
                part[v] = col
        else:
            part = vmap(lambda mv: site.rule.grad_batch(site, mv, [role])[role])(m)
        if part is None:
            continue
        total = part if total is None else total.add_(part)
    return total


#: ``_sqrt`` loops over columns outside torch.func transforms (see there), and square roots
#: are written into preallocated results (:mod:`curvlib._rootbuffers`); ``False``: vmapped
#: over columns and joined by ``torch.cat`` (the reference the tests compare with).
LOOP_SQRT_COLUMNS = True


def _one_outer_product(site) -> bool:
    """A Linear site whose per-sample gradient is a single outer product ``g_n x_nᵀ``."""
    if site.rule.kind != "linear":
        return False
    return linear._flat_input(site).shape[1] == 1


def _diag(uses, m_by_site, name, params, cache=None) -> Tensor:
    """``Σ_v Σ_n (J_pᵀ m_v)²``, via the rule's sum of squares for single-use parameters.

    ``cache`` (a dict, per chunk of columns) lets the parameters of one site share a
    single rule call: the rule is asked for all the site's roles at once.
    """
    u = uses.get(name, [])
    if not u:
        return torch.zeros_like(params[name])
    if len(u) == 1:
        site, role = u[0]
        rule = site.rule
        m = m_by_site[site.key]
        rows = fixed_rows.row_map(site) if rule.kind == "generic" else None
        if rows is not None:  # a bias-like parameter (learned positions): a scatter of m
            return fixed_rows.squares_per_sample(site, rows, m).sum(0)
        if rule.sum_squares_over_columns is not None:
            per_role = _per_site(cache, site, uses, "diag", lambda roles: rule.sum_squares_over_columns(site, m, roles))
            return _column_sum(per_role[role])
        if rule.sum_grad_squared is not None:
            # one column at a time: a rule may form [N, *p] per column (convolutions); no
            # `0 + first column` copy (an embedding's [V, D]: 154 MB on GPT-2-small)
            total = rule.sum_grad_squared(site, m[0], [role])[role]
            for k in range(1, m.shape[0]):
                total = total + rule.sum_grad_squared(site, m[k], [role])[role]
            return total
        if rule.vmap_columns:
            return (_site_columns(cache, site, uses, m)[role] ** 2).sum((0, 1))
    return (_sqrt(uses, m_by_site, name) ** 2).sum((0, 1))


def _site_columns(cache, site, uses, m: Tensor) -> Dict[str, Tensor]:
    """``{role: [V, N, *p]}``, ``J_pᵀ m_v`` per sample for all single-use roles of a site whose
    rule is vmapped over columns (a functional site: one vector-Jacobian product of the
    node gives every parameter it reads, instead of one per parameter)."""
    return _per_site(cache, site, uses, "columns", lambda roles: vmap(lambda mv: site.rule.grad_batch(site, mv, roles))(m))


def _column_sum(t: Tensor) -> Tensor:
    """Sum over the leading column dim; a view when there is one column (no copy of ``[*p]``)."""
    return t[0] if t.shape[0] == 1 else t.sum(0)


def _single_roles(site, uses) -> List[str]:
    """The roles of ``site`` whose parameters have no other use."""
    return [role for role, name in site.params.items() if len(uses.get(name, ())) == 1]


def _per_site(cache, site, uses, what: str, compute):
    """``compute(roles)`` for all single-use roles of ``site``, once per ``cache``."""
    if cache is None:
        return compute(_single_roles(site, uses))
    key = (what, site.key)
    if key not in cache:
        cache[key] = compute(_single_roles(site, uses))
    return cache[key]


def _batch_diag(uses, m_by_site, name, params, n, cache=None) -> Tensor:
    """``Σ_v (J_pᵀ m_v)²`` per sample ``[N, *p]``, without forming ``[V, N, *p]``."""
    u = uses.get(name, [])
    if not u:
        return params[name].new_zeros((n,) + tuple(params[name].shape))
    if len(u) == 1:
        site, role = u[0]
        rows = fixed_rows.row_map(site) if site.rule.kind == "generic" else None
        if rows is not None:  # a bias-like parameter (learned positions): a scatter of m
            return fixed_rows.squares_per_sample(site, rows, m_by_site[site.key])
        fast = getattr(site.rule, "batch_sum_squares_over_columns", None)
        if fast is not None:
            m = m_by_site[site.key]
            return _per_site(cache, site, uses, "batch_diag", lambda roles: fast(site, m, roles))[role]
        if site.rule.vmap_columns:
            return (_site_columns(cache, site, uses, m_by_site[site.key])[role] ** 2).sum(0)
    if all(site.rule.vmap_columns for site, _ in u):
        return (_sqrt(uses, m_by_site, name) ** 2).sum(0)
    v = m_by_site[u[0][0].key].shape[0]
    total = None
    for k in range(v):  # one column at a time: memory [N, *p]
        col = sum(site.rule.grad_batch(site, m_by_site[site.key][k], [role])[role] for site, role in u)
        total = col**2 if total is None else total + col**2
    return total


def _kron(uses, m_by_site, name, cache=None, approx=None, max_dim=None) -> List[Tensor]:
    """Kronecker factors, one per dim of the parameter: ``[B, A]`` for a Linear weight
    ``[out, in]``, ``[A, B]`` for one stored transposed (GPT-2's ``Conv1D``, see
    ``rules.linear.LINEAR_TRANSPOSED``); see :func:`_kron_stored`. ``max_dim``: the
    extension's ``max_factor_dim`` (a larger side gets a 1-D, diagonal, factor)."""
    u = uses[name]
    flipped = [site.meta.get("transposed", False) and role == "weight" for site, role in u]
    if any(flipped) and (len(u) > 1):  # a transposed weight also used elsewhere: its exact block (or diagonal)
        return fixed_rows.generic_block(u, m_by_site, lambda: _sqrt(uses, m_by_site, name), approx, max_dim)
    factors = _kron_stored(uses, m_by_site, name, cache, approx, max_dim)
    return factors[::-1] if any(flipped) else factors


def _kron_stored(uses, m_by_site, name, cache=None, approx=None, max_dim=None) -> List[Tensor]:
    """Kronecker factors in the sites' own layout; a Linear weight used by several sites treats the uses like
    positions sharing the weight (roots summed in ``B``, inputs' outer products in ``A``).

    With a ``cache``, a site's output factor ``B`` (the same for its weight and bias)
    is formed once per chunk of columns, and its input factor ``A`` (independent of
    the columns) once per call. ``approx``: ``None``, ``"expand"`` or ``"reduce"``
    (single-use parameters only, see :func:`check_second_order`).
    """
    u = uses[name]
    kinds = {site.rule.kind for site, _ in u}
    if not kinds <= set(SPLIT_KRON_KINDS) | set(OWN_KRON_KINDS) or (len(u) > 1 and tied_across_layers(u)):
        # normalisations, generic parameters, tied weights: the exact block, its diagonal, or
        # Embedding's layout at fixed rows for bias-like ones (curvlib.rules.fixed_rows)
        return fixed_rows.generic_block(u, m_by_site, lambda: _sqrt(uses, m_by_site, name), approx, max_dim)
    if len(u) == 1:
        ((site, role),) = u
        if cache is None or site.rule.kind in OWN_KRON_KINDS:
            return kron_factors(site, role, m_by_site[site.key], approx, max_dim)
        B = _cached(cache, ("kron_B", site.key, approx, max_dim),
                    lambda: kron_factors(site, "bias", m_by_site[site.key], approx, max_dim)[0])
        if role == "bias":
            return [B]
        static = cache.setdefault("static", {})
        return [kron_weight_output(site, B), _cached(static, ("kron_A", site.key, approx, max_dim),
                                                     lambda: kron_input_factor(site, approx, max_dim))]
    s = sum(linear.kron_output_sum(site, m_by_site[site.key]) for site, _ in u)
    B = gram(s.reshape(-1, s.shape[-1]), max_dim)
    if u[0][1] == "bias":
        return [B]
    return [B, sum(linear.kron_input(site, None, max_dim) for site, _ in u)]


def _root_last(uses, name: str) -> bool:
    """Whether ``name``'s root factor comes last: Embedding's ``[A [V], B]`` (also at fixed
    rows) and a weight stored transposed (``[A, B]``, :func:`_kron`). Shapes alone cannot
    tell: a Linear weight's ``B`` may be diagonal (``[B [O], A]``), a transposed one's ``A``."""
    u = uses.get(name, ())
    if len(u) == 1 and u[0][0].meta.get("transposed", False) and u[0][1] == "weight":
        return True
    return any(site.rule.kind in ("embedding", "generic") for site, _ in u)


def _cached(cache: dict, key, compute):
    if key not in cache:
        cache[key] = compute()
    return cache[key]


def second_order(
    lin: Linearization,
    curv,
    exts: Sequence[SecondOrder],
    names: Sequence[str],
    params: Mapping[str, Tensor],
    batch_size: int,
    residual_grads: Sequence[Tensor],
    product: Callable,
    kfra_factors: Callable,
    chunk_size: Optional[int] = None,
    site_grads: Optional[Sequence[Tensor]] = None,
    into: Optional[RootBuffers] = None,
) -> Dict[str, Dict[str, object]]:
    """Every requested second-order quantity, per parameter (see module doc).

    ``curv`` is the loss Hessian at the output (:func:`curvlib.losses.curvature_at`):
    its roots come with signs (``Σ sign · S Sᵀ``; an indefinite loss Hessian has a
    negative part), and every quantity linear in the GGN is the signed sum.
    ``product(ext, name)`` builds a block-product callable; ``kfra_factors()``
    runs the KFRA recursion (both re-run the forward, so the caller owns them).
    ``chunk_size`` bounds the number of columns pulled back at once (memory
    ``∝ chunk_size × activations``); results are the same for any value.
    ``site_grads``: the loss gradient at every site (the empirical Fisher's root).
    ``into``: where square roots are written (a batch's, shared by its slices; see
    :mod:`curvlib._rootbuffers`); default: new buffers for this call.
    """
    uses = uses_of(lin.sites)
    results: Dict[str, Dict[str, object]] = {}

    def signed(roots, group):
        _refuse_indefinite_sqrt(curv, roots, group)
        total = None
        for sign, S in roots:
            part = _accumulate(lin, uses, S, group, names, params, batch_size, chunk_size, into)
            total = part if total is None else _signed_sum(total, part, sign, group, uses)
        return total

    exact = [e for e in exts if e.root == "exact"]
    if exact:
        results.update(signed(curv.roots(), exact))
    for ext in exts:
        q = ext.quantity
        if ext.root == "mc":
            results.update(signed(curv.sampled_roots(ext.mc_samples, ext.generator), [ext]))
        elif ext.root == "grad":  # one column per sample: its own loss gradient, already at every site
            m = [g.unsqueeze(0) for g in site_grads]
            cache: Dict[object, object] = {"static": {}}
            results[ext.name] = {n: _kron(uses, m, n, cache, ext.kfac_approx, ext.max_factor_dim) for n in names}
        elif q in ("hessian_diag", "hessian_batch_diag"):
            results[ext.name] = _hessian_diag(
                lin, uses, results[ext.name], names, params, batch_size, residual_grads,
                batch=(q == "hessian_batch_diag"), chunk_size=chunk_size,
            )
        elif q in ("ggnmp", "hmp", "pchmp"):
            results[ext.name] = {n: product(ext, n) for n in names}
        elif q == "kfra":
            results[ext.name] = kfra_factors()
    return {ext.name: results[ext.name] for ext in exts}


_READ_AS = {"hessian_diag": "diag", "hessian_batch_diag": "batch_diag"}


def _accumulate(lin, uses, S: Tensor, group, names, params, batch_size, chunk_size,
                into: Optional[RootBuffers] = None) -> Dict[str, Dict[str, object]]:
    """The group's quantities from the root ``S [V, N, *out]``, pulled back in chunks of columns.

    Square roots go column by column into ``into`` (plain autograd only: under torch.func
    or for results that need autograd, chunks are joined by ``torch.cat``).
    """
    acc: Dict[str, Dict[str, object]] = {}
    static: Dict[tuple, object] = {}  # column-independent results (KFAC's A), once per call
    owned: set = set()  # ids of running sums made here (safe to add into in place)
    total = S.shape[0]
    if not LOOP_SQRT_COLUMNS or lin.batched_pullback is None or not is_concrete(S) or S.requires_grad:
        into = None
    elif into is None:
        into = RootBuffers()
    streamed = _streamed_reads(lin, group, S)
    for start, S_chunk in _chunks(S, chunk_size):
        # per-site rule results shared by the site's parameters, per chunk
        cache: Dict[object, object] = {"static": static}
        if streamed:
            for ext, part in _read_streamed(lin, uses, S_chunk, group, names, params, batch_size, cache).items():
                q = _READ_AS.get(ext.quantity, ext.quantity)
                acc[ext.name] = part if ext.name not in acc else {
                    n: _combine(q, acc[ext.name][n], part[n], owned, _root_last(uses, n)) for n in names}
            continue
        m = lin.pull_batched(S_chunk)
        for ext in group:
            q = _READ_AS.get(ext.quantity, ext.quantity)
            if q == "sqrt" and into is not None:
                cols = into.at(ext.name, total, start, S_chunk.shape[0])
                acc[ext.name] = {n: write_sqrt(uses, m, n, params[n], batch_size, cols) for n in names}
                continue
            kron = (getattr(ext, "kfac_approx", None), getattr(ext, "max_factor_dim", None))
            part = {n: _read(q, uses, m, n, params, batch_size, S_chunk.shape[0], cache, kron) for n in names}
            if ext.name not in acc:
                acc[ext.name] = part
            else:
                acc[ext.name] = {n: _combine(q, acc[ext.name][n], part[n], owned, _root_last(uses, n))
                                 for n in names}
    return acc


def _streamed_reads(lin, group, S: Tensor) -> bool:
    """Whether the columns are pulled back one at a time, each parameter read as soon as the
    pullback has passed all its sites (:func:`_read_streamed`): plain autograd on real
    tensors, one column (the MC default), no square roots (written column by column)."""
    return (lin.stream_pull is not None and is_concrete(S) and not S.requires_grad and S.shape[0] == 1
            and all(_READ_AS.get(e.quantity, e.quantity) in ("diag", "batch_diag", "kron") for e in group))


def _read_streamed(lin, uses, S: Tensor, group, names, params, batch_size: int, cache) -> Dict[object, dict]:
    """``{ext: {name: part}}`` for the one column ``S [1, N, *out]``, each parameter read
    during the column's pullback as soon as it has passed all the parameter's sites
    (:func:`curvlib._streamed.read_when_passed`): the sites' pulled-back columns are never
    all alive at once (GPT-2-small: ~300 MB)."""
    parts: Dict[object, dict] = {ext: {} for ext in group}

    def read(n: str, m: Dict[int, Tensor]) -> None:
        m = {k: g.unsqueeze(0) for k, g in m.items()}  # [1, *site_out]: one column
        for ext in group:
            kron = (getattr(ext, "kfac_approx", None), getattr(ext, "max_factor_dim", None))
            parts[ext][n] = _read(_READ_AS.get(ext.quantity, ext.quantity), uses, m, n, params, batch_size, 1,
                                  cache, kron)

    sites_of = {n: {site.key for site, _ in uses.get(n, ())} for n in names}
    read_when_passed(lambda on_site: lin.stream_pull(S[0], on_site), sites_of, read)
    return {ext: {n: part[n] for n in names} for ext, part in parts.items()}


def _refuse_indefinite_sqrt(curv, roots, group) -> None:
    sqrt = [e for e in group if e.quantity == "sqrt"]
    if sqrt and len(roots) > 1:
        if not is_concrete(roots[0][1]):  # under vmap/grad: the signs cannot be read
            raise CurvatureError(
                f"{type(sqrt[0]).__name__} under a torch.func transform (vmap, grad) with this loss: "
                "whether its Hessian w.r.t. the model output is positive semi-definite (so that the "
                "GGN has a real square root) depends on values the transform hides. Call it outside "
                "the transform, or use the GGN diagonals, Kronecker factors or GGNMP, which are exact "
                "for any loss Hessian."
            )
        value, n = curv.most_negative()
        raise CurvatureError(
            f"{type(sqrt[0]).__name__}: the Hessian of the loss w.r.t. the model output is indefinite "
            f"(eigenvalue {value:.3g} for sample {n}), so the GGN has no real square root. The GGN "
            "diagonals, Kronecker factors and GGNMP are exact for indefinite loss Hessians; use them, "
            "or a loss that is convex in the model output."
        )


def _signed_sum(total, part, sign: float, group, uses):
    """``total + sign · part`` for quantities linear in the GGN (``A`` of Kronecker factors is shared)."""
    out = {}
    for ext in group:
        q = _READ_AS.get(ext.quantity, ext.quantity)
        a, b = total[ext.name], part[ext.name]
        if q == "kron":
            out[ext.name] = {n: add_root_factor(a[n], b[n], lambda x, y: x + sign * y, _root_last(uses, n))
                             for n in a}
        else:
            out[ext.name] = {n: a[n] + sign * b[n] for n in a}
    return out


def _chunks(S: Tensor, chunk_size: Optional[int]):
    """``(start, S[start:start + chunk_size])`` over the columns."""
    if chunk_size is None or chunk_size >= S.shape[0]:
        yield 0, S
        return
    for start in range(0, S.shape[0], chunk_size):
        yield start, S[start:start + chunk_size]


def _read(q: str, uses, m, name: str, params, n: int, v: int, cache=None, kron=(None, None)):
    """One chunk's contribution to quantity ``q`` of parameter ``name`` (``kron``: the Kronecker
    extension's ``(kfac_approx, max_factor_dim)``)."""
    if q == "diag":
        return _diag(uses, m, name, params, cache)
    if q == "batch_diag":
        return _batch_diag(uses, m, name, params, n, cache)
    if q == "sqrt":
        if uses.get(name):
            return _sqrt(uses, m, name)
        return params[name].new_zeros((v, n) + tuple(params[name].shape))
    return _kron(uses, m, name, cache, *kron)  # "kron"


def _combine(q: str, acc, part, owned: Optional[set] = None, root_last: Optional[bool] = None):
    """Sum of chunk contributions; square roots are concatenated; ``A`` is chunk-independent
    (``root_last``: see :func:`curvlib._kronlayout.root_index`)."""
    if q == "sqrt":  # (only under autograd or torch.func: otherwise written into RootBuffers)
        return torch.cat([acc, part])
    if q == "kron":
        return add_root_factor(acc, part, lambda x, y: _sum_into(x, y, owned), root_last)
    return _sum_into(acc, part, owned)



def _sum_into(acc: Tensor, part: Tensor, owned: Optional[set]) -> Tensor:
    """``acc + part``, in place where that is safe (no third ``[N, *p]``-sized buffer for
    batch diagonals): only into a sum this accumulation made itself (ids in ``owned``;
    the first chunk's results may be shared between extensions), and never under
    autograd or torch.func."""
    if (owned is None or id(acc) not in owned or acc.requires_grad or part.requires_grad
            or not is_concrete(acc) or acc.shape != part.shape):
        total = acc + part
        if owned is not None:
            owned.add(id(total))
        return total
    return acc.add_(part)


def _hessian_diag(lin, uses, ggn, names, params, n, residual_grads, batch: bool, chunk_size=None):
    """GGN diagonal plus every residual's signed columns (see :mod:`curvlib._residuals`)."""
    read = (lambda m, name, cache: _batch_diag(uses, m, name, params, n, cache)) if batch else (
        lambda m, name, cache: _diag(uses, m, name, params, cache))
    total = dict(ggn)
    for res, g_z in zip(lin.residuals, residual_grads):
        for sign, tap_cols, direct in per_sample(res, factor(res, g_z), n):
            if not tap_cols and not direct:
                continue  # nothing trainable reached: no columns
            # a node without float inputs (an opaque layer on token ids): direct columns only
            v = next(iter(tap_cols.values() if tap_cols else direct.values())).shape[0]
            step = max(1, v if chunk_size is None else chunk_size)
            for start in range(0, v, step):
                sl = slice(start, start + step)
                m = lin.pull_batched(None, {res.taps[j]: cols[sl] for j, cols in tap_cols.items()}) if tap_cols \
                    else None
                cache: Dict[tuple, object] = {}
                for name in names:
                    if name in direct:
                        pulled = _sqrt(uses, m, name) if m is not None and uses.get(name) else 0.0
                        sq = direct[name][sl] + pulled
                        part = (sq**2).sum(0) if batch else (sq**2).sum((0, 1))
                    elif m is None:
                        continue  # no tap: nothing reaches the other parameters
                    else:
                        part = read(m, name, cache)
                    total[name] = total[name] + sign * part
    return total
