"""Curvature backends for laplace-torch (``laplace``, version 0.3).

```python
from laplace import Laplace
from curvlib.laplace import CurvlibGGN

la = Laplace(model, "classification", hessian_structure="kron", backend=CurvlibGGN)
la.fit(train_loader)
la.optimize_prior_precision()
probs = la(X_test)
```

* :class:`CurvlibGGN`: the generalized Gauss-Newton (``stochastic=True``: its
  Monte-Carlo estimate, the Fisher with ``num_samples`` sampled labels);
* :class:`CurvlibEF`: the empirical Fisher (outer products of the individual
  gradients).

Both implement laplace-torch's ``CurvatureInterface`` with its conventions:
the loss is laplace's ``CrossEntropyLoss(reduction="sum")`` or
``MSELoss(reduction="sum")`` times ``factor`` (1 and 1/2, so that regression
has the unit-variance Gaussian likelihood); every curvature returned is that
of ``factor * loss`` summed over the batch; Kronecker factors come as a
:class:`laplace.utils.Kron` in the order of ``model.parameters()`` with
``[B, A]`` for a weight (``B`` output side, summed over the batch; ``A``
input side, the batch mean rescaled by ``M / N`` so that the batches of a
data set of ``N`` points add up) and ``[B]`` for a bias.

Everything comes from :func:`curvlib.curvature`, so any model curvlib handles
works, including residual networks and LayerNorm, which BackPACK's backend
cannot handle:

| method | curvlib extension |
|---|---|
| ``diag`` | ``DiagGGNExact`` (``DiagGGNMC`` when ``stochastic``); EF: ``SumGradSquared`` |
| ``kron`` | ``KFLR`` (``KFAC`` when ``stochastic``); one-dimensional parameters of other layers (LayerNorm, BatchNorm, ...): their exact GGN block |
| ``full`` | ``SqrtGGNExact`` (``SqrtGGNMC``): ``H = Σ S Sᵀ``; EF: ``BatchGrad`` |
| ``gradients`` | ``BatchGrad`` |
| ``jacobians`` | ``SqrtGGNExact`` of ``MSELoss(reduction="sum")`` (whose square-root factor is ``√2 I``): every sample's Jacobian in one batched backward pass; with ``enable_backprop=True``, laplace's differentiable ``torch.func`` Jacobians |

The model must take a tensor whose dim 0 is the batch and, for
classification, return logits ``[N, C]`` for class-index targets ``[N]``.
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

try:
    from laplace.curvature.curvature import CurvatureInterface, EFInterface, GGNInterface
    from laplace.utils.matrix import Kron
except ImportError as err:  # pragma: no cover - exercised only without laplace-torch
    raise ImportError(
        "curvlib.laplace needs laplace-torch 0.3. Install it without letting pip replace "
        "your torch: pip install --no-deps laplace-torch==0.3 asdfghjkl==0.1a4 "
        "backpack-for-pytorch==1.7.1 unfoldNd curvlinops-for-pytorch==3.0.1 einconv "
        "linear_operator torchmetrics lightning-utilities einops && pip install scipy tqdm"
    ) from err

from ._errors import CurvatureError
from ._transform import curvature
from .extensions import (
    KFAC,
    KFLR,
    BatchGrad,
    DiagGGNExact,
    DiagGGNMC,
    SqrtGGNExact,
    SqrtGGNMC,
    SumGradSquared,
)

__all__ = ["CurvlibGGN", "CurvlibEF", "CurvlibInterface"]

# Layers whose weight curvlib factors as laplace's two-factor Kron expects:
# ``[out, in, *kernel]`` with ``B`` of size ``out`` and ``A`` of size ``in * prod(kernel)``.
_KRON_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d)


class CurvlibInterface(CurvatureInterface):
    """Shared part of the curvlib backends: inputs, Jacobians and individual gradients.

    Args (as laplace-torch passes them):
        model: the network (for last-layer Laplace, laplace's ``FeatureExtractor``;
            curvature is then taken of its last layer on the detached features).
        likelihood: ``"classification"`` or ``"regression"``.
        last_layer: only the last layer's parameters.
        subnetwork_indices: indices into the flattened parameter vector
            (``diag``, ``full``, ``gradients``, ``jacobians``).
        dict_key_x, dict_key_y: laplace's keys for dict inputs; curvlib needs
            tensors and refuses dict inputs.
        generator: optional ``torch.Generator`` for the Monte-Carlo extensions.
    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: str,
        last_layer: bool = False,
        subnetwork_indices: Optional[torch.LongTensor] = None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        generator: Optional[torch.Generator] = None,
    ) -> None:
        CurvatureInterface.__init__(
            self, model, likelihood, last_layer, subnetwork_indices, dict_key_x, dict_key_y
        )
        self.generator = generator
        self._transforms: Dict[Any, Any] = {}

    # ----------------------------------------------------------------- helpers
    def _transform(self, key: Any, lossfn: nn.Module, extensions: list):
        """``curvature(self._model, lossfn, extensions)``, traced once and cached."""
        if key not in self._transforms:
            self._transforms[key] = curvature(self._curvature_model(), lossfn, extensions)
        return self._transforms[key]

    def _curvature_model(self) -> nn.Module:
        """``self._model``; for last-layer Laplace a hook-free twin of the last layer.

        laplace's ``FeatureExtractor`` puts a forward hook on the last ``nn.Linear``
        (to record the features); curvlib runs hooked modules through its generic
        rule, which has no Kronecker factors. The twin holds the very same
        ``Parameter`` objects, so it always sees the current values.
        """
        if not self.last_layer:
            return self._model
        layer = self._model
        if not (layer._forward_hooks or layer._forward_pre_hooks) or type(layer) is not nn.Linear:
            return layer
        twin = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                         device="meta")
        twin.weight = layer.weight
        if layer.bias is not None:
            twin.bias = layer.bias
        return twin

    def _inputs(self, x: Any) -> Tensor:
        """The tensor fed to ``self._model``: ``x``, or the features for last-layer Laplace."""
        if isinstance(x, MutableMapping) or not isinstance(x, Tensor):
            raise CurvatureError(
                f"{type(self).__name__}: the input must be a tensor with the batch in dim 0, "
                f"got {type(x).__name__}; dict-like inputs (dict_key_x={self.dict_key_x!r}) "
                "are not supported by the curvlib backends."
            )
        if self.last_layer:
            with torch.no_grad():
                _, features = self.model.forward_with_features(x)
            return features.detach()
        return x

    def _check_targets(self, y: Tensor) -> None:
        if self.likelihood == "classification" and y.ndim != 1:
            raise CurvatureError(
                f"{type(self).__name__}: classification needs class-index targets of shape "
                f"[N] (and logits [N, C]); got targets of shape {tuple(y.shape)}. Reshape "
                "sequence outputs to [N*T, C] inside the model."
            )

    def _flatten(self, quantity: Dict[str, Tensor], lead: int) -> Tensor:
        """Concatenate ``{name: [*lead_dims, *p.shape]}`` into ``[*lead_dims, P]`` in laplace's order."""
        parts = []
        for name in self.params_dict:
            q = quantity[name]
            parts.append(q.reshape(*q.shape[:lead], -1))
        return torch.cat(parts, dim=-1)

    def _select(self, v: Tensor) -> Tensor:
        """Restrict the last dim to the subnetwork, if any."""
        if self.subnetwork_indices is None:
            return v
        return v[..., self.subnetwork_indices]

    def _run(self, key: Any, lossfn: nn.Module, extensions: list, x: Any, y: Tensor,
             params: Optional[Dict[str, Tensor]] = None) -> dict:
        xin = self._inputs(x)
        self._check_targets(y)
        f = self._transform(key, lossfn, extensions)
        with torch.enable_grad():
            return f(xin, y) if params is None else f(xin, y, params=params)

    # ----------------------------------------------------- CurvatureInterface
    def jacobians(self, x: Any, enable_backprop: bool = False) -> Tuple[Tensor, Tensor]:
        """Per-sample Jacobians ``[N, C, P]`` of the outputs ``[N, C]``, and the outputs.

        ``MSELoss(reduction="sum")`` has the loss-Hessian factor ``√2 I``, so its exact
        square-root GGN is ``√2 J_n`` row by row: one batched backward pass for all
        ``C`` outputs. curvlib's results carry no autograd graph, so with
        ``enable_backprop`` (Jacobians differentiable w.r.t. ``x``) this uses
        laplace-torch's ``torch.func`` Jacobians instead.
        """
        if enable_backprop and not self.last_layer:
            return CurvatureInterface.jacobians(self, x, enable_backprop=True)
        xin = self._inputs(x)
        with torch.enable_grad():
            out = self._model(xin)
            if out.ndim != 2:
                raise CurvatureError(
                    f"{type(self).__name__}.jacobians: the model output must be [N, C], got "
                    f"shape {tuple(out.shape)}."
                )
            target = torch.zeros_like(out).detach()
            f = self._transform(("jacobians",), nn.MSELoss(reduction="sum"), [SqrtGGNExact()])
            sqrt = f(xin, target)["sqrt_ggn_exact"]  # name -> [C, N, *p.shape]
        Js = self._flatten({k: v.transpose(0, 1) for k, v in sqrt.items()}, 2) / math.sqrt(2.0)
        Js = self._select(Js)
        return (Js, out) if enable_backprop else (Js.detach(), out.detach())

    def selected_output_jacobians(
        self, x: Any, outputs: Tensor, enable_backprop: bool = False
    ) -> Tuple[Tensor, Tensor]:
        """Jacobians of the selected outputs ``outputs`` (``[N]`` or ``[N, K]``): ``[N, K, P]``."""
        Js, out = self.jacobians(x, enable_backprop=enable_backprop)
        if outputs.ndim == 1:
            outputs = outputs[:, None]
        if outputs.shape[0] != Js.shape[0]:
            raise ValueError("Output selectors must match the input batch size.")
        index = outputs.to(Js.device, dtype=torch.long).unsqueeze(-1).expand(-1, -1, Js.shape[-1])
        return torch.gather(Js, 1, index), out

    def gradients(self, x: Any, y: Tensor) -> Tuple[Tensor, Tensor]:
        """Individual gradients ``[N, P]`` of laplace's sum-reduced loss, and that loss."""
        qs = self._run(("batch_grad",), self.lossfunc, [BatchGrad()], x, y)
        Gs = self._select(self._flatten(qs["grad_batch"], 1))
        return Gs.detach(), qs["loss"].detach()

    def _kron_layout(self) -> Tuple[List[str], List[str]]:
        """Split the parameters into those with Kronecker factors and 1-D ones given a dense block."""
        owner: Dict[str, nn.Module] = {}
        for mod_name, module in self._model.named_modules():
            for p_name, _ in module.named_parameters(recurse=False):
                owner.setdefault(f"{mod_name}.{p_name}" if mod_name else p_name, module)
        kron, dense = [], []
        for name, p in self.params_dict.items():
            module = owner.get(name)
            factorable = isinstance(module, _KRON_LAYERS) and getattr(module, "groups", 1) == 1
            if factorable and p.ndim in (1, 2, 3, 4):
                kron.append(name)
            elif p.ndim == 1:
                dense.append(name)
            else:
                raise CurvatureError(
                    f"{type(self).__name__}.kron: parameter {name!r} of shape {tuple(p.shape)} "
                    f"(module {type(module).__name__}) has no Kronecker factors: laplace's Kron "
                    "holds two factors for every parameter with 2 to 4 dims, which curvlib "
                    "computes for Linear and Conv1d/Conv2d (groups=1) weights. Use "
                    "hessian_structure='diag' or 'full' for this model."
                )
        return kron, dense

    def _kron_from(self, factors: Dict[str, list], blocks: Dict[str, Tensor], M: int, N: int) -> Kron:
        kfacs = []
        for name in self.params_dict:
            if name in factors:
                F = [t.detach().clone() for t in factors[name]]
                if len(F) == 2:
                    F[1] = F[1] * (M / N)  # batch mean of the inputs -> share of the data-set mean
                kfacs.append(F)
            else:
                kfacs.append([blocks[name].detach()])
        return Kron(kfacs) * self.factor

    def _params(self, names: List[str]) -> Dict[str, Tensor]:
        return {n: self.params_dict[n] for n in names}


