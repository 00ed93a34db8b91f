"""Recurrent layers (``nn.RNN``, ``nn.LSTM``, ``nn.GRU``) as affine sites.

torch's fused RNN kernels do not run under :func:`torch.func.vmap`, so the
recurrence is unrolled here with plain tensor ops, in batch-first layout
``[N, T, *]`` whatever the module's ``batch_first``. Every parameter of the
module enters through an affine map, and each map is one *linear site* of
:data:`~curvlib.rules.linear.LINEAR` whose weight is shared over the time
steps ``s = t``. For layer ``l`` and direction ``d``:

* input projection, one op on the whole sequence:
  ``a[n, t] = W_ih x[n, t] + b_ih``,  ``x [N, T, I]`` -> ``a [N, T, G·H]``;
* hidden projection, built step by step:
  ``b[n, t] = W_hh h[n, t-1] + b_hh``, saved input ``h_prev [N, T, H_out]``
  (``h[n, -1] = h0[n]``, the initial state passed by the model, or zeros);
* LSTM with ``proj_size > 0`` only: ``h[n, t] = W_hr m[n, t]``, saved input
  ``m [N, T, H]``.

``G`` is the number of gates (1 RNN, 4 LSTM, 3 GRU), ``H`` the hidden size
and ``H_out`` the size of ``h`` (``proj_size`` or ``H``). The step's
nonlinearity, with ``σ`` the sigmoid and gates split in PyTorch's order:

* RNN:  ``h_t = act(a_t + b_t)``, ``act`` ``tanh`` or ``relu``;
* LSTM: ``(i, f, g, o) = chunks(a_t + b_t)``,
  ``c_t = σ(f) ⊙ c_{t-1} + σ(i) ⊙ tanh(g)``, ``m_t = σ(o) ⊙ tanh(c_t)``,
  ``h_t = m_t`` (or ``W_hr m_t``);
* GRU:  ``(a_r, a_z, a_n) = chunks(a_t)``, ``(b_r, b_z, b_n) = chunks(b_t)``,
  ``r = σ(a_r + b_r)``, ``z = σ(a_z + b_z)``, ``n = tanh(a_n + r ⊙ b_n)``,
  ``h_t = (1 - z) ⊙ n + z ⊙ h_{t-1}``.

Because the probe of the hidden projection is added to ``b_t`` at every step,
``g[n, t] = ∂L/∂b[n, t]`` and the linear rule's
``∂ℓ_n/∂W_hh = Σ_t g[n, t] h[n, t-1]ᵀ`` is the exact individual gradient,
including the step from a non-zero initial state ``h0``. Samples never mix,
so every rule of the linear family (norms, squares) applies unchanged.

Kronecker factors (``KFAC``, ``KFLR``, ``KFACEmpirical``) are the linear rule's
(:func:`curvlib.rules.linear.kron`) on these sites: the time steps are the
positions ``s = t`` sharing the weight (Eschenhagen et al., 2023), ``x`` the
site's saved input at step ``t`` (``x_t``, ``h_{t-1}`` with the initial state,
``m_t``) and ``m`` the root pulled back to the site's output at step ``t``
(``W_ih x_t + b_ih``, ``W_hh h_{t-1} + b_hh``, ``W_hr m_t``). For a GRU that is
the root at ``W_hn h + b_hn`` *before* the product with ``r``, not at the
gate's pre-activation: the weight's gradient is ``Σ_t m_t x_tᵀ`` only for the
root at its own output. ``kfac_approx=None``: ``B = Σ_{v,n} (Σ_t m)(Σ_t m)ᵀ``,
``A = (1/N) Σ_{n,t} x xᵀ``; ``"expand"``: ``B = Σ_{v,n,t} m mᵀ``,
``A = (1/(N·T)) Σ_{n,t} x xᵀ``; ``"reduce"``: ``B`` as ``None``,
``A = (1/N) Σ_n x̄ x̄ᵀ`` (``x̄`` the mean over ``t``). KFRA is refused (a loop
over time steps is not a chain of layers: :func:`curvlib._evaluate.kfra.chain_nodes`).

The reverse direction runs ``t = T-1, …, 0``; its sites are indexed by the
true time ``t`` as well. Layers feed the concatenated directions to the next
layer, with ``F.dropout(p=dropout)`` in between in training mode (the forward
that ran is the one differentiated).
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from .._core.calls import argument
from .._core.errors import CurvatureError
from .._core.family import Family
from .._core.site import Recorder, Site
from .linear import LINEAR
from .rnn_steps import Coupling, StepNodes, gru_step, lstm_step, rnn_step

_GATES = {"RNN_TANH": 1, "RNN_RELU": 1, "LSTM": 4, "GRU": 3}


def check(module: nn.RNNBase, where: str) -> None:
    """Refuse recurrent modules whose parameters are not the plain named tensors.

    Raises:
        CurvatureError: unknown ``mode``, or a parameter of the recurrence that
            is not a direct parameter of the module (e.g. under
            ``torch.nn.utils.parametrize``).
    """
    if module.mode not in _GATES:
        raise CurvatureError(
            f"Module '{where}' ({type(module).__name__}) has mode {module.mode!r}; curvlib "
            f"supports the recurrent modes {sorted(_GATES)}."
        )
    own = {name for name, _ in module.named_parameters(recurse=False)}
    missing = [name for name in module._flat_weights_names if name not in own]
    if missing:
        raise CurvatureError(
            f"Module '{where}' ({type(module).__name__}): the weights {missing} are not plain "
            "parameters of the module (parametrized or replaced); curvlib supports recurrent "
            "modules whose weights are their own nn.Parameters."
        )


def _roles(names: Dict[str, str], weight: str, bias: Optional[str]) -> Dict[str, str]:
    """Linear-site roles for the module's parameter names, trainable ones only."""
    out = {}
    if weight in names:
        out["weight"] = names[weight]
    if bias is not None and bias in names:
        out["bias"] = names[bias]
    return out


