"""Block curvature-matrix products: ``GGNMP``, ``HMP`` and ``PCHMP``.

Each returns, per parameter ``p``, a callable ``[V, *p.shape] -> [V, *p.shape]``
that re-runs the forward with ``p`` as the only variable (same random state, so
the same dropout masks) and multiplies without forming any Jacobian or Hessian:

* ``GGNMP``: ``v -> J_pᵀ (c∇²ℓ) J_p v`` (forward mode for ``J_p v``, the loss
  Hessian per sample, reverse mode for ``J_pᵀ``);
* ``HMP``: ``v -> ∇²_p L v`` by reverse-over-reverse autodiff;
* ``PCHMP``: the GGN product plus every residual node's term with its
  eigenvalues modified (see :func:`curvlib._hessian.algebra.positive_curvature`).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional

import torch
from torch import Tensor

from .._plan.checks import CallContext
from .._hessian import algebra as _residual_math
from .. import losses
from .._core.sync import LOCK
from .._interpret.diagnose import forward_mode_failure
from .._interpret.graph import NodeFailure, run_graph
from .._core.errors import CurvatureError, CurvatureTypeError, missing_forward_mode
from .._core.reverse import check_symmetric, missing_forward_mode_reason
from .._hessian.smooth import derivatives_requested, refuse_pchmp
from .._core.site import Recorder

__all__ = ["products", "rng_state", "replay_rng", "guarded", "loss_lacks_forward_mode"]


def rng_state(device: torch.device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


class replay_rng:
    """Run a block with the random state the main forward started from (same dropout masks)."""

    def __init__(self, state, device):
        self.state, self.device = state, device

    def __enter__(self):
        devices = [self.device] if self.device.type == "cuda" else []
        self.fork = torch.random.fork_rng(devices=devices)
        self.fork.__enter__()
        torch.set_rng_state(self.state[0])
        if self.state[1] is not None:
            torch.cuda.set_rng_state(self.state[1], self.device)

    def __exit__(self, *exc):
        return self.fork.__exit__(*exc)


def products(call: CallContext, spec, curv, lin, residual_grads, rng):
    """Factory of the block-product callables ``[V, *p] -> [V, *p]`` (GGNMP, HMP, PCHMP):
    ``make(ext, name)``.

    ``call``: the call (its program, inputs, parameter values, trainable names and dropout
    seed: the callables re-run its forward with the same masks whenever they are evaluated);
    ``curv``: the loss Hessian at the output (:func:`curvlib.losses.curvature_at`); ``lin``
    and ``residual_grads``: the call's linearised forward; ``rng``: the random state it
    started from (:func:`rng_state`).
    """
    return _Products(call, spec, curv, lin, residual_grads, rng).make


class _Products:
    """What every product of one call shares: the call's inputs, parameters, random state."""

    def __init__(self, call: CallContext, spec, curv, lin, residual_grads, rng):
        self.program, self.spec, self.y, self.curv, self.X = call.program, spec, call.y, curv, call.X
        self.values, self.residual_nodes = call.values, call.traced.residual_nodes
        self.lin, self.residual_grads, self.rng = lin, residual_grads, rng
        self.trainable, self.dropout_seed = frozenset(call.trainable), call.dropout_seed
        self.device = call.device
        # (modify, residual index, view) -> mod(R|u_p) (None: zero); per residual, its dense R
        self.operators: Dict[tuple, Optional[Callable]] = {}
        self.memos: Dict[int, dict] = {}
        # the modules' training flags of the call: the graph re-run by a product calls the
        # modules (dropout, batch norm), which read their flag when the product is evaluated
        self.modes = [(path, module, module.training) for path, module in self.program.root.named_modules()]
        self.derivatives = derivatives_requested(self.X, self.values)  # (PCHMP has none: refused when applied)

    def check_modes(self, label: str) -> None:
        """Refuse a product evaluated after a module's ``train()``/``eval()`` changed."""
        changed = [path or "(the model)" for path, module, training in self.modes if module.training != training]
        if changed:
            raise CurvatureError(
                f"{label}: the training mode of {', '.join(changed[:3])}"
                f"{' and others' if len(changed) > 3 else ''} changed since the call that returned "
                "this product; the product re-runs that call's forward and would use the new mode. "
                "Evaluate products before model.train()/model.eval(), or call f again."
            )

    def make(self, ext, name: str) -> Callable[[Tensor], Tensor]:
        build = {"hmp": self._hmp, "ggnmp": self._ggnmp}.get(ext.quantity, self._pchmp)
        product = build(ext, name, self.values[name])
        label = {"hmp": "HMP", "ggnmp": "GGNMP"}.get(ext.quantity, "PCHMP")

        def checked(V: Tensor) -> Tensor:
            self.check_modes(label)
            if ext.residuals_per_node:  # (eigenvalues modified: PCHMP)
                refuse_pchmp(ext, self.derivatives)
            _check_directions(ext, name, self.values[name], V)
            return V.new_zeros(V.shape) if V.shape[0] == 0 else product(V)

        return guarded(checked, label)

    def _outputs(self, name: str, p: Tensor, with_taps: bool):
        """The model output with ``p`` as parameter ``name`` (and the residuals' inputs)."""
        vals = dict(self.values)
        vals[name] = p
        rec = Recorder(None, residual_nodes=self.residual_nodes if with_taps else None,
                       dropout_seed=self.dropout_seed)  # the call's masks
        with replay_rng(self.rng, self.device):
            # the same sites as the main pass (without probes), so the same residuals
            out = run_graph(self.program, self.X, vals, self.trainable if with_taps else frozenset(), rec)
        return out, [a for r in rec.residuals for a in r.inputs]

    def _operators(self, modify: str, name: str) -> List[Optional[Callable]]:
        """Every residual's ``mod(R|u_p)`` operator for the block of parameter ``name``
        (``None``: zero), built once per call and shared by the parameters that see the
        same ``u_p`` (eigendecompositions are the expensive part).

        ``u_p``: the node's inputs, plus ``p`` where it is the node's own parameter
        (:func:`curvlib._hessian.algebra.positive_curvature`); the node's other parameters
        stay out of it (``L`` as a function of ``p`` alone)."""
        ops = []
        for k, (res, g_z) in enumerate(zip(self.lin.residuals, self.residual_grads)):
            view = name if _owns(res, name) else None
            if (modify, k, view) not in self.operators:
                memo = self.memos.setdefault(k, {})
                self.operators[(modify, k, view)] = _residual_math.positive_curvature(res, g_z, modify, view, memo)
            ops.append(self.operators[(modify, k, view)])
        return ops

    def _hmp(self, ext, name: str, p0: Tensor):
        """``∇²_p L v`` by forward-over-reverse autodiff (a Jacobian-vector product of the
        gradient). Where torch has no forward mode, reverse-over-reverse (the block is
        symmetric): for the loss's backward (``MSELoss(reduction="mean")`` meets an immutable
        zero tensor in torch 2.13, ``huber_loss_backward`` has none) at once; for a model
        operation once the products pass :func:`check_symmetric` (``weight_norm``'s reverse-mode
        second derivative is wrong in torch 2.13, and fails it)."""
        def loss_of(p):
            return losses.loss_value(self.spec, self._outputs(name, p, False)[0], self.y)

        state = {"reverse": False, "check": None}  # the model's failure to check symmetry against

        def hmp(V):
            gradient = torch.func.grad(loss_of)
            if not state["reverse"]:
                try:
                    return torch.func.vmap(lambda v: torch.func.jvp(gradient, (p0,), (v,))[1], randomness="same")(V)
                except NodeFailure as exc:
                    if not missing_forward_mode(exc.exc):
                        raise
                    state["check"] = exc
                except (RuntimeError, NotImplementedError) as exc:
                    if not loss_lacks_forward_mode(exc):
                        raise
                state["reverse"] = True
            _, pull = torch.func.vjp(gradient, p0)
            if state["check"] is not None:
                check_symmetric(lambda u: {name: pull(u[name])[0]}, {name: p0}, "HMP's products",
                                missing_forward_mode_reason(state["check"]))
                state["check"] = None
            return torch.func.vmap(lambda v: pull(v)[0])(V)

        return hmp

    def _ggnmp(self, ext, name: str, p0: Tensor):
        """``Jᵀ H J v``: a jvp, the loss Hessian, a vjp."""
        def one(v):
            f = lambda p: self._outputs(name, p, False)[0]  # noqa: E731
            _, jv = torch.func.jvp(f, (p0,), (v,))
            hjv = self.curv.matvec(jv.unsqueeze(0))[0]
            return torch.func.vjp(f, p0)[1](hjv)[0]

        return lambda V: torch.func.vmap(one, randomness="same")(V)  # dropout: the call's masks

    def _pchmp(self, ext, name: str, p0: Tensor):
        """``Jᵀ H₊ J v`` plus every residual's positive part, pulled back through the taps
        (:mod:`curvlib._hessian.algebra`)."""
        lin = self.lin
        operators = self._operators(ext.modify, name)
        n_taps = sum(len(res.inputs) for res in lin.residuals)

        def one(v):
            f = lambda p: self._outputs(name, p, True)  # noqa: E731
            _, (jv, jtaps) = torch.func.jvp(f, (p0,), (v,))
            hjv = self.curv.modified_matvec(jv.unsqueeze(0), ext.modify)[0]
            cot_taps = [torch.zeros_like(t) for t in jtaps]
            direct = torch.zeros_like(v)
            for res, apply in zip(lin.residuals, operators):
                if apply is None:  # mod(R|u_p) = 0 (a shared Linear, for the others' blocks)
                    continue
                tap_c, theta_c = apply([jtaps[k] for k in res.taps], {name: v} if _owns(res, name) else {})
                for k, c in zip(res.taps, tap_c):
                    cot_taps[k] = cot_taps[k] + c
                if name in theta_c:
                    direct = direct + theta_c[name]
            assert len(cot_taps) == n_taps
            return torch.func.vjp(f, p0)[1]((hjv, cot_taps))[0] + direct

        return lambda V: torch.func.vmap(one, randomness="same")(V)


