"""One time step of ``nn.RNN``/``nn.LSTM``/``nn.GRU``, with its nonlinear nodes.

The Hessian family needs, for every node ``z = f(u)`` of the unrolled graph
that is not linear, its residual ``R = ∇²_u (g_z · f(u))`` (see
:mod:`curvlib._hessian.residuals`). A step is written here as those nodes, and each is
recorded with :meth:`Recorder.residual` when the Hessian is wanted
(:class:`StepNodes` with a :class:`Coupling`); otherwise the same arithmetic
runs with nothing recorded. Nodes of one step, with ``σ`` the sigmoid
(``"diag"``: element-wise, ``"product"``: ``x ⊙ y``, ``"bilinear"``:
``W x`` whose input depends on ``W``):

* RNN:  ``h = tanh(a + b)`` (diag; ``relu`` is piecewise linear: none);
* LSTM: ``(σ(i), σ(f), tanh(g), σ(o)) = gates(a + b)`` (one diag node),
  ``σ(f) ⊙ c_prev``, ``σ(i) ⊙ tanh(g)`` (products), ``tanh(c)`` (diag),
  ``m = σ(o) ⊙ tanh(c)`` (product), and with ``proj_size`` ``h = W_hr m``;
* GRU:  ``(r, z) = σ(a_rz + b_rz)`` (diag), ``r ⊙ b_n`` (product),
  ``n = tanh(a_n + r ⊙ b_n)`` (diag), ``(1 - z) ⊙ n`` and ``z ⊙ h_prev``
  (products);
* every step: the hidden projection ``b = W_hh h_prev + b_hh`` (bilinear
  where ``h_prev`` depends on ``W_hh``: from the third step on, from the
  second if an initial state is passed, on the first if the initial state
  depends on ``W_hh``); likewise ``h = W_hr m`` (from the second step on).

A node with a factor that depends on nothing (the zero initial state when
the model passes none) is linear and has no residual; the first step's
``r ⊙ b_n`` of a GRU without initial state depends on the parameters only
through ``b_hh``, and is a node only where ``b_hh`` is trainable. These are
the nodes of the same recurrence written out with tensor operations and
traced by ``torch.fx`` (which the tests' brute-force PCHMP uses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from .._core.site import Recorder, ResidualParts, Site


@dataclass(frozen=True)
class Coupling:
    """What the Hessian family needs to know about one call of a recurrent module.

    Attributes:
        x: the module's own trainable parameters (canonical names) on which its
            input sequence depends (a module applied to its own output).
        hx: those on which the initial states depend.
        state_varies: whether the initial states passed depend on the model
            input (else they are constants, or absent: zeros).
    """

    x: frozenset = frozenset()
    hx: frozenset = frozenset()
    state_varies: bool = False


def lstm_gates(pre: Tensor) -> Tensor:
    """``[σ(i), σ(f), tanh(g), σ(o)]`` of ``pre [..., 4H]`` (element-wise, PyTorch's gate order)."""
    i, f, g, o = pre.chunk(4, -1)
    return torch.cat([torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)], -1)


class StepNodes:
    """The nonlinear nodes of one layer and direction, recorded as residuals when wanted.

    Args:
        rec: the forward's recorder.
        where: the module path; nodes are named ``where.l{layer}[r].t{t}.{node}``.
        tag: ``l{layer}`` plus ``r`` for the reverse direction.
        coupling: ``None`` (no Hessian wanted: nothing is recorded) or the call's
            :class:`Coupling`.
    """

    def __init__(self, rec: Recorder, where: str, tag: str, coupling: Optional[Coupling]):
        self.rec, self.where, self.tag, self.coupling = rec, where, tag, coupling
        self.t = 0

    def _name(self, node: str) -> str:
        return f"{self.where}.{self.tag}.t{self.t}.{node}"

    def diag(self, node: str, phi: Callable[[Tensor], Tensor], a: Tensor) -> Tensor:
        """``φ(a)``, element-wise."""
        z = phi(a)
        if self.coupling is None:
            return z
        return self.rec.residual(self._name(node), "diag", phi, [a], z)

    def product(self, node: str, x: Tensor, y: Tensor, varies: bool = True, y_params: frozenset = frozenset()) -> Tensor:
        """``x ⊙ y``; ``varies=False``: ``y`` is a constant (the product is linear);
        ``y_params``: ``y`` depends on these parameters alone (not on the input), as a
        coordinate selection: ``y`` stands for them in ``u`` (PCHMP's views,
        :func:`curvlib._hessian.algebra.positive_curvature`)."""
        z = x * y
        if self.coupling is None or not varies:
            return z
        meta = {"param_taps": {1: frozenset(y_params)}} if y_params else None
        return self.rec.residual(self._name(node), "product", None, [x, y], z, meta=meta)

    def bilinear(self, node: str, site: Site, x: Tensor, z: Tensor, coupled: bool) -> Tensor:
        """``z = W x (+ b)`` of ``site``; ``coupled``: ``x`` depends on the site's weight."""
        if self.coupling is None or not coupled or "weight" not in site.params:
            return z
        return self.rec.residual(self._name(node), "bilinear", None, [x], z, ResidualParts(site=site))


def rnn_step(nodes: StepNodes, mode: str, pre: Tensor) -> Tensor:
    """``h = tanh(pre)`` or ``relu(pre)``."""
    if mode == "RNN_RELU":
        return torch.relu(pre)
    return nodes.diag("tanh", torch.tanh, pre)


def lstm_step(nodes: StepNodes, pre: Tensor, c: Tensor, c_varies: bool) -> Tuple[Tensor, Tensor]:
    """``(m, c_new)`` from ``pre = a + b [N, 4H]`` and ``c [N, H]``."""
    i, f, g, o = nodes.diag("gates", lstm_gates, pre).chunk(4, -1)
    c = nodes.product("f*c", f, c, c_varies) + nodes.product("i*g", i, g)
    return nodes.product("o*tanh(c)", o, nodes.diag("tanh(c)", torch.tanh, c)), c


def gru_step(nodes: StepNodes, a: Tensor, b: Tensor, h: Tensor, h_varies: bool, bn_varies: bool,
             bn_params: frozenset = frozenset()) -> Tensor:
    """``h_new`` from ``a = W_ih x + b_ih``, ``b = W_hh h + b_hh`` ``[N, 3H]`` and ``h [N, H]``.

    ``bn_varies``: ``b_n`` depends on a trainable parameter or on the input;
    ``bn_params``: the first step without initial state, ``b_n = b_hn``: ``b_hh``'s name.
    """
    a_rz, a_n = a.split([2 * h.shape[-1], h.shape[-1]], -1)
    b_rz, b_n = b.split([2 * h.shape[-1], h.shape[-1]], -1)
    r, z = nodes.diag("sigmoid(r,z)", torch.sigmoid, a_rz + b_rz).chunk(2, -1)
    n = nodes.diag("tanh(n)", torch.tanh, a_n + nodes.product("r*b_n", r, b_n, bn_varies, bn_params))
    return nodes.product("(1-z)*n", 1 - z, n) + nodes.product("z*h", z, h, h_varies)
