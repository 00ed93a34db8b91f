"""``CurvlibGGN`` and ``CurvlibEF``: laplace-torch's GGN and EF interfaces from curvlib."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from laplace.curvature.curvature import EFInterface, GGNInterface
from laplace.utils.matrix import Kron
from torch import Tensor, nn

from .._core.errors import CurvatureError
from ..extensions import (
    KFAC,
    KFACEmpirical,
    KFLR,
    BatchGrad,
    DiagGGNExact,
    DiagGGNMC,
    SqrtGGNExact,
    SqrtGGNMC,
    SumGradSquared,
)
from ._interface import CurvlibInterface
from ._options import check_constructor, generator_or_none, method_options


_COMMON = ("last_layer", "subnetwork_indices", "dict_key_x", "dict_key_y", "generator")


class CurvlibGGN(CurvlibInterface, GGNInterface):
    """laplace-torch backend: the GGN (``stochastic=True``: Monte-Carlo Fisher) from curvlib.

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
        stochastic: use Monte-Carlo labels (``DiagGGNMC``, ``KFAC``, ``SqrtGGNMC``).
        num_samples: their ``mc_samples``, a positive int (a call's ``mc_samples=`` overrides it).
        generator: optional ``torch.Generator`` for the Monte-Carlo extensions.
        **unknown: any other keyword (laplace-torch's ``backend_kwargs``): refused.

    Raises:
        CurvatureError: an unknown keyword, a ``num_samples`` that is not a positive int.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from laplace import Laplace
        >>> from curvlib.laplace import CurvlibGGN
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
        >>> loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=8)
        >>> la = Laplace(model, "classification", hessian_structure="kron", backend=CurvlibGGN)
        >>> la.fit(loader)
        >>> la(X[:2], pred_type="glm", link_approx="probit").shape      # predictive probabilities
        torch.Size([2, 2])
        >>> loss, diag = CurvlibGGN(model, "classification").diag(X, y)  # the backend on its own
        >>> diag.shape                                                  # GGN diagonal of Σ_n ℓ_n, [P]
        torch.Size([26])
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
        **unknown: Any,
    ) -> None:
        check_constructor("CurvlibGGN", unknown, _COMMON + ("stochastic", "num_samples"))
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise CurvatureError(
                f"CurvlibGGN(num_samples={num_samples!r}): num_samples must be a positive int."
            )
        self.stochastic = bool(stochastic)
        self.num_samples = num_samples
        CurvlibInterface.__init__(
            self, model, likelihood, last_layer, subnetwork_indices, dict_key_x, dict_key_y,
            generator_or_none("CurvlibGGN", generator),
        )

    def _mc(self, mc_samples: int) -> Dict[str, Any]:
        return {"mc_samples": mc_samples, "generator": self.generator}

    def diag(self, x: Any, y: Tensor, **kwargs: Any) -> Tuple[Tensor, Tensor]:
        """``(factor * loss, factor * diag(GGN))`` for the batch, ``[P]``.

        Args:
            x: the input batch: a tensor, or a mapping or tuple of tensors, batch in dim 0.
            y: the targets: class indices ``[N]`` or probabilities ``[N, C]`` (classification),
                ``[N, C]`` (regression).
            **kwargs: laplace's ``N`` (ignored) and ``mc_samples`` (Monte-Carlo labels,
                ``stochastic`` only; default ``num_samples``); any other is refused.

        Returns:
            tuple: ``(loss, diagonal [P])``, both times ``factor``.

        Raises:
            CurvatureError: an unknown keyword or a bad option.
        """
        opts = method_options(self, "diag", kwargs)
        ext = DiagGGNMC(**self._mc(opts["mc_samples"])) if self.stochastic else DiagGGNExact()
        qs = self._run([ext], x, y)
        H = self._select(self._flatten(qs[ext.name], 0))
        return self.factor * qs["loss"].detach(), self.factor * H.detach()

    def full(self, x: Any, y: Tensor, **kwargs: Any) -> Tuple[Tensor, Tensor]:
        r"""``(factor * loss, factor * GGN)`` for the batch, ``[P, P]``, as $\sum S S^\top$.

        Args:
            x: the input batch: a tensor, or a mapping or tuple of tensors, batch in dim 0.
            y: the targets: class indices ``[N]`` or probabilities ``[N, C]`` (classification),
                ``[N, C]`` (regression).
            **kwargs: laplace's ``N`` (ignored) and ``mc_samples`` (Monte-Carlo labels,
                ``stochastic`` only; default ``num_samples``); any other is refused.

        Returns:
            tuple: ``(loss, matrix [P, P])``, both times ``factor``.

        Raises:
            CurvatureError: an unknown keyword or a bad option.
        """
        opts = method_options(self, "full", kwargs)
        ext = SqrtGGNMC(**self._mc(opts["mc_samples"])) if self.stochastic else SqrtGGNExact()
        qs = self._run([ext], x, y)
        S = self._select(self._flatten(qs[ext.name], 2)).detach()  # [K, N, P]
        S = S.reshape(-1, S.shape[-1])
        return self.factor * qs["loss"].detach(), self.factor * (S.T @ S)

    def kron(self, x: Any, y: Tensor, N: int, **kwargs: Any) -> Tuple[Tensor, Kron]:
        """``(factor * loss, factor * Kron)``: KFLR (``stochastic``: KFAC) factors.

        Kronecker factors for Linear and Conv1d/Conv2d layers; any other
        one-dimensional parameter (LayerNorm, BatchNorm, ...) gets its exact
        (``stochastic``: Monte-Carlo) GGN block as a single Kron factor.
        ``mc_samples`` (stochastic only) and ``kfac_approx`` as for laplace's
        curvlinops backend.

        Args:
            x: the input batch: a tensor, or a mapping or tuple of tensors, batch in dim 0.
            y: the targets: class indices ``[N]`` or probabilities ``[N, C]`` (classification),
                ``[N, C]`` (regression).
            N: the size of the whole data set (``A`` is rescaled by ``M / N``; see the module doc).
            **kwargs: ``mc_samples`` (Monte-Carlo labels, ``stochastic`` only; default
                ``num_samples``) and ``kfac_approx`` (``None``, ``"expand"`` or ``"reduce"``); any
                other is refused.

        Returns:
            tuple: ``(loss, Kron)``: laplace's ``Kron`` of the factors, both times ``factor``.

        Raises:
            CurvatureError: an unknown keyword or a bad option.
        """
        opts = method_options(self, "kron", kwargs)
        mc = self._mc(opts["mc_samples"])
        cls, extra = (KFAC, mc) if self.stochastic else (KFLR, {})
        sqrt = SqrtGGNMC(**mc) if self.stochastic else SqrtGGNExact()

        def kron_ext(names: List[str]):
            ext = cls(**extra, **self._kron_options(opts["kfac_approx"]))
            return ext, ext.name

        def dense(names: List[str]):
            qs = self._run([sqrt], x, y, names)
            return {n: qs[sqrt.name][n].reshape(-1, self.params_dict[n].numel()) for n in names}, qs["loss"]

        return self._kron(x, y, N, kron_ext, dense)


