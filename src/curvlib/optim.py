"""A ``torch.optim``-style KFAC / EKFAC natural-gradient optimizer on curvlib's results.

Each ``step(X, y)`` evaluates the loss, its gradient and (every ``factor_interval`` steps)
the Kronecker factors with ``curvlib.curvature`` (no hooks, no ``.grad`` written; the
model's parameters are the only thing changed, by the update), keeps running averages
``F ← d·F + (1 − d)·F_new`` (``d = ema_decay``; the first value is taken as it is),
re-decomposes them every ``inverse_interval`` steps and updates

    ``Δ = ν (F + λ I)⁻¹ (∇L + w·θ)``,  ``b ← μ b + Δ``,  ``θ ← θ − lr · b``

per parameter (``w`` weight decay, ``μ`` momentum, ``ν ≤ 1`` the ``kl_clip`` factor;
``curvlib.precondition`` for the damped inverse of each layout: ``"pi"``/``"plain"``/``"exact"``
damping for a Kronecker pair, ``(F + λ)⁻¹`` for the exact block of a LayerNorm/BatchNorm/bias parameter, the
diagonal of the exact block for generic parameters curvlib has no Kronecker structure for).

``curvature``: ``"kfac"`` (MC Fisher, ``mc_samples`` labels sampled from the model),
``"kflr"`` (exact GGN), ``"ekfac"`` (KFAC's eigenbasis, eigenvalues re-fitted from the
individual gradients, ``s = (1/c) Σ_n (Q_Bᵀ G_n Q_A)²``, the empirical Fisher's diagonal in
that basis; running average over factor steps, re-fitted from the batch when the basis is
re-computed; always damped exactly, ``(s + λ)⁻¹``).

Example::

    opt = KFACOptimizer(model, nn.CrossEntropyLoss(), lr=0.1, damping=1e-2)
    for X, y in loader:
        loss = opt.step(X, y)      # the loss before the update
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Dict, List, Optional

import torch
from torch import Tensor, nn

from . import precondition as pre
from ._core.errors import CurvatureError, CurvatureTypeError
from ._transform.entry import curvature as _curvature
from .distributed.sharded import is_sharded
from .extensions import KFAC, KFLR, BatchGrad

__all__ = ["KFACOptimizer"]

CURVATURES = ("kfac", "kflr", "ekfac")


class KFACOptimizer(torch.optim.Optimizer):
    r"""KFAC / KFLR / EKFAC natural gradient (module doc for the update and its formulas).

    Args:
        model: the ``nn.Module``; its trainable parameters are optimised.
        lossfn: a loss curvlib accepts (``nn.CrossEntropyLoss``, ``nn.MSELoss``, ...).
        lr: step size.
        damping: $\lambda > 0$, Tikhonov damping of the curvature.
        curvature: ``"kfac"``, ``"kflr"`` or ``"ekfac"``.
        method: damping of a Kronecker pair, ``"pi"`` (Martens & Grosse), ``"plain"`` or
            ``"exact"`` (``"ekfac"`` is always exact).
        factor_interval: steps between evaluations of the factors (and EKFAC's eigenvalues).
        inverse_interval: steps between eigendecompositions of the averaged factors.
        ema_decay: ``d`` in ``F ← d·F + (1 − d)·F_new``, in ``[0, 1)``.
        momentum: ``μ``, as ``torch.optim.SGD``'s, applied to the preconditioned step.
        weight_decay: ``w``, as ``torch.optim.SGD``'s: $w \theta$ is added to the gradient before
            it is preconditioned.
        kl_clip: $\kappa$ (default ``1e-2``) or ``None`` (off): scale the step by $\nu = \min\big(1, \sqrt{\kappa / (\mathrm{lr}^2\, \Delta^\top \nabla L)}\big)$
            (Ba et al. 2017's trust region; $\Delta^\top \nabla L \approx \Delta^\top F \Delta$): KFAC with small damping is
            unstable without it.
        mc_samples: labels sampled per sample for the Monte-Carlo factors (``"kfac"``,
            ``"ekfac"``), as ``curvlib.extensions.KFAC``'s.
        generator: the ``torch.Generator`` those labels are drawn from (None: torch's global one).
        kfac_approx: ``None``, ``"expand"`` or ``"reduce"`` (as ``curvlib.extensions.KFAC``'s).
        max_factor_dim: factor sides larger than it are diagonal (as ``curvlib.extensions.KFAC``'s;
            a language model's head).

    Raises:
        CurvatureError: an unknown ``curvature`` or ``method``, a non-positive ``damping``, an
            option out of range, or what ``curvature`` refuses for the model and loss.

    ``step(X, y)`` returns the loss at the parameters before the update (detached).
    ``state_dict()``/``load_state_dict()`` hold the averaged factors, EKFAC's eigenvalues,
    momentum buffers and the step count.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib.optim import KFACOptimizer
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
        >>> X, y = torch.randn(32, 3), torch.randn(32, 1)
        >>> opt = KFACOptimizer(model, nn.MSELoss(), lr=0.5, damping=1e-3, curvature="kflr")
        >>> first = opt.step(X, y)                 # the loss before the update
        >>> for _ in range(20):
        ...     last = opt.step(X, y)
        >>> bool(last < first)
        True
    """

    def __init__(self, model: nn.Module, lossfn, lr: float = 0.1, damping: float = 1e-3, *,
                 curvature: str = "kfac", method: str = "pi", factor_interval: int = 1,
                 inverse_interval: int = 1, ema_decay: float = 0.95, momentum: float = 0.0,
                 weight_decay: float = 0.0, mc_samples: int = 1, generator: Optional[torch.Generator] = None,
                 kfac_approx: Optional[str] = None, kl_clip: Optional[float] = 1e-2,
                 max_factor_dim: Optional[int] = None):
        if not isinstance(model, nn.Module):
            raise CurvatureTypeError(f"KFACOptimizer(model=...) must be an nn.Module, got {type(model).__name__}.")
        _check_options(curvature, method, factor_interval, inverse_interval, ema_decay, lr)
        pre._check_damping(damping)
        self._names = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if not self._names:
            raise CurvatureError("KFACOptimizer: the model has no trainable parameters.")
        if curvature == "ekfac" and any(is_sharded(p) for p in self._names.values()):
            raise CurvatureError(
                "KFACOptimizer(curvature='ekfac') on a model sharded with fully_shard: EKFAC's eigenvalues "
                "sum per-sample gradients over the ranks, which curvlib does not do yet; use 'kfac' or 'kflr'.")
        if kl_clip is not None and not kl_clip > 0:
            raise CurvatureError(f"KFACOptimizer(kl_clip={kl_clip!r}): must be positive or None.")
        defaults = dict(lr=lr, damping=damping, momentum=momentum, weight_decay=weight_decay, kl_clip=kl_clip)
        super().__init__(list(self._names.values()), defaults)
        self.model, self.lossfn, self.curvature_type, self.method = model, lossfn, curvature, method
        self.factor_interval, self.inverse_interval, self.ema_decay = factor_interval, inverse_interval, ema_decay
        kron = KFLR(kfac_approx=kfac_approx, max_factor_dim=max_factor_dim) if curvature == "kflr" else \
            KFAC(mc_samples=mc_samples, generator=generator, kfac_approx=kfac_approx, max_factor_dim=max_factor_dim)
        self._key = kron.name
        extensions = [kron, BatchGrad()] if curvature == "ekfac" else [kron]
        self._with_factors = _curvature(model, lossfn, extensions)
        self._plain = _curvature(model, lossfn, [])
        self._steps = 0
        self._precondition = None

    def step(self, X=None, y=None, closure=None) -> Tensor:
        """One update on the batch ``(X, y)``; returns the loss before it (module doc).

        EKFAC re-computes its basis only on steps that also evaluate the factors (the
        eigenvalues are re-fitted from that batch's individual gradients).

        Args:
            X: the batch's input.
            y: the batch's targets.
            closure: refused: the batch is passed as ``(X, y)`` (``torch.optim``'s signature).

        Returns:
            Tensor: the loss at the parameters before the update, detached.

        Raises:
            CurvatureTypeError: a closure, or no batch.
        """
        if closure is not None or X is None or y is None:
            raise CurvatureTypeError("KFACOptimizer.step(X, y): pass the batch (curvature needs it), "
                                     "not a closure.")
        factor_step = self._steps % self.factor_interval == 0
        qs = (self._with_factors if factor_step else self._plain)(X, y)
        if factor_step:
            self._average_factors(qs[self._key])
        inverse_step = self._steps % self.inverse_interval == 0 and (factor_step or self.curvature_type != "ekfac")
        if self._precondition is None or inverse_step:
            self._refresh(qs, y)
        elif factor_step and self.curvature_type == "ekfac":
            self._average_ekfac(qs, y, reset=False)
        self._update(qs["grad"])
        self._steps += 1
        return qs["loss"].detach()

    def _state_of(self, name: str) -> dict:
        return self.state[self._names[name]]

    def _average_factors(self, factors: Dict[str, List[Tensor]]) -> None:
        d = self.ema_decay
        for name, new in factors.items():
            st = self._state_of(name)
            old = st.get("factors")
            st["factors"] = [t.detach().clone() for t in new] if old is None else \
                [d * a + (1 - d) * b.detach() for a, b in zip(old, new)]

    def _averaged(self) -> Dict[str, List[Tensor]]:
        return {n: self._state_of(n)["factors"] for n in self._names}

    def _refresh(self, qs: dict, y) -> None:
        """Eigendecompose the averaged factors (EKFAC: snapshot the basis, re-fit ``s``)."""
        group = self.param_groups[0]
        factors = self._averaged()
        if self.curvature_type == "ekfac":
            for n, f in factors.items():
                self._state_of(n)["basis"] = [t.clone() for t in f]
            if "grad_batch" in qs:
                self._average_ekfac(qs, y, reset=True)
        self._build(group["damping"])

    def _build(self, damping: float) -> None:
        """The preconditioner of the current factors (EKFAC: basis), eigendecomposed once
        and kept until the next refresh; EKFAC's eigenvalues are read from the state at
        every step (they are re-fitted between refreshes)."""
        if self.curvature_type == "ekfac":
            basis = {n: self._state_of(n)["basis"] for n in self._names}
            self._precondition = pre.ekfac_preconditioner(basis, _StateView(self, "ekfac"), damping, model=self.model)
        else:
            self._precondition = pre.kron_preconditioner(self._averaged(), damping, method=self.method,
                                                         model=self.model)
        self._damping_used = damping

    def _average_ekfac(self, qs: dict, y, reset: bool) -> None:
        basis = {n: self._state_of(n)["basis"] for n in self._names}
        new = pre.ekfac_eigenvalues(basis, qs["grad_batch"], scale=pre.reduction_scale(self.lossfn, y),
                                    model=self.model)
        d = self.ema_decay
        for n, s in new.items():
            st = self._state_of(n)
            st["ekfac"] = s if reset or "ekfac" not in st else d * st["ekfac"] + (1 - d) * s

    def _directions(self, grads: Dict[str, Tensor]) -> Dict[str, Tensor]:
        group = self.param_groups[0]
        if group["damping"] != self._damping_used:  # a scheduler changed it: re-damp
            self._build(group["damping"])
        return self._precondition(grads)

    @torch.no_grad()
    def _update(self, grads: Dict[str, Tensor]) -> None:
        group = self.param_groups[0]
        wd, mu = group["weight_decay"], group["momentum"]
        grads = {n: g.detach() + wd * self._names[n].detach() if wd else g.detach() for n, g in grads.items()}
        directions = self._directions(grads)
        if group["kl_clip"] is not None:  # Ba et al. 2017: lr² Δᵀ F Δ ≈ lr² Δᵀ g ≤ κ
            quad = sum((directions[n] * grads[n]).sum() for n in directions) * group["lr"] ** 2
            nu = torch.clamp((group["kl_clip"] / quad.clamp_min(1e-30)).sqrt(), max=1.0)
            directions = {n: d * nu for n, d in directions.items()}
        for n, d in directions.items():
            p, st = self._names[n], self._state_of(n)
            if mu:
                buf = st.get("momentum_buffer")
                d = d.clone() if buf is None else buf.mul_(mu).add_(d)
                st["momentum_buffer"] = d
            p.add_(d, alpha=-group["lr"])

    def state_dict(self) -> dict:
        """``torch.optim.Optimizer``'s state dict plus the step count.

        Returns:
            dict: ``torch.optim.Optimizer``'s, with ``"curvlib_steps"``.
        """
        sd = super().state_dict()
        sd["curvlib_steps"] = self._steps
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore factors, eigenvalues, buffers and the step count; the eigendecompositions
        are recomputed from the restored factors at the next step.

        Args:
            state_dict: what ``state_dict()`` returned (it is not changed).
        """
        state_dict = dict(state_dict)
        self._steps = int(state_dict.pop("curvlib_steps", 0))
        super().load_state_dict(state_dict)
        self._precondition = None
        needed = "basis" if self.curvature_type == "ekfac" else "factors"
        if all(needed in self._state_of(n) for n in self._names):
            self._build(self.param_groups[0]["damping"])


class _StateView(Mapping):
    """``name -> optimizer.state[param][key]``, read when asked (a live view)."""

    def __init__(self, optimizer: "KFACOptimizer", key: str):
        self.optimizer, self.key = optimizer, key

    def __getitem__(self, name: str) -> Tensor:
        return self.optimizer._state_of(name)[self.key]

    def __iter__(self):
        return iter(self.optimizer._names)

    def __len__(self) -> int:
        return len(self.optimizer._names)


def _check_options(curvature: str, method: str, factor_interval, inverse_interval, ema_decay, lr) -> None:
    if curvature not in CURVATURES:
        raise CurvatureError(f"KFACOptimizer(curvature={curvature!r}) is not supported; use one of {CURVATURES}.")
    if method not in pre.METHODS:
        raise CurvatureError(f"KFACOptimizer(method={method!r}) is not supported; use one of {pre.METHODS}.")
    for label, v in (("factor_interval", factor_interval), ("inverse_interval", inverse_interval)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise CurvatureError(f"KFACOptimizer({label}={v!r}): must be a positive int.")
    if not 0 <= ema_decay < 1:
        raise CurvatureError(f"KFACOptimizer(ema_decay={ema_decay!r}): must be in [0, 1).")
    if not lr > 0:
        raise CurvatureError(f"KFACOptimizer(lr={lr!r}): must be positive.")
