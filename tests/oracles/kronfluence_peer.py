"""kronfluence 1.0 run on the same model and data as ``curvlib.influence``, for side-by-side checks.

kronfluence wraps the model's ``nn.Linear``/``nn.Conv2d`` modules in place (``prepare_model``),
so it runs on a deep copy; it fits and scores through data sets and writes its results to
``output_dir``. The task is a classifier's or a language model's: each example's loss is its cross-entropy summed
over its positions (``[N, V]`` or ``[N, T, V]`` logits; the train loss and the query measurement alike); ``empirical`` chooses its
``use_empirical_fisher`` (the data's labels instead of sampled ones).
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

__all__ = ["kronfluence_scores"]


def _flat(logits: Tensor, labels: Tensor):
    """Positions as examples of the summed loss: ``[N, T, V]`` logits -> ``[N·T, V]``."""
    return logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)


def _task(kronfluence, tracked):
    class Classification(kronfluence.Task):
        def compute_train_loss(self, batch, model, sample=False):
            inputs, labels = batch
            logits, labels = _flat(model(inputs), labels)
            if sample:
                with torch.no_grad():
                    labels = torch.multinomial(torch.softmax(logits.detach(), -1), 1).flatten()
            return nn.functional.cross_entropy(logits, labels, reduction="sum")

        def compute_measurement(self, batch, model):
            inputs, labels = batch
            return nn.functional.cross_entropy(*_flat(model(inputs), labels), reduction="sum")

        def get_influence_tracked_modules(self):
            return tracked

    return Classification()


def kronfluence_scores(model: nn.Module, train, queries, output_dir: str, *, strategy: str, empirical: bool = True,
                       damping: Optional[float] = None, query_rank: Optional[int] = None,
                       tracked=None, batch_size: int = 8, dtype: torch.dtype = torch.float64,
                       self_scores: bool = True) -> dict:
    """``{"pairwise": [Q, N], "self": [N]}`` from kronfluence for ``train = (X, y)`` and ``queries``,
    every computation in ``dtype``; without ``self_scores``, ``{"pairwise": [Q, N]}``."""
    import kronfluence
    from kronfluence.arguments import FactorArguments, ScoreArguments

    model = kronfluence.prepare_model(copy.deepcopy(model).eval(), _task(kronfluence, tracked))
    analyzer = kronfluence.Analyzer(analysis_name="side_by_side", model=model, task=_task(kronfluence, tracked),
                                    cpu=True, disable_tqdm=True, output_dir=output_dir)
    factor_args = FactorArguments(strategy=strategy, use_empirical_fisher=empirical,
                                  activation_covariance_dtype=dtype, gradient_covariance_dtype=dtype,
                                  eigendecomposition_dtype=dtype, per_sample_gradient_dtype=dtype, lambda_dtype=dtype)
    score_args = ScoreArguments(damping_factor=damping, query_gradient_low_rank=query_rank, use_full_svd=True,
                                query_gradient_svd_dtype=dtype, per_sample_gradient_dtype=dtype,
                                precondition_dtype=dtype, score_dtype=dtype)
    train_set, query_set = TensorDataset(*train), TensorDataset(*queries)
    analyzer.fit_all_factors("factors", train_set, per_device_batch_size=batch_size, factor_args=factor_args,
                             overwrite_output_dir=True)
    analyzer.compute_pairwise_scores("pairwise", "factors", query_set, train_set, per_device_query_batch_size=batch_size,
                                     per_device_train_batch_size=batch_size, score_args=score_args,
                                     overwrite_output_dir=True)
    out = {"pairwise": analyzer.load_pairwise_scores("pairwise")["all_modules"]}
    if self_scores:
        analyzer.compute_self_scores("self", "factors", train_set, per_device_train_batch_size=batch_size,
                                     score_args=score_args, overwrite_output_dir=True)
        out["self"] = analyzer.load_self_scores("self")["all_modules"]
    return out