def _bind(args, kwargs, where: str, rows: bool = False) -> Tuple[Tensor, object]:
    """``(input, hx)`` from the call's arguments; ``rows``: a 4-D input is taken (rows of a
    sample split off a merged batch, :func:`_split_rows`)."""
    x = argument(args, kwargs, 0, "input", None)
    hx = argument(args, kwargs, 1, "hx", None)
    if isinstance(x, PackedSequence):
        raise CurvatureError(
            f"Module '{where}' is called on a PackedSequence; curvlib supports padded "
            "tensor inputs [N, T, I] (batch_first=True) or [T, N, I] only."
        )
    if not isinstance(x, Tensor):
        raise CurvatureError(
            f"Module '{where}' is called with input of type {type(x).__name__}; curvlib "
            "supports a tensor [N, T, I] (batch_first=True) or [T, N, I]."
        )
    if x.dim() != 3 and not (x.dim() == 4 and rows):
        raise CurvatureError(
            f"Module '{where}' gets an input of shape {list(x.shape)}; curvlib supports "
            "batched 3-D inputs only ([N, T, I] with batch_first=True, else [T, N, I]), "
            "not unbatched 2-D sequences."
        )
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise CurvatureError(f"Module '{where}' gets an empty input of shape {list(x.shape)}.")
    return x, hx


def _initial_states(
    module: nn.RNNBase, hx: object, n: int, x: Tensor, where: str
) -> Tuple[Tensor, Optional[Tensor]]:
    """``h0 [L·D, N, H_out]`` and, for LSTM, ``c0 [L·D, N, H]`` (zeros when absent)."""
    ld = module.num_layers * (2 if module.bidirectional else 1)
    h_out = module.proj_size if module.proj_size > 0 else module.hidden_size
    lstm = module.mode == "LSTM"
    if hx is None:
        h0 = x.new_zeros((ld, n, h_out))
        return h0, (x.new_zeros((ld, n, module.hidden_size)) if lstm else None)
    if lstm:
        if not (isinstance(hx, (tuple, list)) and len(hx) == 2 and all(isinstance(t, Tensor) for t in hx)):
            raise CurvatureError(
                f"Module '{where}' (LSTM) gets hx of type {type(hx).__name__}; it must be a "
                "tuple (h0, c0) of tensors."
            )
        h0, c0 = hx
        _check_state(h0, (ld, n, h_out), where, "h0")
        _check_state(c0, (ld, n, module.hidden_size), where, "c0")
        return h0, c0
    if not isinstance(hx, Tensor):
        raise CurvatureError(
            f"Module '{where}' gets hx of type {type(hx).__name__}; it must be a tensor "
            "[num_layers * num_directions, N, hidden_size]."
        )
    _check_state(hx, (ld, n, h_out), where, "hx")
    return hx, None


