"""Linear operators on a model's parameters: the shape, ``@``, the SciPy and the dense forms.

A :class:`CurvatureOperator` ``A`` is a matrix ``[rows, cols]`` that is never formed: ``A @ v``
multiplies. Parameter space is flat: the parameters of a :class:`ParameterSpace`, in its
order, each flattened row-major, concatenated (``P = Σ_p numel(p)``). ``A @ x`` takes

* a tensor ``[cols]`` (one vector) or ``[cols, K]`` (``K`` vectors, multiplied together),
* or, on parameter space, a dict parameter name -> ``[*p.shape]`` (one vector) or
  ``[K, *p.shape]`` (``K`` vectors), and then returns a dict of the same layout,

and is differentiable and ``torch.func.vmap``-able in ``x``. ``A.to_scipy()`` is a
``scipy.sparse.linalg.LinearOperator`` (float64 NumPy in and out) and ``A.to_dense()`` the
``[rows, cols]`` matrix, for small models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple, Union

import numpy as np
import scipy.sparse.linalg
import torch
from torch import Tensor

from .._core.errors import CurvatureError, CurvatureTypeError

__all__ = ["ParameterSpace", "CurvatureOperator", "Vectors"]

Vectors = Union[Tensor, Mapping[str, Tensor]]


@dataclass(frozen=True)
class ParameterSpace:
    """Named parameters, each flattened row-major and concatenated in ``names`` order.

    Attributes:
        names: the parameters' names, in order.
        shapes: their shapes (``torch.Size``), in the same order.
        dtype: the dtype of the parameters.
        device: their device.

    Examples::

        >>> import torch
        >>> from curvlib.operators import ParameterSpace
        >>> space = ParameterSpace.of({"w": torch.zeros(2, 3), "b": torch.zeros(2)})
        >>> space.dim, space.offsets()["b"]
        (8, slice(6, 8, None))
        >>> space.unflatten(torch.arange(8.0))["w"]
        tensor([[0., 1., 2.],
                [3., 4., 5.]])
    """

    names: Tuple[str, ...]
    shapes: Tuple[torch.Size, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, tensors: Mapping[str, Tensor]) -> "ParameterSpace":
        first = next(iter(tensors.values()))
        return cls(tuple(tensors), tuple(t.shape for t in tensors.values()), first.dtype, first.device)

    @property
    def sizes(self) -> Tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def dim(self) -> int:
        return sum(self.sizes)

    def offsets(self) -> Dict[str, slice]:
        """Parameter name -> its slice of the flat vector.

        Returns:
            dict: parameter name -> ``slice`` of the flat vector.
        """
        out, start = {}, 0
        for name, size in zip(self.names, self.sizes):
            out[name] = slice(start, start + size)
            start += size
        return out

    def flatten(self, tensors: Mapping[str, Tensor]) -> Tensor:
        """``{name: [*p]}`` -> ``[P]``, ``{name: [K, *p]}`` -> ``[P, K]``.

        Args:
            tensors: one tensor per parameter of the space (any order), each ``p.shape`` (one
                vector) or ``[K, *p.shape]`` with the same ``K`` (``K`` vectors).

        Returns:
            Tensor: ``[P]`` or ``[P, K]``, the entries in ``names`` order, each flattened row-major.

        Raises:
            CurvatureError: a missing or unknown name, or an entry of the wrong shape.
        """
        if set(tensors) != set(self.names):
            missing, extra = set(self.names) - set(tensors), set(tensors) - set(self.names)
            raise CurvatureError(
                f"The vectors' dict must have one entry per parameter of the operator {list(self.names)[:6]}"
                + (f"; missing {sorted(missing)[:4]}" if missing else "") + (f"; unknown {sorted(extra)[:4]}" if extra else "") + ".")
        leading = _leading_dims(self, tensors)
        if leading is None:
            return torch.cat([tensors[n].reshape(-1) for n in self.names])
        return torch.cat([tensors[n].reshape(leading, -1) for n in self.names], dim=1).T

    def flatten_emptying(self, tensors: Dict[str, Tensor]) -> Tensor:
        """:meth:`flatten`, taking each entry out of ``tensors`` once it is copied: an entry nothing
        else holds is freed as the result fills, so its memory and the result's written pages are
        not all held at once (``torch.cat`` holds every input until the end). As :meth:`flatten`
        where an entry requires grad or the entries' dtypes or devices differ.

        :meta private:
        """
        first = next(iter(tensors.values()), None)
        if set(tensors) != set(self.names) or any(
                t.requires_grad or t.dtype != first.dtype or t.device != first.device for t in tensors.values()):
            return self.flatten(tensors)
        leading = _leading_dims(self, tensors)
        out = first.new_empty((1 if leading is None else leading, self.dim))
        for name, where in self.offsets().items():
            out[:, where].copy_(tensors.pop(name).reshape(out.shape[0], -1))
        return out[0] if leading is None else out.T

    def unflatten(self, flat: Tensor) -> Dict[str, Tensor]:
        """``[P]`` -> ``{name: [*p]}``, ``[P, K]`` -> ``{name: [K, *p]}``.

        Args:
            flat: ``[P]`` or ``[P, K]``.

        Returns:
            dict: parameter name -> its entries of ``flat``, ``p.shape`` (or ``[K, *p.shape]``).
        """
        parts = torch.split(flat, self.sizes, dim=0)
        if flat.dim() == 1:
            return {n: t.reshape(s) for n, s, t in zip(self.names, self.shapes, parts)}
        return {n: t.T.reshape((flat.shape[1],) + tuple(s)) for n, s, t in zip(self.names, self.shapes, parts)}


def _leading_dims(space: ParameterSpace, tensors: Mapping[str, Tensor]) -> Optional[int]:
    """``None`` if every entry has its parameter's shape, else the common ``K`` of ``[K, *p]``."""
    for name, value in tensors.items():
        if not isinstance(value, Tensor):
            raise CurvatureTypeError(f"The vectors' entry {name!r} must be a tensor, got {type(value).__name__}.")
    if all(tuple(tensors[n].shape) == tuple(s) for n, s in zip(space.names, space.shapes)):
        return None
    ks = {tensors[n].shape[0] if tensors[n].dim() == len(s) + 1 and tuple(tensors[n].shape[1:]) == tuple(s) else None
          for n, s in zip(space.names, space.shapes)}
    if len(ks) != 1 or None in ks:
        bad = next(n for n, s in zip(space.names, space.shapes)
                   if tuple(tensors[n].shape) not in (tuple(s),) and tuple(tensors[n].shape[1:]) != tuple(s))
        raise CurvatureError(
            f"The vectors' entry {bad!r} has shape {tuple(tensors[bad].shape)}: every entry must have its "
            f"parameter's shape (one vector) or [K, *shape] with one K for all (K vectors); parameter "
            f"{bad!r} has shape {tuple(space.shapes[space.names.index(bad)])}.")
    return ks.pop()