class CurvlibEF(CurvlibInterface, EFInterface):
    r"""laplace-torch backend: the empirical Fisher $\mathrm{factor} \cdot \sum_n g_n g_n^\top$ from curvlib.

    ``diag`` uses ``SumGradSquared``; ``full`` the individual gradients
    (``BatchGrad``); ``kron`` curvlib's ``KFACEmpirical`` (KFAC with the
    individual loss gradients backpropagated; other 1-D parameters: their exact
    empirical-Fisher block from ``BatchGrad``).

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
        **unknown: any other keyword (laplace-torch's ``backend_kwargs``): refused.

    Raises:
        CurvatureError: an unknown keyword.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from laplace import Laplace
        >>> from curvlib.laplace import CurvlibEF
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
        >>> loss, H = CurvlibEF(model, "classification").full(X, y)     # Σ_n g_n g_nᵀ, [P, P]
        >>> H.shape
        torch.Size([26, 26])
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
        **unknown: Any,
    ) -> None:
        check_constructor("CurvlibEF", unknown, _COMMON)
        CurvlibInterface.__init__(
            self, model, likelihood, last_layer, subnetwork_indices, dict_key_x, dict_key_y,
            generator_or_none("CurvlibEF", generator),
        )

    def diag(self, x: Any, y: Tensor, **kwargs: Any) -> Tuple[Tensor, Tensor]:
        r"""$(\mathrm{factor} \cdot \mathrm{loss}, \mathrm{factor} \cdot \sum_n g_n^2)$, ``[P]``.

        Args:
            x: the input batch: a tensor, or a mapping or tuple of tensors, batch in dim 0.
            y: the targets: class indices ``[N]`` or probabilities ``[N, C]`` (classification),
                ``[N, C]`` (regression).
            **kwargs: laplace's ``N`` (ignored) and ``mc_samples`` (1 only); any other is refused.

        Returns:
            tuple: ``(loss, diagonal [P])``, both times ``factor``.

        Raises:
            CurvatureError: an unknown keyword or a bad option.
        """
        method_options(self, "diag", kwargs)
        qs = self._run([SumGradSquared()], x, y)
        H = self._select(self._flatten(qs["sum_grad_squared"], 0))
        return self.factor * qs["loss"].detach(), self.factor * H.detach()

    def full(self, x: Any, y: Tensor, **kwargs: Any) -> Tuple[Tensor, Tensor]:
        r"""$(\mathrm{factor} \cdot \mathrm{loss}, \mathrm{factor} \cdot \sum_n g_n g_n^\top)$, ``[P, P]``.

        Args:
            x: the input batch: a tensor, or a mapping or tuple of tensors, batch in dim 0.
            y: the targets: class indices ``[N]`` or probabilities ``[N, C]`` (classification),
                ``[N, C]`` (regression).
            **kwargs: laplace's ``N`` (ignored) and ``mc_samples`` (1 only); any other is refused.

        Returns:
            tuple: ``(loss, matrix [P, P])``, both times ``factor``.

        Raises:
            CurvatureError: an unknown keyword or a bad option.
        """
        method_options(self, "full", kwargs)
        Gs, loss = self.gradients(x, y)
        return self.factor * loss, self.factor * (Gs.T @ Gs)

    def kron(self, x: Any, y: Tensor, N: int, **kwargs: Any) -> Tuple[Tensor, Kron]:
        """``(factor * loss, factor * Kron)`` of the empirical Fisher (``kfac_approx`` as for
        laplace's curvlinops backend).

        Args:
            x: the input batch: a tensor, or a mapping or tuple of tensors, batch in dim 0.
            y: the targets: class indices ``[N]`` or probabilities ``[N, C]`` (classification),
                ``[N, C]`` (regression).
            N: the size of the whole data set (``A`` is rescaled by ``M / N``; see the module doc).
            **kwargs: ``mc_samples`` (1 only) and ``kfac_approx`` (``None``, ``"expand"`` or
                ``"reduce"``); any other is refused.

        Returns:
            tuple: ``(loss, Kron)``: laplace's ``Kron`` of the factors, both times ``factor``.

        Raises:
            CurvatureError: an unknown keyword or a bad option.
        """
        opts = method_options(self, "kron", kwargs)

        def kron_ext(names: List[str]):
            ext = KFACEmpirical(**self._kron_options(opts["kfac_approx"]))
            return ext, ext.name

        def dense(names: List[str]):
            qs = self._run([BatchGrad()], x, y, names)
            return {n: qs["grad_batch"][n].reshape(y.shape[0], -1) for n in names}, qs["loss"]

        return self._kron(x, y, N, kron_ext, dense)