def _check_state(t: Tensor, expected: Tuple[int, int, int], where: str, what: str) -> None:
    if tuple(t.shape) != expected:
        raise CurvatureError(
            f"Module '{where}': the initial state {what} has shape {list(t.shape)}, expected "
            f"{list(expected)} = [num_layers * num_directions, N, size] for batch size "
            f"N={expected[1]}. curvlib needs initial states with the batch in dim 1, built "
            "from the input batch (e.g. expand a [L*D, 1, H] buffer to the input's batch size)."
        )


def _reach(coupling: Optional[Coupling], layer: int) -> Tuple[frozenset, frozenset, bool]:
    """The parameters the layer's input and its initial states depend on (a module applied to
    its own output; deeper layers' inputs carry the initial states' too), and whether the
    initial states vary with the parameters at all."""
    if coupling is None:
        return frozenset(), frozenset(), False
    return coupling.x | (coupling.hx if layer > 0 else frozenset()), coupling.hx, coupling.state_varies


def _linear_step(nodes: StepNodes, tag: str, lin: "_Recurrent", x: Tensor, t: int, coupled: bool) -> Tensor:
    """One step of a recurrent linear site: ``W x + b [N, out]`` (probed at step ``t``),
    recorded as a bilinear node when ``x`` depends on ``W`` (``W_hh h_prev``; LSTM's
    ``W_hr m``)."""
    y = F.linear(x, lin.weight, lin.bias)
    if lin.probe is not None:
        y = y + lin.probe[:, t]
    return nodes.bilinear(tag, lin.site, x, y, coupled)


class _Call(NamedTuple):
    """One call of the module's ``forward``: what each of its directions reads. ``rows``: rows of
    the recurrence per sample (:func:`_split_rows`; a direction's sites are ``[N, rows, T, *]``)."""

    module: nn.RNNBase
    names: Dict[str, str]
    tensors: Dict[str, Tensor]
    where: str
    rec: Recorder
    rows: int = 1


def _direction(call: _Call, layer: int, reverse: bool, inp: Tensor, h: Tensor,
               c: Optional[Tensor]) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Run one layer in one direction and record its sites (and, for the Hessian
    family, its nonlinear nodes: :mod:`curvlib.rules.rnn_steps`).

    Args:
        inp: layer input ``[N, T, I]`` (``[N·rows, T, I]``, :class:`_Call`).
        h: initial hidden state ``[N, H_out]``.
        c: initial cell state ``[N, H]`` (LSTM) or ``None``.

    Returns:
        ``(out [N, T, H_out], h_T [N, H_out], c_T [N, H] or None)``, the states after its last step.
    """
    module, names, tensors, where, rec, rows = call
    sfx = f"_l{layer}" + ("_reverse" if reverse else "")
    steps = inp.shape[1]
    w_ih, w_hh = tensors["weight_ih" + sfx], tensors["weight_hh" + sfx]
    b_ih, b_hh = (tensors["bias_ih" + sfx], tensors["bias_hh" + sfx]) if module.bias else (None, None)
    bname = (lambda s: s + sfx) if module.bias else (lambda s: None)
    coupling: Optional[Coupling] = rec.layer_residuals
    nodes = StepNodes(rec, where, f"l{layer}" + ("r" if reverse else ""), coupling)
    reach = _reach(coupling, layer)  # (what its input and its initial states depend on)

    site_ih = Site(LINEAR, _roles(names, "weight_ih" + sfx, bname("bias_ih")), where,
                   saved={"x": _per_sample(inp, rows)})
    pre_ih = _rows_of(rec.add(site_ih, F.linear(_per_sample(inp, rows), w_ih, b_ih)), rows)  # [N, T, G·H]
    pre_ih = nodes.bilinear("ih", site_ih, inp, pre_ih, site_ih.params.get("weight") in reach[0])
    site_hh = Site(LINEAR, _roles(names, "weight_hh" + sfx, bname("bias_hh")), where)
    hh = _opened(rec, site_hh, w_hh, b_hh, pre_ih, rows)
    hr = None
    if module.mode == "LSTM" and module.proj_size > 0:
        site_hr = Site(LINEAR, _roles(names, "weight_hr" + sfx, None), where)
        hr = _opened(rec, site_hr, tensors["weight_hr" + sfx], None, pre_ih, rows)
    outs: List[Optional[Tensor]] = [None] * steps
    h_prevs: List[Optional[Tensor]] = [None] * steps
    m_steps: List[Optional[Tensor]] = [None] * steps  # LSTM with proj_size: W_hr's inputs
    order = range(steps - 1, -1, -1) if reverse else range(steps)
    cells = _Cells(nodes, module.mode, hh, hr, reach, m_steps)
    for k, t in enumerate(order):
        nodes.t = t
        h_prevs[t] = h
        h, c = _cell_step(cells, pre_ih[:, t], h, c, k, t)
        outs[t] = h
    site_hh.saved = {"x": _per_sample(torch.stack(h_prevs, 1), rows)}  # [N, T, H_out]
    if hr is not None:
        hr.site.saved = {"x": _per_sample(torch.stack(m_steps, 1), rows)}  # [N, T, H]
    return torch.stack(outs, 1), h, c


def _per_sample(t: Tensor, c: int) -> Tensor:
    """Rows ``[N·c, T, *]`` of the recurrence as a site's ``[N, c, T, *]`` (``c > 1``): a
    sample's rows are positions sharing the weight, as its time steps are."""
    return t.unflatten(0, (-1, c)) if c > 1 else t


