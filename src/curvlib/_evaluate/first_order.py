"""The gradient and the first-order quantities, read off the sites' output gradients.

For a site ``y = x W^T`` with output gradient ``g_n`` of sample ``n``, sample ``n``'s
gradient is ``g_n^T x_n`` (summed over positions for sequence/conv inputs); each rule
gives it (``grad_batch``) or its reductions directly (``grad``, ``batch_l2``,
``sum_grad_squared``) when it has a cheaper formula. A parameter used by several sites
sums its individual gradients over the sites before any square or norm is taken.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from torch import Tensor

from .._core import settings, sink
from .._core.scratch import reusing
from .._core.site import Site, uses_of
from .._core.tensors import is_concrete
from ..extensions import Extension
from .linearise import Linearization

__all__ = ["FirstOrderReader", "first_order", "first_order_streamed", "reads", "streams"]


def first_order(
    sites: Sequence[Site],
    gs: Sequence[Tensor],
    names: Sequence[str],
    params: Mapping[str, Tensor],
    wanted: Sequence[Extension],
    batch_size: int,
) -> Dict[str, Dict[str, Tensor]]:
    """The gradient and the first-order quantities, per parameter.

    Args:
        sites: recorded sites.
        gs: ``gs[k]``: gradient of the loss w.r.t. the output of site ``k``.
        names: trainable parameter names, in result order.
        params: name -> tensor.
        wanted: the first-order extensions (each read by its record: :class:`FirstOrderReader`).
        batch_size: ``N``.

    Returns:
        ``{"grad": {...}, "grad_batch": {...}, ...}`` for ``"grad"`` and each
        wanted quantity, each ``{name: tensor}`` in ``names``' order; per-sample
        ones are ``[N, *p]``, the others ``[*p]``.
    """
    reader = FirstOrderReader(sites, names, params, wanted, batch_size)
    for site in sites:
        reader.read(site, gs[site.key])
    return reader.results()


def streams(lin: Linearization, second: Sequence, generic: bool = False) -> bool:
    """Whether the first-order quantities can be read off site by site during the loss's
    backward (:func:`first_order_streamed`): plain autograd on real tensors (not under
    torch.func, not while ``compile=True`` traces), sites large enough to be worth it
    (:func:`curvlib._evaluate.streamed.worth_streaming`), no residuals, and second-order
    extensions that only pull back the loss Hessian's roots and read nothing of the loss's
    backward (not the Hessian's residuals; none with a ``generic`` loss, whose value is checked,
    a scalar of per-sample terms, before its Hessian is formed): those are finished before it, unless
    :attr:`~curvlib._core.settings.Settings.stream_first_order` is off."""
    return (settings.current().stream_first_order
            and lin.pull_loss is not None and lin.stream_pull is not None and is_concrete(lin.out) and not lin.residuals
            and not (generic and second)
            and all(e.root in ("exact", "mc") and not e.hessian for e in second))


def first_order_streamed(lin: Linearization, loss_of: Callable[[Tensor], Tensor], names: Sequence[str],
                         params: Mapping[str, Tensor], wanted: Sequence[Extension], batch_size: int,
                         keep_output: bool = False):
    """``(loss, first_order(...))`` from one backward from the loss that reads every site
    as its output gradient ``g_k [N, *site_out]`` arrives and then drops it, together with
    the site's saved inputs (:func:`curvlib._evaluate.streamed.stream_sites`). The graph is freed, and
    ``lin.out`` too unless ``keep_output``: call it last. Same results as
    :func:`first_order` on all ``g_k`` at once."""
    reader = FirstOrderReader(lin.sites, names, params, wanted, batch_size)
    if not keep_output:
        lin.out = None  # (a language model's logits [N, T, V]: large for its vocabulary)
    with reusing():  # (one buffer for the rules' per-sample blocks during the backward)
        loss, _ = lin.pull_loss(loss_of, retain=False, read=lambda k, g: reader.read(lin.sites[k], g, streamed=True))
    return loss, reader.results()


class FirstOrderReader:
    """The first-order quantities, read off one site at a time.

    :meth:`read` takes a site's output gradient ``g`` as soon as it is known (during the
    backward: :meth:`curvlib._evaluate.linearise.Linearization.pull_loss`) and keeps only the
    parameters' results, so ``g`` can be freed at once. A parameter read by several sites
    (tied weights, shared modules) keeps the running sum of its individual gradients
    ``Σ_k g_{n,k}`` ``[N, *p]`` until its last site is read: squares and norms do not
    distribute over that sum. Each quantity is read by its record: a rule's direct answer
    (``ext.shortcut``) or ``ext.from_individual`` of the individual gradients; one with
    ``needs`` is formed from theirs (``ext.formed``) as soon as a parameter's are stored.
    :meth:`results` finishes (unused parameters).
    """

    def __init__(self, sites: Sequence[Site], names: Sequence[str], params: Mapping[str, Tensor],
                 wanted: Sequence[Extension], batch_size: int):
        self.names, self.params, self.batch_size = list(names), params, batch_size
        self.returned = {e.name for e in wanted}
        self.formed = [e for e in wanted if e.needs]
        # name -> record of every quantity read off the sites (the formed ones' needs too)
        self.read_off: Dict[str, Extension] = {e.name: e for e in wanted if not e.needs}
        for ext in self.formed:
            for need in ext.needs:
                self.read_off.setdefault(need.name, need())
        # a need nothing returns and one formed quantity reads: written over by it
        self.overwrite = len(self.formed) == 1 and all(n.name not in self.returned for n in self.formed[0].needs)
        # where each stored result goes at once (a sharded model's call); not with a formed
        # quantity, which reads its needs' local values
        self.sink = sink.current() if not self.formed else None
        self.out: Dict[str, Dict[str, Tensor]] = {"grad": {}}
        self.out.update({q: {} for q in [*self.read_off, *(e.name for e in self.formed)]})
        uses = uses_of(sites)
        wanted_names = set(names)
        self.pending = {name: len(uses[name]) for name in names if len(uses.get(name, ())) > 1}
        self.partial: Dict[str, Tensor] = {}  # shared parameters: Σ_k g_{n,k} so far
        # site key -> roles of the parameters that site alone reads
        self.single: Dict[int, List[str]] = defaultdict(list)
        for name in names:
            if len(uses.get(name, ())) == 1 and name in wanted_names:
                site, role = uses[name][0]
                self.single[site.key].append(role)

    def read(self, site: Site, g: Tensor, streamed: bool = False) -> None:
        """Read ``site``'s parameters off its output gradient ``g`` (kept nowhere).

        ``streamed``: ``g`` is a running backward's own buffer, which the backward may
        add into in place later: a result that shares its memory is copied. The site's
        saved tensors are dropped after (nothing reads them again)."""
        if site.key in self.single:
            self._single_use(site, g, self.single[site.key])
        for role, name in site.params.items():
            if name not in self.pending:
                continue
            part = site.rule.grad_batch(site, g, [role])[role]
            # out of place: a rule's result may be a view of g, which the backward still uses
            self.partial[name] = part if name not in self.partial else self.partial[name] + part
            self.pending[name] -= 1
            if self.pending[name] == 0:
                self._store(name, self.partial.pop(name), {q: None for q in ["grad", *self.read_off]})
        if streamed:
            self._unalias(site, g)
            site.saved = {}

    def _unalias(self, site: Site, g: Tensor) -> None:
        """Copy every result of ``site``'s parameters that is a view of ``g`` (e.g. a bias's
        individual gradients ``g`` itself)."""
        ptr = g.untyped_storage().data_ptr()
        for name in site.params.values():
            for store in [self.partial, *self.out.values()]:
                t = store.get(name)
                sunk = self.sink is not None and type(t) is not Tensor  # (a DTensor: fresh storage)
                if t is not None and not sunk and t.untyped_storage().data_ptr() == ptr:
                    store[name] = t.clone()

    def results(self) -> Dict[str, Dict[str, Tensor]]:
        """Every quantity, ``{q: {name: tensor}}`` in ``names``' order (see :func:`first_order`)."""
        for name in self.names:
            if name not in self.out["grad"]:  # read by no site: zero
                p = self.params[name]
                self._store(name, p.new_zeros((self.batch_size,) + tuple(p.shape)),
                            {q: None for q in ["grad", *self.read_off]})
        for q in self.read_off:
            if q not in self.returned:
                del self.out[q]  # (needed by a formed quantity only)
        return {q: {n: d[n] for n in self.names} for q, d in self.out.items()}

    def _single_use(self, site: Site, g: Tensor, roles: List[str]) -> None:
        """Parameters read by this site only: its rule is asked once for all their roles."""
        rule = site.rule
        direct = {q: ext.shortcut(rule) for q, ext in self.read_off.items()}
        # a quantity with no shortcut of its own reads the individual gradients: formed first
        batch = rule.grad_batch(site, g, roles) if any(_batch_only(e) for e in self.read_off.values()) else None
        summed = batch is not None and rule.grad_from_batch is not None and rule.grad_from_batch(site, g)
        both, per_q = None, {}  # both: (grad, one quantity) in one pass where the rule has it
        for q, ext in self.read_off.items():
            with_grad = ext.shortcut_with_grad(rule) if batch is None and both is None else None
            both = with_grad(site, g, roles) if with_grad is not None else both  # (None: not for this site)
            if with_grad is not None and both is not None:
                per_q[q] = both[1]
        per_q = {"grad": both[0] if both else (rule.grad(site, g, roles) if rule.grad and not summed else None),
                 **{q: per_q[q] if q in per_q else (f(site, g, roles) if f is not None else None)
                    for q, f in direct.items()}}
        if batch is None and any(v is None for v in per_q.values()):
            batch = rule.grad_batch(site, g, roles)
        for role in roles:
            b = batch[role] if batch is not None else None
            self._store(site.params[role], b, {q: (v[role] if v is not None else None) for q, v in per_q.items()})

    def _store(self, name: str, batch: Optional[Tensor], given: Dict[str, Optional[Tensor]]) -> None:
        """Fill ``out[q][name]`` from a rule's direct answers or from ``batch``; then the formed
        quantities at once (a layer's ``[O, I]`` just written may still be in cache)."""
        for q, value in given.items():
            if value is None:
                value = batch.sum(0) if q == "grad" else self.read_off[q].from_individual(batch)
            self.out[q][name] = value if self.sink is None else self.sink(q, name, value)
        for ext in self.formed:
            needed = [self.out[need.name][name] for need in ext.needs]
            self.out[ext.name][name] = ext.formed(self.out["grad"][name], needed, self.batch_size, self.overwrite)


def _batch_only(ext: Extension) -> bool:
    """The quantity is read off the individual gradients whatever the rule (no ``shortcut``)."""
    return type(ext).shortcut is Extension.shortcut


def reads(ext: Extension) -> bool:
    """Whether :class:`FirstOrderReader` computes the first-order extension: its record reads it
    off the individual gradients (``from_individual``) or forms it from its ``needs``."""
    if ext.needs:
        return type(ext).formed is not Extension.formed and all(reads(need()) for need in ext.needs)
    return type(ext).from_individual is not Extension.from_individual
