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
| ``kron`` | ``KFLR`` (``KFAC`` when ``stochastic``; EF: ``KFACEmpirical``); one-dimensional parameters of other layers (LayerNorm, BatchNorm, ...): their exact GGN (EF) block |
| ``full`` | ``SqrtGGNExact`` (``SqrtGGNMC``): ``H = Σ S Sᵀ``; EF: ``BatchGrad`` |
| ``gradients`` | ``BatchGrad`` |
| ``jacobians`` | ``SqrtGGNExact`` of ``MSELoss(reduction="sum")`` (whose square-root factor is ``√2 I``): every sample's Jacobian in one batched backward pass; with ``enable_backprop=True``, laplace's differentiable ``torch.func`` Jacobians |

Options, as laplace-torch passes them (``backend_kwargs`` to the constructor,
``asdl_fisher_kwargs`` and ``N`` to the methods) are honoured or refused with a
:class:`curvlib.CurvatureError` naming them: ``mc_samples`` (Monte-Carlo
Fisher only; 1 otherwise, as curvlinops' KFAC), ``kfac_approx`` (``kron``;
``"expand"``/``"reduce"`` as curvlinops defines them; see
:meth:`CurvlibInterface._kron_options`); unknown keywords are refused.

The model gets the input as one argument: a tensor, or a mapping or tuple of
tensors with the batch in dim 0. Classification takes logits ``[N, C]`` with
class-index targets ``[N]`` or class probabilities ``[N, C]``.
"""

try:
    import laplace  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised only without laplace-torch
    raise ImportError(
        "curvlib.laplace needs laplace-torch 0.3. Install it without letting pip replace "
        "your torch: pip install --no-deps laplace-torch==0.3 asdfghjkl==0.1a4 "
        "backpack-for-pytorch==1.7.1 unfoldNd curvlinops-for-pytorch==3.0.1 einconv "
        "linear_operator torchmetrics lightning-utilities einops && pip install scipy tqdm"
    ) from err

from ._backends import CurvlibEF, CurvlibGGN
from ._interface import CurvlibInterface

__all__ = ["CurvlibGGN", "CurvlibEF", "CurvlibInterface"]