def _opened(rec: Recorder, site: Site, w: Tensor, bias: Optional[Tensor], like: Tensor, c: int) -> "_Recurrent":
    """A recurrent site opened (:meth:`Recorder.open`) on the rows and steps of ``like``
    (``[N·c, T, ·]``, of the output's dtype): its output ``[N, T, out]``, or ``[N, c, T, out]``
    for ``c > 1`` rows a sample."""
    rows, steps = like.shape[:2]
    shape = (rows // c, c, steps, w.shape[0]) if c > 1 else (rows, steps, w.shape[0])
    return _Recurrent(site, w, bias, _rows_of(rec.open(site, shape, like.dtype), c))


def _rows_of(t, c: int):
    """A site's output or probe ``[N, c, T, out]`` as the recurrence's rows ``[N·c, T, out]``."""
    return t.flatten(0, 1) if t is not None and c > 1 else t


class _Recurrent(NamedTuple):
    """A linear site applied once per step to the recurrent state (``W_hh``, LSTM's ``W_hr``)."""

    site: Site
    weight: Tensor
    bias: Optional[Tensor]
    probe: object


class _Cells(NamedTuple):
    """What every step of one direction reads: its step nodes, the cell (``module.mode``), its
    recurrent sites (``W_hh``; LSTM's ``W_hr`` or ``None``), :func:`_reach`'s answer, and LSTM's
    ``W_hr`` inputs per step (filled as the steps run)."""

    nodes: StepNodes
    mode: str
    hh: _Recurrent
    hr: Optional[_Recurrent]
    reach: Tuple[frozenset, frozenset, bool]
    m_steps: List[Optional[Tensor]]


def _cell_step(cells: _Cells, a: Tensor, h: Tensor, c: Optional[Tensor], k: int,
               t: int) -> Tuple[Tensor, Optional[Tensor]]:
    """Step ``t`` (the ``k``-th of its direction) from ``a = W_ih x_t + b_ih [N, G·H]`` and the
    states entering it; returns the new ``(h, c)``."""
    nodes, mode, hh, hr, (reach_x, reach_hx, state_varies), m_steps = cells
    first = k == 0  # the states entering this step are the initial ones
    # h depends on W_hh from the third step on; on the second if the initial state is not
    # the zero one (W_hh h0); on the first if the initial state itself depends on W_hh
    coupled = k >= 2 or (k == 1 and state_varies) or hh.site.params.get("weight") in reach_hx
    b = _linear_step(nodes, "hh", hh, h, t, coupled)
    if mode in ("RNN_TANH", "RNN_RELU"):
        return rnn_step(nodes, mode, a + b), c
    if mode == "LSTM":
        h, c = lstm_step(nodes, a + b, c, not first or state_varies)
        if hr is not None:
            m_steps[t] = h
            coupled = not first or hr.site.params.get("weight") in (reach_x | reach_hx)
            h = _linear_step(nodes, "hr", hr, h, t, coupled)
        return h, c
    bn_varies = not first or state_varies or "bias" in hh.site.params  # GRU
    # the first step from the zero state: b_n = b_hn, a function of b_hh alone
    bn_params = frozenset([hh.site.params["bias"]]) if first and not state_varies and "bias" in hh.site.params \
        else frozenset()
    return gru_step(nodes, a, b, h, not first or state_varies, bn_varies, bn_params), c


def forward(module: nn.RNNBase, where: str, names: dict, tensors: dict, args, kwargs, rec: Recorder):
    """Run ``nn.RNN``/``nn.LSTM``/``nn.GRU`` unrolled and record its linear sites.

    Returns exactly what the module returns, in its layout:
    ``(output, h_n)`` or, for LSTM, ``(output, (h_n, c_n))``; ``output``
    ``[N, T, D·H_out]`` (``batch_first``) or ``[T, N, D·H_out]``, ``h_n``
    ``[L·D, N, H_out]``, ``c_n`` ``[L·D, N, H]``.

    Raises:
        CurvatureError: PackedSequence or unbatched input, or initial states
            of the wrong shape.
    """
    check(module, where)
    x, hx = _bind(args, kwargs, where, rows=True)
    if x.shape[-1] != module.input_size:
        raise CurvatureError(
            f"Module '{where}' gets inputs with {x.shape[-1]} features (shape {list(x.shape)}), "
            f"but its input_size is {module.input_size}."
        )
    seq, rows = _split_rows(module, x, hx, where, rec)  # [N·rows, T, I]
    n = seq.shape[0]
    h0, c0 = _initial_states(module, hx, n, x, where)
    dirs = 2 if module.bidirectional else 1
    lstm = module.mode == "LSTM"

    h_n: List[Tensor] = []
    c_n: List[Tensor] = []
    inp = seq
    call = _Call(module, names, tensors, where, rec, rows)
    for layer in range(module.num_layers):
        if layer > 0 and module.dropout > 0 and module.training:
            inp = F.dropout(inp, module.dropout, training=True)
        outs = []
        for d in range(dirs):
            k = layer * dirs + d
            out, h_last, c_last = _direction(call, layer, d == 1, inp, h0[k], c0[k] if lstm else None)
            outs.append(out)
            h_n.append(h_last)
            if lstm:
                c_n.append(c_last)
        inp = torch.cat(outs, -1) if dirs == 2 else outs[0]

    if rows > 1:
        return _rows_result(module, inp, h_n, c_n if lstm else None, rows)
    output = inp if module.batch_first else inp.transpose(0, 1)
    h_stack = torch.stack(h_n, 0)
    if lstm:
        return output, (h_stack, torch.stack(c_n, 0))
    return output, h_stack


def _split_rows(module: nn.RNNBase, x: Tensor, hx, where: str, rec: Recorder) -> Tuple[Tensor, int]:
    """``(sequences [N·rows, T, I], rows)``. A 4-D input is a batch merged with rows (timm's
    Sequencer: each of a sample's image rows a sequence, ``[N·H, W, C]``), split off by the
    planner (:func:`curvlib._plan.batch_merges.split_merged_batches`) to ``[N, rows, T, I]``
    (``batch_first``) or ``[N, T, rows, I]``: the recurrence runs on every row, sample-major,
    and each site sees a sample's rows as positions sharing its weight."""
    if x.dim() == 3:
        return (x if module.batch_first else x.transpose(0, 1)), 1
    if hx is not None or rec.layer_residuals is not None:
        raise CurvatureError(
            f"Module '{where}' runs on a batch merged with rows ({list(x.shape)} split per sample); "
            "curvlib supports that without initial states and for first-order, GGN and Kronecker "
            "quantities, not the Hessian extensions. Keep the batch in a dim of its own there.")
    seq = x if module.batch_first else x.movedim(2, 1)  # [N, rows, T, I]
    return seq.flatten(0, 1), seq.shape[1]


def _rows_result(module: nn.RNNBase, out: Tensor, h_n: List[Tensor], c_n: Optional[List[Tensor]], rows: int):
    """The module's result on split rows (:func:`_split_rows`): ``output`` ``[N, rows, T, ·]``
    (``batch_first``) or ``[N, T, rows, ·]``, the states ``[N, L·D, rows, ·]``: the batch in
    front, the rows after the dim the module's own layout merges them in."""
    output = out.unflatten(0, (-1, rows))
    output = output if module.batch_first else output.movedim(1, 2)
    states = [torch.stack(s, 0).unflatten(1, (-1, rows)).movedim(1, 0) for s in (h_n, c_n) if s is not None]
    return (output, tuple(states)) if c_n is not None else (output, states[0])


#: The family's record (:class:`~curvlib._core.family.Family`), registered in :data:`curvlib.rules.FAMILIES`.
FAMILY = Family("rnn", (nn.RNN, nn.LSTM, nn.GRU), forward, check, split_rows=True, recurrent=True,
                kron_over_uses=True, shared_hessian=True)
