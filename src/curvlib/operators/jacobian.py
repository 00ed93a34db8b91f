"""The model's Jacobian ``J = ∂f/∂θ`` as an operator ``[R, P]`` and its transpose ``[P, R]``.

Rows are the model outputs (the tensor the loss takes) of every sample, flattened row-major
per batch, batches in the data's order: ``R = Σ_b numel(f(X_b))``. ``J @ v`` is one
Jacobian-vector product per batch (forward mode), ``J.T @ u`` one vector-Jacobian product.
"""

from __future__ import annotations

from typing import List

import torch
from torch import Tensor

from .._evaluate.products import guarded
from .._transform.network import translated
from . import plain
from .base import CurvatureOperator
from .network import NetworkOperator

__all__ = ["Jacobian", "TransposedJacobian"]


class Jacobian(NetworkOperator):
    r"""Jacobian(model, lossfn, data, params=None, buffers=None, output=None, generator=None, chunk_size=16)

    The model's Jacobian $J = \partial f / \partial \theta$, ``[R, P]`` with ``R`` the outputs of all samples, each
    batch's flattened row-major, batches in order. ``J.T`` is its transpose.

    Args:
        model: any module ``curvature`` takes (wrapped or not, container outputs).
        lossfn: the loss, as for ``curvature`` (with the targets, it only defines the batches).
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
        >>> from curvlib.operators import Jacobian
        >>> model = nn.Sequential(nn.Linear(3, 2))
        >>> X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> J = Jacobian(model, nn.CrossEntropyLoss(), (X, y))
        >>> J.shape, J.T.shape                                        # 5 samples x 2 outputs, 8 parameters
        ((10, 8), (8, 10))
        >>> (J.T @ torch.ones(10)).shape
        torch.Size([8])
    """

    symmetric = False

    def __init__(self, *args, **kwargs):
        self.rows: List[int] = []
        super().__init__(*args, **kwargs)
        self.codomain = None

    def _shape(self, space):
        with torch.no_grad():
            self.rows = [int(batch.output({}).numel()) for _, _, batch in self.data]
        return sum(self.rows), space.dim

    def block_shape(self, space):
        return sum(self.rows), space.dim

    def _chunk(self, M: Tensor) -> Tensor:
        V = self.domain.unflatten(M)
        parts = []
        for _, _, batch in self.data:
            theta = {n: batch.values[n] for n in V}
            jv = translated(self.network.model, lambda: self.jacobian_products(batch, theta, V))  # noqa: B023
            parts.append(jv.reshape(jv.shape[0], -1).T)
        return torch.cat(parts, dim=0)

    @property
    def T(self) -> "TransposedJacobian":
        return TransposedJacobian(self)


class TransposedJacobian(CurvatureOperator):
    r"""$J^\top\ [P, R]$ of a ``Jacobian``: $J^\top u = \sum_b J_b^\top u_b$, one vector-Jacobian product per batch.

    Args:
        jacobian: the ``Jacobian`` it transposes (``J.T`` makes it).

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib.operators import Jacobian
        >>> model = nn.Sequential(nn.Linear(3, 2))
        >>> X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> J = Jacobian(model, nn.CrossEntropyLoss(), (X, y))
        >>> torch.allclose(J.T.to_dense(), J.to_dense().T)
        True
    """

    symmetric = False

    def __init__(self, jacobian: Jacobian):
        rows, cols = jacobian.shape
        super().__init__(cols, rows, jacobian.dtype, jacobian.device, domain=None, codomain=jacobian.domain)
        self.jacobian = jacobian
        self._guarded = guarded(self._product, "Jacobian.T")

    @property
    def T(self) -> Jacobian:
        return self.jacobian

    def matmat(self, M: Tensor) -> Tensor:
        return self._guarded(M)

    def _product(self, M: Tensor) -> Tensor:
        jac, space = self.jacobian, self.jacobian.domain
        total = M.new_zeros(space.dim, M.shape[1])
        start = 0
        for (_, _, batch), rows in zip(jac.data, jac.rows):
            theta = {n: batch.values[n] for n in space.names}
            block = M[start:start + rows]
            start += rows

            def pulled(batch=batch, theta=theta, block=block):
                out, pull = torch.func.vjp(batch.output, theta)
                cot = block.T.reshape((block.shape[1],) + tuple(out.shape))
                return torch.func.vmap(lambda c: pull(c)[0], randomness="same")(cot)

            def by_autograd(batch=batch, block=block):
                return plain.transposed_products(batch, space.names, block.T)

            total = total + space.flatten(translated(jac.network.model, lambda: jac.with_fallback(pulled, by_autograd)))
        return total
