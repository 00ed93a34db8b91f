"""The demo's problem and its brute-force references (see :mod:`curvlib._demo.main`).

:func:`problem` builds the seeded float64 CNN; :class:`Reference` computes,
lazily and cached, every quantity an extension is checked against with plain
autograd / :mod:`torch.func`: individual gradients ``g_n = c ∇_θ ℓ_n``
(``c = 1/N`` for ``"mean"``), Hessians ``H`` and ``H_n``, GGNs
``G = Jᵀ (∇²_f L) J`` and ``G_n``; :class:`Gram` checks a square root ``S``
through ``SᵀS``. :data:`REFERENCES` maps a result name to its reference.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, hessian, jacrev, vmap

__all__ = ["Gram", "REFERENCES", "Reference", "problem"]


# --------------------------------------------------------------------------- problem


def problem(n: int = 8, seed: int = 0) -> Tuple[nn.Module, nn.Module, Tensor, Tensor]:
    """Tiny CNN on ``[N, 1, 6, 6]`` inputs with 3 classes, float64, seeded."""
    gen = torch.Generator().manual_seed(seed)
    # built on CPU whatever the default device (the same numbers everywhere), placed by the caller
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(seed)
        model = nn.Sequential(
            OrderedDict(
                conv=nn.Conv2d(1, 3, 3),
                relu=nn.ReLU(),
                pool=nn.MaxPool2d(2),
                flatten=nn.Flatten(),
                fc=nn.Linear(3 * 2 * 2, 3),
            )
        ).double()
    X = torch.randn(n, 1, 6, 6, generator=gen, dtype=torch.float64, device="cpu")
    y = torch.randint(0, 3, (n,), generator=gen, device="cpu")
    return model, nn.CrossEntropyLoss(), X, y


# --------------------------------------------------------------------------- references


class Reference:
    """Brute-force quantities of one problem, computed lazily and cached.

    Attributes:
        names: trainable parameter names, in the model's order.
        shapes: their shapes; ``P`` is the sum of their sizes.
    """

    def __init__(self, model: nn.Module, lossfn: nn.Module, X: Tensor, y: Tensor):
        self.model, self.lossfn, self.X, self.y = model, lossfn, X, y
        self.params = {n: p.detach() for n, p in model.named_parameters()}
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.shapes = [self.params[n].shape for n in self.names]
        self.sizes = [self.params[n].numel() for n in self.names]
        self._cache: Dict[str, object] = {}

    # helpers ------------------------------------------------------------

    def _cached(self, key: str, make: Callable[[], object]):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def _unflatten(self, theta: Tensor) -> Dict[str, Tensor]:
        return {**self.params, **dict(zip(self.names, (t.view(s) for t, s in zip(theta.split(self.sizes), self.shapes))))}

    def _theta(self) -> Tensor:
        return torch.cat([self.params[n].flatten() for n in self.names])

    def _blocks(self, flat: Tensor) -> Dict[str, Tensor]:
        """``[..., P] -> {name: [..., *p.shape]}``."""
        lead = flat.shape[:-1]
        return {n: t.reshape(*lead, *s) for n, t, s in zip(self.names, flat.split(self.sizes, -1), self.shapes)}

    def _diag_blocks(self, mat: Tensor) -> Dict[str, Tensor]:
        """Block diagonals of ``[..., P, P]`` as ``{name: [..., *p.shape]}``."""
        return self._blocks(torch.diagonal(mat, dim1=-2, dim2=-1))

    def _block_grams(self, mat: Tensor) -> Dict[str, "Gram"]:
        """``{name: Gram(M_pp)}`` for the diagonal blocks of ``[P, P]``."""
        out, start = {}, 0
        for n, size in zip(self.names, self.sizes):
            out[n] = Gram(mat[start : start + size, start : start + size])
            start += size
        return out

    def _block_products(self, mat: Tensor) -> Dict[str, Callable[[Tensor], Tensor]]:
        """``{name: V ↦ V · M_pp}`` for the diagonal blocks of a symmetric ``[P, P]``."""
        out, start = {}, 0
        for n, size, shape in zip(self.names, self.sizes, self.shapes):
            block = mat[start : start + size, start : start + size]
            out[n] = lambda V, block=block, shape=shape: (V.flatten(1) @ block).reshape(V.shape[0], *shape)
            start += size
        return out

    @property
    def scale(self) -> float:
        """The reduction factor ``c`` of one sample's loss (``1/N`` for ``"mean"``)."""
        return 1.0 / self.X.shape[0] if self.lossfn.reduction == "mean" else 1.0

    # first order ----------------------------------------------------------

    def grad(self) -> Dict[str, Tensor]:
        """Autograd's gradient of ``lossfn(model(X), y)``."""

        def make():
            ps = [p for n, p in self.model.named_parameters() if n in self.names]
            gs = torch.autograd.grad(self.lossfn(self.model(self.X), self.y), ps)
            return dict(zip(self.names, gs))

        return self._cached("grad", make)

    def grad_batch(self) -> Dict[str, Tensor]:
        """``g_n = c ∇_θ ℓ_n`` by ``vmap(grad)`` over samples, ``[N, *p.shape]``."""

        def make():
            def loss_one(trainable, x, t):
                out = functional_call(self.model, {**self.params, **trainable}, (x.unsqueeze(0),))
                return self.lossfn(out, t.unsqueeze(0)) * self.scale

            trainable = {n: self.params[n] for n in self.names}
            return vmap(grad(loss_one), in_dims=(None, 0, 0))(trainable, self.X, self.y)

        return self._cached("grad_batch", make)

    # second order ---------------------------------------------------------

    def hessian(self) -> Tensor:
        """``∇²_θ L`` of the batch loss, ``[P, P]``."""

        def make():
            def loss(theta):
                return self.lossfn(functional_call(self.model, self._unflatten(theta), (self.X,)), self.y)

            return hessian(loss)(self._theta())

        return self._cached("hessian", make)

    def hessian_batch(self) -> Tensor:
        """``H_n = ∇²_θ (c·ℓ_n)``, ``[N, P, P]``; they sum to :meth:`hessian`."""

        def make():
            def loss_one(theta, x, t):
                out = functional_call(self.model, self._unflatten(theta), (x.unsqueeze(0),))
                return self.lossfn(out, t.unsqueeze(0)) * self.scale

            theta = self._theta()
            return torch.stack([hessian(loss_one)(theta, x, t) for x, t in zip(self.X, self.y)])

        return self._cached("hessian_batch", make)

    def _jacobian_and_output_hessian(self) -> Tuple[Tensor, Tensor]:
        """``J = ∂f/∂θ`` ``[N, K, P]`` and ``∇²_f L`` ``[N, K, N, K]`` (``K`` outputs per sample)."""

        def make():
            theta = self._theta()
            out = functional_call(self.model, self.params, (self.X,)).detach()
            J = jacrev(lambda th: functional_call(self.model, self._unflatten(th), (self.X,)))(theta)
            H = hessian(lambda o: self.lossfn(o, self.y))(out)
            n = out.shape[0]
            k = out[0].numel()
            return J.reshape(n, k, -1), H.reshape(n, k, n, k)

        return self._cached("ggn_pieces", make)

    def ggn(self) -> Tensor:
        """``G = Jᵀ (∇²_f L) J``, ``[P, P]``."""
        J, H = self._jacobian_and_output_hessian()
        return torch.einsum("nkp,nkml,mlq->pq", J, H, J)

    def ggn_batch(self) -> Tensor:
        """``G_n = J_nᵀ (∇²_{f_n} L) J_n``, ``[N, P, P]``; they sum to :meth:`ggn`."""
        J, H = self._jacobian_and_output_hessian()
        return torch.einsum("nkp,nknl,nlq->npq", J, H, J)


