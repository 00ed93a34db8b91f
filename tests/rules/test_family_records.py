"""The stages' tables of layer families are read off the families' records (``Family``), and
equal the tables they replace: a new family changes them by its record alone."""

import pytest
from torch import nn

from curvlib._hessian import residuals
from curvlib._plan import batch_merges, budget, support
from curvlib._core.site import Site
from curvlib.extensions import _base
from curvlib.rules import FAMILY_OF, conv, conv_transpose, embedding, layernorm, linear

ALL = {"linear", "conv", "conv_transpose", "batchnorm", "embedding", "rnn", "layernorm", "groupnorm", "generic"}

# every table as it was written out by name, before the records carried the facts
TABLES = [
    (_base.KFRA_FAMILIES, ("linear", "conv", "conv_transpose")),
    (_base.KRON_FAMILIES, ("linear", "conv", "conv_transpose", "embedding", "batchnorm", "layernorm", "groupnorm",
                           "generic", "rnn")),
    (_base.HESSIAN_FAMILIES, ("linear", "conv", "conv_transpose", "batchnorm", "embedding", "layernorm", "groupnorm",
                              "generic", "rnn")),
    (support.EXACT_BLOCK_KINDS, ("batchnorm", "layernorm", "groupnorm", "generic")),
    (support.SHARED_HESSIAN_KINDS, ("linear", "embedding", "layernorm", "groupnorm", "generic", "rnn")),
    (support.KRON_OVER_USES_KINDS, ("linear", "rnn")),
    (residuals.AFFINE_FAMILIES, ("linear", "conv", "conv_transpose", "batchnorm", "embedding")),
    (residuals.AFFINE_IN_PARAMETERS, ("linear", "conv", "conv_transpose", "batchnorm", "embedding", "layernorm",
                                      "groupnorm")),
    (residuals.NORM_FAMILIES, ("layernorm", "groupnorm")),
    (batch_merges._ROW_WISE, ("linear", "layernorm", "embedding")),
    (batch_merges._ENTRY_WISE, ("conv", "conv_transpose")),
]


@pytest.mark.parametrize("derived, written", TABLES, ids=range(len(TABLES)))
def test_derived_tables_equal_the_written_ones(derived, written):
    assert sorted(derived) == sorted(written) and len(set(derived)) == len(derived)


def test_facts_of_one_family_only():
    assert set(FAMILY_OF) == ALL
    assert [k for k, f in FAMILY_OF.items() if f.recurrent] == ["rnn"]
    assert [k for k, f in FAMILY_OF.items() if f.bilinear] == ["linear"]
    assert [k for k, f in FAMILY_OF.items() if f.runs_own_code] == ["generic"]
    assert [k for k, f in FAMILY_OF.items() if f.kron_refusal is not None] == ["embedding"]


def test_norm_residual_meta():
    assert FAMILY_OF["layernorm"].norm_residual(nn.LayerNorm((3, 4))) == {"groups": None, "norm_dims": 2}
    assert FAMILY_OF["groupnorm"].norm_residual(nn.GroupNorm(2, 6)) == {"groups": 2}


def _site(rule, **meta):
    return Site(rule, {"weight": "w"}, "layer", meta=meta)


def test_dense_sides_as_written():
    """The memory budget's sides per family (budget's module table)."""
    lin, cv = _site(linear.LINEAR), _site(conv.CONV)
    assert budget.dense_sides([(lin, "weight")], (5, 3)) == [5, 3]
    assert budget.dense_sides([(lin, "weight"), (lin, "weight")], (5, 3)) == [5, 3]
    assert budget.dense_sides([(cv, "weight")], (8, 4, 3, 3)) == [8, 36]
    ct = _site(conv_transpose.CONV_TRANSPOSE, groups=2)
    assert budget.dense_sides([(ct, "weight")], (4, 3, 5)) == [6, 10]  # [C_in, C_out/G, k]: C_out, C_in/G·k
    emb = _site(embedding.EMBEDDING)
    assert budget.dense_sides([(emb, "weight"), (emb, "weight")], (10, 4)) == [4]
    assert budget.dense_sides([(lin, "bias")], (7,)) == [7]
    norm = _site(layernorm.LAYERNORM)
    assert budget.dense_sides([(norm, "weight")], (3, 4)) == [4]
    assert budget.dense_sides([(norm, "weight"), (norm, "weight")], (3, 4)) == []


def test_embedding_reduce_refusal_on_sequences():
    site = _site(embedding.EMBEDDING, index_dims=2)
    why = FAMILY_OF["embedding"].kron_refusal(site, "reduce")
    assert why.startswith("(Embedding 'layer' on sequences): KFAC-reduce's input factor")
    assert FAMILY_OF["embedding"].kron_refusal(site, "expand") is None
    assert FAMILY_OF["embedding"].kron_refusal(_site(embedding.EMBEDDING, index_dims=1), "reduce") is None