class CurvlibGGN(CurvlibInterface, GGNInterface):
    """laplace-torch backend: the GGN (``stochastic=True``: Monte-Carlo Fisher) from curvlib.

    Args: those of :class:`CurvlibInterface`, plus ``stochastic`` (use Monte-Carlo
    labels: ``DiagGGNMC``, ``KFAC``, ``SqrtGGNMC``) and ``num_samples`` (their
    ``mc_samples``).
    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: str,
        last_layer: bool = False,
        subnetwork_indices: Optional[torch.LongTensor] = None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        stochastic: bool = False,
        num_samples: int = 1,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        self.stochastic = stochastic
        self.num_samples = num_samples
        CurvlibInterface.__init__(
            self, model, likelihood, last_layer, subnetwork_indices, dict_key_x, dict_key_y,
            generator,
        )

    def diag(self, x: Any, y: Tensor, **kwargs: Any) -> Tuple[Tensor, Tensor]:
        """``(factor * loss, factor * diag(GGN))`` for the batch, ``[P]``."""
        if self.stochastic:
            ext, key = DiagGGNMC(mc_samples=self.num_samples, generator=self.generator), "diag_ggn_mc"
        else:
            ext, key = DiagGGNExact(), "diag_ggn_exact"
        qs = self._run(("diag", key), self.lossfunc, [ext], x, y)
        H = self._select(self._flatten(qs[key], 0))
        return self.factor * qs["loss"].detach(), self.factor * H.detach()

    def full(self, x: Any, y: Tensor, **kwargs: Any) -> Tuple[Tensor, Tensor]:
        """``(factor * loss, factor * GGN)`` for the batch, ``[P, P]``, as ``Σ S Sᵀ``."""
        if self.stochastic:
            ext, key = SqrtGGNMC(mc_samples=self.num_samples, generator=self.generator), "sqrt_ggn_mc"
        else:
            ext, key = SqrtGGNExact(), "sqrt_ggn_exact"
        qs = self._run(("full", key), self.lossfunc, [ext], x, y)
        S = self._select(self._flatten(qs[key], 2)).detach()  # [K, N, P]
        S = S.reshape(-1, S.shape[-1])
        return self.factor * qs["loss"].detach(), self.factor * (S.T @ S)

    def kron(self, x: Any, y: Tensor, N: int, **kwargs: Any) -> Tuple[Tensor, Kron]:
        """``(factor * loss, factor * Kron)``: KFLR (``stochastic``: KFAC) factors.

        Kronecker factors for Linear and Conv1d/Conv2d layers; any other
        one-dimensional parameter (LayerNorm, BatchNorm, ...) gets its exact
        (``stochastic``: Monte-Carlo) GGN block as a single Kron factor.
        """
        if self.subnetwork_indices is not None:
            raise CurvatureError(
                f"{type(self).__name__}.kron: Kronecker factors cannot be restricted to "
                "subnetwork_indices; use hessian_structure='full' or 'diag' for a subnetwork."
            )
        kron_names, dense_names = self._kron_layout()
        if self.stochastic:
            kext, kkey = KFAC(mc_samples=self.num_samples, generator=self.generator), "kfac"
            sext, skey = SqrtGGNMC(mc_samples=self.num_samples, generator=self.generator), "sqrt_ggn_mc"
        else:
            kext, kkey = KFLR(), "kflr"
            sext, skey = SqrtGGNExact(), "sqrt_ggn_exact"
        loss, factors, blocks = None, {}, {}
        if kron_names:
            qs = self._run(("kron", kkey), self.lossfunc, [kext], x, y, self._params(kron_names))
            factors, loss = qs[kkey], qs["loss"]
        if dense_names:
            qs = self._run(("kron-dense", skey), self.lossfunc, [sext], x, y, self._params(dense_names))
            for name in dense_names:
                S = qs[skey][name].reshape(-1, self.params_dict[name].numel())
                blocks[name] = S.T @ S
            loss = qs["loss"]
        M = y.shape[0]
        return self.factor * loss.detach(), self._kron_from(factors, blocks, M, N)


class CurvlibEF(CurvlibInterface, EFInterface):
    """laplace-torch backend: the empirical Fisher ``factor * Σ_n g_n g_nᵀ`` from curvlib.

    ``diag`` uses ``SumGradSquared``; ``full`` the individual gradients
    (``BatchGrad``). Kronecker factors of the empirical Fisher are not available.
    """

    def diag(self, x: Any, y: Tensor, **kwargs: Any) -> Tuple[Tensor, Tensor]:
        """``(factor * loss, factor * Σ_n g_n²)``, ``[P]``."""
        qs = self._run(("ef-diag",), self.lossfunc, [SumGradSquared()], x, y)
        H = self._select(self._flatten(qs["sum_grad_squared"], 0))
        return self.factor * qs["loss"].detach(), self.factor * H.detach()

    def full(self, x: Any, y: Tensor, **kwargs: Any) -> Tuple[Tensor, Tensor]:
        """``(factor * loss, factor * Σ_n g_n g_nᵀ)``, ``[P, P]``."""
        Gs, loss = self.gradients(x, y)
        return self.factor * loss, self.factor * (Gs.T @ Gs)

    def kron(self, x: Any, y: Tensor, N: int, **kwargs: Any) -> Tuple[Tensor, Kron]:
        raise NotImplementedError(
            "CurvlibEF: Kronecker factors of the empirical Fisher are not available; use "
            "CurvlibGGN (KFLR, or KFAC with stochastic=True) for hessian_structure='kron'."
        )