class Gram:
    """Expected value of a matrix square root ``S`` ``[V, N, *p.shape]``, known only up to rotation.

    ``S`` is checked through ``Σ_{v,n} S[v,n] S[v,n]ᵀ`` (flattened over
    ``p``), which must equal the block ``M_pp``.
    """

    def __init__(self, block: Tensor):
        self.block = block

    def deviation(self, value: object) -> float:
        if not isinstance(value, Tensor) or value[0, 0].numel() != self.block.shape[0]:
            return float("inf")
        S = value.flatten(2).flatten(0, 1)
        return (S.T @ S - self.block).abs().max().item()


def _first(q: Callable[[Dict[str, Tensor]], Dict[str, Tensor]]):
    return lambda ref: q(ref.grad_batch())


# Result name -> reference (``None``: no deterministic reference, unchecked).
REFERENCES: Dict[str, Optional[Callable[[Reference], Dict[str, object]]]] = {
    "grad_batch": _first(lambda gb: dict(gb)),
    "batch_l2": _first(lambda gb: {k: (v**2).flatten(1).sum(1) for k, v in gb.items()}),
    "sum_grad_squared": _first(lambda gb: {k: (v**2).sum(0) for k, v in gb.items()}),
    "variance": _first(
        lambda gb: {k: (v**2).mean(0) - v.mean(0) ** 2 for k, v in gb.items()}
    ),
    "diag_ggn_exact": lambda ref: ref._diag_blocks(ref.ggn()),
    "diag_ggn_exact_batch": lambda ref: ref._diag_blocks(ref.ggn_batch()),
    "diag_h": lambda ref: ref._diag_blocks(ref.hessian()),
    "diag_h_batch": lambda ref: ref._diag_blocks(ref.hessian_batch()),
    "ggnmp": lambda ref: ref._block_products(ref.ggn()),
    "hmp": lambda ref: ref._block_products(ref.hessian()),
    # The demo's only nonlinearities are ReLU and max-pooling (f'' = 0) and
    # the cross-entropy Hessian is positive semi-definite, so here the
    # positive-curvature Hessian equals the GGN. Revisit if the problem changes.
    "pchmp": lambda ref: ref._block_products(ref.ggn()),
    "sqrt_ggn_exact": lambda ref: ref._block_grams(ref.ggn()),
    # Monte-Carlo estimates and Kronecker factors: no exact reference here.
    "diag_ggn_mc": None,
    "diag_ggn_mc_batch": None,
    "sqrt_ggn_mc": None,  # Monte-Carlo
    "kfac": None,
    "kflr": None,
    "kfra": None,
}
