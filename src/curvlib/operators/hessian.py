"""The whole network's Hessian ``∇²_θ L`` as an operator (:mod:`curvlib.operators.network`'s
arguments and data), by reverse-over-forward or forward-over-reverse autodiff where torch has
forward mode."""

from __future__ import annotations

from typing import List

import torch

from .._core.errors import CurvatureError
from .._core.inputs import slice_batch
from .._core.reverse import check_symmetric, missing_forward_mode_reason
from .._core.tensors import is_wrapped
from .._evaluate.products import loss_lacks_forward_mode
from .._transform.network import lacks_forward_mode
from . import plain
from .network import NetworkOperator, over_vectors

__all__ = ["Hessian"]


class Hessian(NetworkOperator):
    r"""The Hessian $\nabla_\theta^2 L$ (module doc). One vector's product goes reverse over forward, the
    gradient of the loss's derivative along it (the leanest in memory), where a probe on two
    samples finds it equal to forward over reverse; otherwise, and for several vectors at once, by
    forward-over-reverse autodiff (a Jacobian-vector product of the gradient, vmapped over the
    vectors); its diagonal is ``DiagHessian``. Where torch has no forward-mode
    derivative of the loss's backward (``MSELoss(reduction="mean")`` in torch 2.13 meets an
    immutable zero tensor; ``huber_loss_backward`` has none), reverse-over-reverse: the Hessian is
    symmetric, so $H v = (v^\top H)^\top$, a vector-Jacobian product of the gradient. Where a model
    operation has no forward-mode derivative (grouped expert matmuls, ``weight_norm``'s kernel),
    reverse-over-reverse too, once its products pass a symmetry check on the first batch,
    $|u^\top (H w) - w^\top (H u)| \le \sqrt{\varepsilon}\, (\lVert u \rVert \lVert H w \rVert + \lVert w \rVert \lVert H u \rVert)$ for random ``u, w``: torch's reverse-mode
    second derivative of such a kernel can be wrong (``weight_norm``'s is, in torch 2.13, and is
    refused so).

    Args:
        model: any module ``curvature`` takes (wrapped or not, container outputs).
        lossfn: the loss, as for ``curvature``.
        data: ``(X, y)``, or a re-iterable loader of such pairs (the same batches every pass).
        params: parameter name -> tensor: these values, and the operator acts on exactly these
            parameters; default (None): the model's, acting on every ``requires_grad`` one.
        buffers: buffer name -> tensor, replacing the model's (as for ``curvature``).
        output: the tensor of a container output the loss takes (as for ``curvature``).
        generator: draws the dropout masks of a model in training mode (one per batch, fixed
            for the operator's lifetime).
        chunk_size: vectors multiplied at once by ``A @ M`` (memory grows with it).

    Raises:
        CurvatureTypeError: an argument of the wrong type (``data`` a one-pass iterator).
        CurvatureError: anything ``curvature`` refuses for this model and loss, no parameter to act
            on, a loader whose batches change between passes, a bad ``chunk_size``.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib.operators import Hessian, lanczos
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
        >>> X, y = torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 2, (8,))
        >>> H = Hessian(model, nn.CrossEntropyLoss(), (X, y))
        >>> top = lanczos(H, k=1).values[0]
        >>> bool(torch.isclose(top, torch.linalg.eigvalsh(H.to_dense())[-1]))
        True
    """

    #: whether reverse-over-reverse products must pass the symmetry check first (a model
    #: operation without forward mode), and whether they have
    needs_symmetry, symmetric_checked = False, False

    #: whether one vector's product goes reverse over forward (:func:`plain.hessian_products_over_forward`):
    #: ``None`` until :meth:`_over_forward_agrees` has compared the two ways on this model
    over_forward = None

    def batch_product(self, batch, seeds, V):
        if self._one_vector(V) and self.forward_mode and not self.plain and self._over_forward_agrees(batch):
            try:
                return plain.hessian_products_over_forward(batch, V)
            except (RuntimeError, NotImplementedError, CurvatureError) as exc:
                if isinstance(exc, CurvatureError) and not lacks_forward_mode(exc):
                    raise
                self.over_forward = False  # (an operation without it: the routes below, from now on)
        return self.with_fallback(lambda: self._functorch_product(batch, V), lambda: self._plain_product(batch, V))

    @staticmethod
    def _one_vector(V) -> bool:
        """One plain vector: reverse over forward loops over vectors, cannot run under ``vmap`` and
        returns ``H v`` without a graph back to ``v``."""
        return (next(iter(V.values())).shape[0] == 1
                and not any(is_wrapped(v) or v.requires_grad for v in V.values()))

    def _over_forward_agrees(self, batch) -> bool:
        """Whether reverse over forward gives this model's Hessian products, decided once: on the
        batch's first two samples, for one random vector ``v`` supported on the probe's parameters
        ``S`` (:func:`_probe_names`), ``(H v)_S = H_SS v_S`` must match forward over reverse to
        ``√ε`` of its scale. torch gets some operations' forward-mode derivatives wrong when they
        are differentiated again (layer_norm's, composed here), which only a comparison shows; any
        failure of the probe keeps forward over reverse. Restricted to ``S``, neither way forms a
        tensor the size of all parameters (forward over reverse would form the gradient and its
        tangent)."""
        if self.over_forward is None:
            self.over_forward = False
            try:
                k = min(2, batch.size)
                probe = self.network.batch(slice_batch(batch.call.X, 0, k), slice_batch(batch.call.y, 0, k),
                                           {n: batch.values[n] for n in batch.trainable}, batch.call.buffers)
                gen = torch.Generator(device=self.device).manual_seed(0)
                V = {n: torch.randn((1,) + tuple(batch.values[n].shape), generator=gen, dtype=batch.values[n].dtype,
                                    device=self.device) for n in _probe_names(batch)}
                want = self._functorch_product(probe, V)
                got = plain.hessian_products_over_forward(probe, V)
                scale = max(float(w.abs().max()) for w in want.values())
                gap = max(float((got[n] - want[n]).abs().max()) for n in want)
                self.over_forward = gap <= torch.finfo(self.dtype).eps ** 0.5 * max(scale, 1e-30)
            except Exception:  # noqa: BLE001 - a probe that cannot run decides nothing: forward over reverse
                self.over_forward = False
        return self.over_forward

    def _plain_product(self, batch, V):
        hv, product, functions = plain.hessian_products(batch, V)
        if not self.symmetric_checked:  # (reverse over reverse through the model's own backward)
            named = ", ".join(functions) or "a custom autograd.Function"
            check_symmetric(product, {n: batch.values[n] for n in V}, "Hessian",
                            f"torch.func cannot transform a custom autograd.Function of the model ({named}), so "
                            "its products run on plain autograd, reverse over reverse, through its own "
                            "backward.",
                            known="a backward that is not its forward's exact derivative (a surrogate gradient) "
                                  "gives such products",
                            advice=f"Use the GGN quantities for this model (they take the backward of {named} as its "
                                   "Jacobian), or give it a backward that is its forward's derivative.")
            self.symmetric_checked = True
        return hv

    def _functorch_product(self, batch, V):
        theta = {n: batch.values[n] for n in V}
        gradient = torch.func.grad(lambda th: batch.loss(batch.output(th)))
        if self.forward_mode:
            try:
                return over_vectors(lambda v: torch.func.jvp(gradient, (theta,), (v,))[1], V)
            except (RuntimeError, NotImplementedError) as exc:  # (the model's own are CurvatureErrors)
                if not loss_lacks_forward_mode(exc):
                    raise
            except CurvatureError as exc:
                if not lacks_forward_mode(exc):
                    raise
                self.needs_symmetry = True
                inner = exc
                while inner.__cause__ is not None:  # (torch's own error, under curvlib's)
                    inner = inner.__cause__
                self.reverse_reason = missing_forward_mode_reason(inner) + " The products go reverse over reverse."
            self.forward_mode = False
        _, pull = torch.func.vjp(gradient, theta)
        if self.needs_symmetry and not self.symmetric_checked:
            self._check_symmetric(lambda u: pull(u)[0], theta, self.reverse_reason)
        return over_vectors(lambda v: pull(v)[0], V)

    def _check_symmetric(self, product, theta, reason: str) -> None:
        """Refuse reverse-mode second derivatives that are not symmetric (class doc), once."""
        check_symmetric(product, theta, "Hessian", reason)
        self.symmetric_checked = True


def _probe_names(batch) -> List[str]:
    """The parameters ``S`` the probe of :meth:`Hessian._over_forward_agrees` acts on: the smallest
    tensors, in ascending size, while their total stays within an eighth of all parameters' (at
    least the smallest one). Those are the biases and norms' scales, one or more per layer, whose
    tangents pass forward through every operation after them and whose gradients pull back through
    every one before: the probe's vectors, gradient and tangent hold ``|S|`` numbers each, at most
    ``P/8`` unless the smallest tensor alone is larger."""
    names = sorted(batch.trainable, key=lambda n: batch.values[n].numel())  # (stable: model order among equals)
    budget = sum(batch.values[n].numel() for n in names) / 8
    chosen, total = [], 0
    for n in names:
        total += batch.values[n].numel()
        if chosen and total > budget:
            break
        chosen.append(n)
    return chosen
