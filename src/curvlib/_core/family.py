"""The record of one layer family: everything curvlib knows about a kind of layer.

Each family module of :mod:`curvlib.rules` fills one :class:`Family`; the stages read a
family's facts from it (:data:`curvlib.rules.FAMILY_OF`), never from the family's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple


@dataclass(frozen=True)
class Family:
    """One layer family: everything curvlib knows about a kind of layer, in one record.

    Each family module of :mod:`curvlib.rules` defines one ``FAMILY``; :data:`curvlib.rules.FAMILIES`
    registers them. Functions a family lacks are ``None``.

    Attributes:
        kind: the family's name: its sites' rules' ``kind`` and ``Program.layers``' ``kind``.
        types: the module classes it covers (with their own ``forward``: a subclass that
            changes ``forward`` is not trusted).
        forward: ``(module, where, names, tensors, args, kwargs, recorder) -> output``: the
            layer run functionally on the given parameter tensors, its sites recorded.
        check: ``(module, where) -> None``: refuses an unsupported configuration before any work.
        kron: ``(site, role, m [V, *out], approx, max_dim) -> factors``: Kronecker factors of
            ``role`` from the pulled-back root columns.
        kron_input: ``(site, approx, max_dim) -> A``: the input-side factor alone (it does not
            depend on the root: computed once per call).
        weight_output_factor: ``(site, B) -> B``: the weight's output-side factor from the
            full ``B`` (per-group blocks of grouped convolutions).
        kron_from_output_matrix: ``(site, role, G) -> factors``: KFRA's factors from the
            batch-averaged output matrix ``G``.
        kron_layout: ``"split"``: ``[B, A]`` with ``A`` from ``kron_input``; ``"own"``: the
            family's own layout (``kron`` only, :mod:`curvlib._core.kronlayout`); ``""``: none.
        root_last: its Kronecker root factor comes last (Embedding's ``[A [V], B]``; a generic
            parameter at fixed rows, :mod:`curvlib.rules.fixed_rows`).
        row_map: ``site -> r [S]`` or ``None``: the parameter row each output position reads,
            for a parameter added as a bias at fixed rows (learned positions).
        kfra_pullback: ``(tensors, G [O, O]) -> Jᵀ G J [I, I]``: KFRA's batch-averaged matrix
            passed back through the layer in closed form (``tensors``: role -> parameter); ``None``:
            by autodiff, averaged over samples.
        split_rows: its forward takes a batch merged with rows (``[N·c, T, I]``) split off by the
            planner, ``[N, c, ...]`` with the rows after the merged dim
            (:func:`curvlib._plan.batch_merges.split_merged_batches`), and returns every tensor
            of its result so: the batch in front, the rows in the dim after its merged one.
        affine_in_input: its output is affine in its input: no residual (second-derivative
            term, :mod:`curvlib._hessian.residuals`) of its own unless its input depends on its
            parameters.
        affine_in_parameters: its output is affine in its parameters (``∂²f/∂θ² = 0``): a
            parameter that no input depends on has no residual block of its own.
        bilinear: where its input depends on its own weight, its residual is the
            ``"bilinear"`` one of weight times input (a Linear layer).
        norm_residual: ``module -> meta``: its residual is the ``"norm"`` kind, block-diagonal
            over its input's rows (a normalisation); ``meta`` is what the blocks need besides
            ``eps`` and the weight (the normalised axes or the groups). ``None``: not that kind.
        recurrent: a loop of one cell over time steps: its rule records its unrolled nonlinear
            nodes itself (the residual plan's ``"layer"`` kind), and it is no chain of layers
            for KFRA.
        runs_own_code: its forward calls the module's own code, which its rule re-runs per
            sample (the generic family): a submodule inside it (dropout) runs as that code says.
        exact_block: Kronecker extensions give its parameters their exact curvature block
            (every parameter of a normalisation; the generic family's 1-D ones).
        kron_over_uses: a weight shared by several of its Linear sites is factored with the
            uses as positions (Linear and recurrent layers).
        shared_hessian: a parameter used by several of its sites gets the Hessian's
            weight-input coupling between the uses.
        kron_refusal: ``(site, approx) -> reason or None``: why its Kronecker factors are not
            defined for ``kfac_approx=approx`` at ``site`` (the text after the parameter's name).
        dense_sides: ``(site, role, shape) -> sides or None``: the sides of the dense Kronecker
            factors of a ≥ 2-dim parameter of ``shape`` in ``role`` (the memory budget,
            :func:`curvlib._plan.budget.dense_sides`); ``None`` (or no function): the last dim
            for a parameter of one use, none (a diagonal block) for a shared one.
        row_wise: its sites treat every entry of their input's dim 0 alike (leading dims are
            positions), so a batch merged into dim 0 splits off as positions.
        entry_wise: it acts on each entry of its input's dim 0 alone but takes no extra leading
            dim (a convolution on ``[N·H, C, h, w]``): merged rows run through the generic rule.
    """

    kind: str
    types: Tuple[type, ...]
    forward: Callable
    check: Optional[Callable] = None
    kron: Optional[Callable] = None
    kron_input: Optional[Callable] = None
    weight_output_factor: Optional[Callable] = None
    kron_from_output_matrix: Optional[Callable] = None
    kron_layout: str = ""
    kfra_pullback: Optional[Callable] = None
    root_last: bool = False
    row_map: Optional[Callable] = None
    split_rows: bool = False
    affine_in_input: bool = False
    affine_in_parameters: bool = False
    bilinear: bool = False
    norm_residual: Optional[Callable] = None
    recurrent: bool = False
    runs_own_code: bool = False
    exact_block: bool = False
    kron_over_uses: bool = False
    shared_hessian: bool = False
    kron_refusal: Optional[Callable] = None
    dense_sides: Optional[Callable] = None
    row_wise: bool = False
    entry_wise: bool = False

    @property
    def factors_from_rows(self) -> bool:
        """Its Kronecker factors come from its input and output rows alone, every row alike
        (``B`` from the root at the output rows, ``A`` from the input rows; ``nn.Linear``): inside
        a module run whole, its layers' factors are formed sample by sample from the rows each
        call sees (:mod:`curvlib._evaluate.opaque_kron`)."""
        return self.kron is not None and self.row_wise and self.kron_layout == "split"
