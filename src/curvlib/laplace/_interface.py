"""The part of curvlib's laplace-torch backends that GGN and EF share."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from laplace.curvature.curvature import CurvatureInterface
from laplace.utils.matrix import Kron
from torch import Tensor, nn

from .._core.errors import CurvatureError, CurvatureTypeError
from .._transform.entry import curvature
from ..extensions import BatchGrad, SqrtGGNExact

# Layers whose weight curvlib factors as laplace's two-factor Kron expects:
# ``[out, in, *kernel]`` with ``B`` of size ``out`` and ``A`` of size ``in * prod(kernel)``.
_KRON_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d)
_MSE_SUM = nn.MSELoss(reduction="sum")  # loss-Hessian factor √2 I: its square-root GGN is √2 J


class CurvlibInterface(CurvatureInterface):
    """Shared part of the curvlib backends: inputs, Jacobians, individual gradients, Kron.

    The arguments are those laplace-torch passes to a backend.

    Args:
        model: the network (for last-layer Laplace, laplace's ``FeatureExtractor``;
            curvature is then taken of its last layer on the detached features).
        likelihood: ``"classification"`` or ``"regression"``.
        last_layer: only the last layer's parameters.
        subnetwork_indices: indices into the flattened parameter vector
            (``diag``, ``full``, ``gradients``, ``jacobians``).
        dict_key_x: laplace's key of the input in a mapping batch (laplace reads batch
            sizes with it; the model gets the whole mapping).
        dict_key_y: laplace's key of the targets in a mapping batch.
        generator: optional ``torch.Generator`` for the Monte-Carlo extensions.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib.laplace import CurvlibGGN     # a CurvlibInterface
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> backend = CurvlibGGN(model, "classification")
        >>> Js, out = backend.jacobians(X)                  # [N, C, P], [N, C]
        >>> Js.shape, out.shape
        (torch.Size([5, 2, 26]), torch.Size([5, 2]))
        >>> Gs, loss = backend.gradients(X, y)              # individual gradients [N, P]
        >>> Gs.shape
        torch.Size([5, 26])
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
        """``curvature(model, lossfn, extensions)``, traced once per ``key`` and cached."""
        if key not in self._transforms:
            self._transforms[key] = curvature(self._model, lossfn, extensions)
        return self._transforms[key]

    def _inputs(self, x: Any) -> Any:
        """What ``self._model`` gets: ``x`` (a tensor, or a mapping or tuple of tensors
        with the batch in dim 0, passed as one argument), or for last-layer Laplace
        the detached features."""
        if not isinstance(x, (Tensor, Mapping, tuple)):
            raise CurvatureTypeError(
                f"{type(self).__name__}: the input must be a tensor, or a mapping or tuple of "
                f"tensors with the batch in dim 0, got {type(x).__name__}."
            )
        if self.last_layer:
            with torch.no_grad():
                _, features = self.model.forward_with_features(x)
            return features.detach()
        return x

    def _check_targets(self, y: Tensor) -> None:
        if self.likelihood != "classification":
            return
        if y.ndim == 1 or (y.ndim == 2 and y.is_floating_point()):
            return
        raise CurvatureError(
            f"{type(self).__name__}: classification needs class-index targets of shape [N] or "
            f"class probabilities of shape [N, C] (with logits [N, C]); got targets of shape "
            f"{tuple(y.shape)} and dtype {y.dtype}. Reshape sequence outputs to [N*T, C] "
            "inside the model."
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

    def _run(self, extensions: list, x: Any, y: Tensor, names: Optional[List[str]] = None,
             lossfn: Optional[nn.Module] = None, prepared: bool = False) -> dict:
        """``curvature(...)(x, y)`` for ``extensions`` (all parameters, or only ``names``);
        ``prepared``: ``x`` is already what the model gets (see :meth:`_inputs`)."""
        xin = x if prepared else self._inputs(x)
        lossfn = self.lossfunc if lossfn is None else lossfn
        if lossfn is self.lossfunc:
            self._check_targets(y)
        key = (tuple(extensions), None if names is None else tuple(names), id(lossfn))
        f = self._transform(key, lossfn, extensions)
        with torch.enable_grad():
            if names is None:
                return f(xin, y)
            return f(xin, y, params={n: self.params_dict[n] for n in names})

    # ----------------------------------------------------- CurvatureInterface
    def jacobians(self, x: Any, enable_backprop: bool = False) -> Tuple[Tensor, Tensor]:
        r"""Per-sample Jacobians ``[N, C, P]`` of the outputs ``[N, C]``, and the outputs.

        ``MSELoss(reduction="sum")`` has the loss-Hessian factor $\sqrt{2}\, I$, so its exact
        square-root GGN is $\sqrt{2}\, J_n$ row by row: one batched backward pass for all
        ``C`` outputs. curvlib's results carry no autograd graph, so with
        ``enable_backprop`` (Jacobians differentiable w.r.t. ``x``) this uses
        laplace-torch's ``torch.func`` Jacobians instead.

        Args:
            x: the input batch: a tensor, or a mapping or tuple of tensors, batch in dim 0.
            enable_backprop: Jacobians differentiable w.r.t. ``x`` (laplace's ``torch.func`` path).

        Returns:
            tuple: ``(Js [N, C, P], out [N, C])``.
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
        qs = self._run([SqrtGGNExact()], xin, torch.zeros_like(out).detach(),
                       lossfn=_MSE_SUM, prepared=True)
        sqrt = qs["sqrt_ggn_exact"]  # name -> [C, N, *p.shape]
        Js = self._flatten({k: v.transpose(0, 1) for k, v in sqrt.items()}, 2) / math.sqrt(2.0)
        Js = self._select(Js)
        return (Js, out) if enable_backprop else (Js.detach(), out.detach())

    def selected_output_jacobians(
        self, x: Any, outputs: Tensor, enable_backprop: bool = False
    ) -> Tuple[Tensor, Tensor]:
        """Jacobians of the selected outputs ``outputs`` (``[N]`` or ``[N, K]``): ``[N, K, P]``.

        Args:
            x: the input batch, as for ``jacobians``.
            outputs: the output index per sample, ``[N]``, or ``K`` of them, ``[N, K]``.
            enable_backprop: as for ``jacobians``.

        Returns:
            tuple: ``(Js [N, K, P], out [N, C])``.
        """
        Js, out = self.jacobians(x, enable_backprop=enable_backprop)
        if outputs.ndim == 1:
            outputs = outputs[:, None]
        if outputs.shape[0] != Js.shape[0]:
            raise ValueError("Output selectors must match the input batch size.")
        index = outputs.to(Js.device, dtype=torch.long).unsqueeze(-1).expand(-1, -1, Js.shape[-1])
        return torch.gather(Js, 1, index), out

    def gradients(self, x: Any, y: Tensor) -> Tuple[Tensor, Tensor]:
        """Individual gradients ``[N, P]`` of laplace's sum-reduced loss, and that loss.

        Args:
            x: the input batch, as for ``jacobians``.
            y: the targets ``[N]`` (class indices), ``[N, C]`` (probabilities or regression targets).

        Returns:
            tuple: ``(Gs [N, P], loss)``, ``loss`` the scalar sum-reduced loss.
        """
        qs = self._run([BatchGrad()], x, y)
        Gs = self._select(self._flatten(qs["grad_batch"], 1))
        return Gs.detach(), qs["loss"].detach()

    # --------------------------------------------------------------- Kron
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

    @staticmethod
    def _kron_options(approx: Optional[str]) -> Dict[str, Any]:
        """The Kronecker extension's ``kfac_approx``: laplace's default ``"expand"`` unless told."""
        return {"kfac_approx": approx or "expand"}

    def _kron(self, x: Any, y: Tensor, N: int, kron_ext: Callable[[List[str]], Tuple[Any, str]],
              dense_factor: Callable[[List[str]], Tuple[Dict[str, Tensor], Tensor]]
              ) -> Tuple[Tensor, Kron]:
        """``(factor * loss, factor * Kron)`` from a Kronecker extension and dense 1-D blocks.

        ``kron_ext(names)`` gives the extension and its result key; ``dense_factor(names)``
        gives ``{name: [K, p]}`` factors ``F`` with block ``Fᵀ F``, and the loss.
        """
        if self.subnetwork_indices is not None:
            raise CurvatureError(
                f"{type(self).__name__}.kron: Kronecker factors cannot be restricted to "
                "subnetwork_indices; use hessian_structure='full' or 'diag' for a subnetwork."
            )
        kron_names, dense_names = self._kron_layout()
        loss, factors, blocks = None, {}, {}
        if kron_names:
            ext, key = kron_ext(kron_names)
            qs = self._run([ext], x, y, kron_names)
            factors, loss = qs[key], qs["loss"]
        if dense_names:
            F, loss = dense_factor(dense_names)
            blocks = {name: F[name].T @ F[name] for name in dense_names}
        return self.factor * loss.detach(), self._kron_from(factors, blocks, y.shape[0], N)

    def _biasless(self) -> set:
        """Weights of layers without a bias (laplace's curvlinops backend merges their
        factors into one when both are ``1 x 1``)."""
        out = set()
        for mod_name, module in self._model.named_modules():
            if isinstance(module, _KRON_LAYERS) and module.bias is None:
                out.add(f"{mod_name}.weight" if mod_name else "weight")
        return out

    def _kron_from(self, factors: Dict[str, list], blocks: Dict[str, Tensor], M: int, N: int) -> Kron:
        kfacs = []
        biasless = self._biasless()
        for name in self.params_dict:
            if name in factors:
                F = [t.detach().clone() for t in factors[name]]
                if len(F) == 2:
                    F[1] = F[1] * (M / N)  # batch mean of the inputs -> share of the data-set mean
                    if name in biasless and F[0].numel() == F[1].numel() == 1:
                        F = [F[0] * F[1]]  # as laplace's CurvlinopsInterface._get_kron_factors
                kfacs.append(F)
            else:
                kfacs.append([blocks[name].detach()])
        return Kron(kfacs) * self.factor