def loss_lacks_forward_mode(exc: BaseException) -> bool:
    """Whether ``exc``, raised outside the model's graph (by the loss's backward), is torch's
    missing forward-mode derivative: none implemented, or an immutable zero tensor met."""
    return "ZeroTensors are immutable" in str(exc) or missing_forward_mode(exc)


def _owns(res, name: str) -> bool:
    """Whether ``name`` is in the residual's ``u`` as a parameter of the node: a dense
    node's own, a shared Linear's weight, or one that a tap stands for alone (a GRU's
    first ``r ⊙ b_hn``)."""
    return (name in res.params or (res.kind == "bilinear" and res.site.params.get("weight") == name)
            or any(name in names for names in res.meta.get("param_taps", {}).values()))


def _check_directions(ext, name: str, p0: Tensor, V) -> None:
    if not isinstance(V, Tensor) or tuple(V.shape[1:]) != tuple(p0.shape) or V.dim() != p0.dim() + 1:
        raise CurvatureError(
            f"{type(ext).__name__} product for '{name}' needs a tensor [V, *p.shape] = "
            f"[V, {', '.join(map(str, p0.shape))}], got "
            f"{tuple(V.shape) if isinstance(V, Tensor) else type(V).__name__}."
        )
    if V.dtype != p0.dtype or V.device != p0.device:
        raise CurvatureTypeError(
            f"{type(ext).__name__} product for '{name}' needs directions of the parameter's dtype and "
            f"device ({p0.dtype}, {p0.device}), got {V.dtype} on {V.device}: convert them with "
            f"V.to(p), where p is the parameter."
        )


