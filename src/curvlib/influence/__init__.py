"""Influence functions: which training examples are responsible for a prediction.

With ``ℓ_n`` example ``n``'s loss (its share of the loss, summed over its own positions: a
sequence's tokens), ``g_n = ∇ℓ_n``, and ``G = (1/N) Σ_n F_n`` the curvature of the mean training
loss (``F_n`` the example's Fisher, GGN or empirical Fisher ``g_n g_nᵀ``; Koh & Liang 2017,
Grosse et al. 2023),

    score(q, n) = g_qᵀ (G + λ I)⁻¹ g_n,        self(n) = g_nᵀ (G + λ I)⁻¹ g_n.

A positive score: training on ``n`` lowered the query's loss. ``G`` is approximated per
parameter (block-diagonal), by ``strategy``:

| strategy | block of ``G`` | fitting costs |
|---|---|---|
| ``"identity"`` | ``I`` (gradient dot products; no damping) | nothing |
| ``"diagonal"`` | its diagonal (``DiagGGNMC``, ``DiagGGNExact`` or ``SumGradSquared``) | one pass |
| ``"kfac"`` | ``B ⊗ A`` (``KFAC``/``KFLR``/``KFACEmpirical`` factors) | one pass, factor eigendecompositions |
| ``"ekfac"`` | ``Q diag(s) Qᵀ``, KFAC's eigenbasis ``Q``, ``s`` refitted to the examples (George et al. 2018) | two passes |

``fisher_type`` chooses ``F_n``: ``"mc"`` (labels sampled from the model, ``generator``),
``"exact"`` (the GGN, the loss Hessian's exact root) or ``"empirical"`` (the data's labels).
EK-FAC's ``s = (1/N) Σ_n (Qᵀ r)²`` over the columns ``r`` of each example's curvature root,
streamed one batch at a time. Every trainable parameter takes part whatever its layer
(embeddings, norms, tied weights, experts: whatever ``curvature`` supports), or the subset
passed as ``params``; ``max_factor_dim`` keeps a huge factor side (a vocabulary) diagonal.

Three steps, all pure (parameters and data are arguments; the model is never changed):

1. ``fit`` over the training data returns the factors: a dict of tensors, ``torch.save``-able;
2. ``precondition_queries`` computes ``(G + λ)⁻¹ g_q`` once, optionally at rank ``r`` per
   block (truncated SVD: ``r (o + a)`` numbers instead of ``o a``);
3. ``scores`` streams the training data, one batch's gradients ``[N_b, P]`` at a time,
   into ``[Q, N]``; ``self_influence`` into ``[N]``.

``damping=None`` is ``λ_p = 0.1 · mean(s_p)`` per block (kronfluence's heuristic, which it
applies per module, a Linear's weight and bias together).

Where kronfluence's definitions differ: it puts a Linear's bias in the weight's Kronecker block
(curvlib: a block of its own, as BackPACK's KFAC); its KFAC factors of a weight shared by ``T``
positions are both means over tokens, so its KFAC spectrum is ``1/T`` of curvlib's
(``"expand"``: ``B`` sums the positions per example); it fits modules it can hook
(``nn.Linear``, ``nn.Conv2d``) only. Its EK-FAC, diagonal and identity scores equal curvlib's.

Example::

    >>> import torch
    >>> from torch import nn
    >>> from curvlib import influence
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    >>> train = [(torch.randn(16, 4), torch.randint(0, 3, (16,))) for _ in range(2)]
    >>> factors = influence.fit(model, nn.CrossEntropyLoss(), train, strategy="ekfac",
    ...                         generator=torch.Generator().manual_seed(0))
    >>> query = (torch.randn(2, 4), torch.randint(0, 3, (2,)))
    >>> influence.scores(model, nn.CrossEntropyLoss(), factors, query, train).shape
    torch.Size([2, 32])
    >>> influence.self_influence(model, nn.CrossEntropyLoss(), factors, train).shape
    torch.Size([32])
"""

from ._blocks import HEURISTIC_DAMPING
from ._fit import FISHER_TYPES, STRATEGIES, fit
from ._scores import precondition_queries, scores, self_influence

__all__ = ["fit", "precondition_queries", "scores", "self_influence"]