class CurvatureOperator:
    """A linear map ``[rows, cols]`` applied by ``matmat`` (module doc): ``A @ x`` on ``[cols]``,
    ``[cols, K]`` or a dict over ``domain``; ``to_dense()``; ``to_scipy()``; ``A.T``.

    Subclasses set ``domain`` (the parameter space of the columns, or ``None`` for a plain
    flat space), ``codomain`` likewise for the rows, and implement ``matmat``.

    Args:
        rows: the number of rows.
        cols: the number of columns (the length of the vectors it multiplies).
        dtype: the dtype of the vectors it multiplies and returns.
        device: their device (a ``torch.device`` or its name).
        domain: the parameter space of the columns (dict vectors are flattened over it), or
            None for flat vectors only.
        codomain: the parameter space of the rows (products of dict vectors are unflattened
            over it), or None.

    Examples::

        >>> import torch
        >>> from curvlib.operators import CurvatureOperator
        >>> class Twice(CurvatureOperator):
        ...     def matmat(self, M):
        ...         return 2 * M
        >>> A = Twice(3, 3, torch.float32, "cpu")
        >>> A @ torch.ones(3)
        tensor([2., 2., 2.])
        >>> A.to_scipy().matvec([1.0, 0.0, 0.0])
        array([2., 0., 0.])
    """

    #: whether $A = A^\top$ (curvature matrices are; the Jacobian is not)
    symmetric: bool = True

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device,
                 domain: Optional[ParameterSpace] = None, codomain: Optional[ParameterSpace] = None):
        self.shape = (int(rows), int(cols))
        self.dtype, self.device = dtype, torch.device(device)
        self.domain, self.codomain = domain, codomain

    def matmat(self, M: Tensor) -> Tensor:
        """``A M`` for ``M [cols, K]`` (checked): ``[rows, K]``.

        Subclasses implement it; ``A @ x`` checks ``x`` and calls it.

        Args:
            M: ``[cols, K]``, of the operator's dtype and device.

        Returns:
            Tensor: ``[rows, K]``.
        """
        raise NotImplementedError

    @property
    def T(self) -> "CurvatureOperator":
        r"""$A^\top$ (``A`` itself when symmetric)."""
        if self.symmetric:
            return self
        raise CurvatureError(f"{type(self).__name__} has no transpose.")

    def __matmul__(self, x: Vectors) -> Vectors:
        as_dict = isinstance(x, Mapping)
        if as_dict:
            if self.domain is None:
                raise CurvatureTypeError(f"{type(self).__name__} acts on flat vectors [{self.shape[1]}], not a dict.")
            x = self.domain.flatten(x)
        M = self._checked(x)
        out = self.matmat(M if x.dim() == 2 else M.unsqueeze(1))
        out = out if x.dim() == 2 else out.squeeze(1)
        if as_dict and self.codomain is not None:
            return self.codomain.unflatten(out)
        return out

    def _checked(self, x) -> Tensor:
        if not isinstance(x, Tensor):
            raise CurvatureTypeError(f"{type(self).__name__} @ x: x must be a tensor or a dict of tensors, got {type(x).__name__}.")
        if x.dim() not in (1, 2) or x.shape[0] != self.shape[1]:
            raise CurvatureError(
                f"{type(self).__name__} @ x: x must have shape [{self.shape[1]}] or [{self.shape[1]}, K] "
                f"(the operator is {self.shape[0]} x {self.shape[1]}), got {tuple(x.shape)}.")
        if x.dtype != self.dtype or x.device != self.device:
            raise CurvatureTypeError(
                f"{type(self).__name__} @ x: x must be {self.dtype} on {self.device} like the operator, got "
                f"{x.dtype} on {x.device}: convert it with x.to(dtype={self.dtype}, device='{self.device}').")
        return x

    def to_dense(self, chunk: int = 64) -> Tensor:
        """The matrix ``[rows, cols]``, ``chunk`` columns at a time.

        Args:
            chunk: columns multiplied at once (memory grows with it).

        Returns:
            Tensor: ``[rows, cols]``.
        """
        cols = []
        for start in range(0, self.shape[1], chunk):
            stop = min(start + chunk, self.shape[1])
            eye = torch.zeros(self.shape[1], stop - start, dtype=self.dtype, device=self.device)
            eye[torch.arange(start, stop), torch.arange(stop - start)] = 1
            cols.append(self.matmat(eye))
        return torch.cat(cols, dim=1)

    def to_scipy(self) -> scipy.sparse.linalg.LinearOperator:
        """A ``scipy.sparse.linalg.LinearOperator`` of float64 NumPy arrays (for ``eigsh``, ``cg``, ...).

        Returns:
            scipy.sparse.linalg.LinearOperator: float64 in and out, applied by ``matmat``.
        """
        def apply(op: "CurvatureOperator", M: np.ndarray) -> np.ndarray:
            t = torch.as_tensor(np.asarray(M), device=op.device).to(op.dtype)
            t = t.reshape(op.shape[1], -1)
            return op.matmat(t).detach().cpu().to(torch.float64).numpy()

        transpose = self.T if self.symmetric or type(self).T is not CurvatureOperator.T else None
        return scipy.sparse.linalg.LinearOperator(
            self.shape, dtype=np.float64,
            matvec=lambda v: apply(self, v).reshape(-1), matmat=lambda M: apply(self, M),
            rmatvec=None if transpose is None else (lambda v: apply(transpose, v).reshape(-1)),
            rmatmat=None if transpose is None else (lambda M: apply(transpose, M)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.shape[0]} x {self.shape[1]}, {self.dtype}, {self.device})"