def guarded(product: Callable[[Tensor], Tensor], name: str = ""):
    """``product`` evaluated safely whenever it is called: outside inference mode (an
    inference tensor ``V`` is copied; under ``no_grad`` the result is detached; the call's
    dropout masks come with its re-runs' recorder, :meth:`_Products._outputs`), and under
    :data:`curvlib._core.sync.LOCK` (forward-mode AD and the random state it replays are
    process-wide)."""

    def call(V: Tensor) -> Tensor:
        grad_mode = torch.is_grad_enabled()
        with contextlib.ExitStack() as stack:
            if torch.is_inference_mode_enabled():
                stack.enter_context(torch.inference_mode(False))
            V = V.clone() if isinstance(V, Tensor) and V.is_inference() else V
            stack.enter_context(LOCK)
            try:
                out = product(V)
            except (NodeFailure, NotImplementedError) as exc:
                clear = forward_mode_failure(exc, f"{name}'s products")
                if clear is None:
                    raise
                raise clear from exc
            return out if grad_mode else out.detach()  # under no_grad, as any op's result

    eager = torch.compiler.disable(call, recursive=True)  # eager under torch.compile, as ``f``

    def product_of(V: Tensor) -> Tensor:
        return eager(V)

    product_of.__doc__ = product.__doc__
    return product_of
