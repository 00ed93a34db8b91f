"""How scores are contracted: a strided block (an Embedding's core is its transposed parameter)
without copies of the queries, products over long blocks summed in float64 slices, and the
Jacobian-vector products one slice of the batch at a time; each against float64 einsum."""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from curvlib import influence
from curvlib.influence import _blocks
from oracles.on_device import seeded

DT = torch.float64


class NewStorages(TorchDispatchMode):
    """The entries of each storage an op's output holds that none of its inputs had (views and
    in-place results are not new)."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        held = {_address(t) for t in tree_flatten((args, kwargs))[0]}
        for t in tree_flatten(out)[0]:
            if _address(t) is not None and _address(t) not in held:
                self.sizes.append(t.untyped_storage().nbytes() // t.element_size())
        return out


def _address(t):
    """A plain tensor's storage address; ``None`` for anything else (a fake tensor of a trace)."""
    if type(t) not in (torch.Tensor, nn.Parameter) or t.device.type == "meta":
        return None
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:  # a tensor without a storage of its own (a transform's wrapper)
        return None


@pytest.mark.parametrize("queries, examples", [(3, 1), (1, 3)])
def test_a_strided_block_copies_only_the_operand_with_fewer_rows(queries, examples):
    """An Embedding's block (layout ``"rows"``: its core ``[1, D, V]`` a transposed view of the
    ``[V, D]`` gradient) against ``Q`` queries: at most ``min(Q, N)`` block-sized copies."""
    vocab, d = 600, 4
    torch.manual_seed(3)
    model, lossfn = nn.Sequential(nn.Embedding(vocab, d), nn.Flatten(), nn.Linear(2 * d, 3)).to(DT), nn.CrossEntropyLoss()
    gen = seeded(3)
    X, y = torch.randint(0, vocab, (16, 2), generator=gen), torch.randint(0, 3, (16,), generator=gen)
    factors = influence.fit(model, lossfn, (X, y), strategy="ekfac", fisher_type="empirical")
    block = factors["blocks"]["0.weight"]
    assert block["layout"][0] == "rows"
    query = influence.precondition_queries(model, lossfn, factors, (X[:queries], y[:queries]))["blocks"]["0.weight"]
    g = torch.randn(examples, vocab, d, dtype=DT, generator=gen)
    with NewStorages() as new:
        got = _blocks.pairwise(query, block, g)
    assert max(new.sizes) <= min(queries, examples) * vocab * d, new.sizes
    core = g.transpose(1, 2).unsqueeze(1)  # [N, 1, D, V]
    torch.testing.assert_close(got, torch.einsum("qgoa,ngoa->qn", query, core), rtol=1e-12, atol=1e-12)


def test_long_blocks_are_summed_in_float64_slices():
    """A float32 block of 2^20 entries (a 1024 x 1024 weight) whose products are all positive:
    the pairwise and self scores within 5e-7 of float64 (one float32 product over the whole
    block is several times further off)."""
    model = nn.Linear(1024, 1024, bias=False)
    block = influence.fit(model, nn.MSELoss(), (torch.randn(2, 1024), torch.randn(2, 1024)),
                          strategy="identity")["blocks"]["weight"]
    gen = seeded(0)
    query = 1 + torch.rand(3, 1, 1024, 1024, generator=gen)
    g = 1 + torch.rand(2, 1024, 1024, generator=gen)
    got = _blocks.pairwise(query, block, g)
    want = query.double().flatten(1) @ g.double().flatten(1).T
    assert ((got.double() - want).abs() / want).max() < 5e-7
    spectrum = torch.rand(1, 1024, 1024, generator=gen) + 0.5
    got = _blocks.self_scores({**block, "spectrum": spectrum}, 0.1, g)
    want = g.double().square().flatten(1) @ (spectrum.double() + 0.1).reciprocal().flatten()
    assert ((got.double() - want).abs() / want).max() < 5e-7


def test_jacobian_vector_products_take_batch_size_examples_at_a_time():
    """``method="jvp", batch_size=1``: no output-sized tensor of the whole batch (``[6, 600]``), the
    scores of the gradients' method."""
    torch.manual_seed(5)
    model, lossfn = nn.Sequential(nn.Linear(4, 600), nn.Tanh(), nn.Linear(600, 600)).to(DT), nn.CrossEntropyLoss()
    gen = seeded(5)
    X, y = torch.randn(6, 4, dtype=DT, generator=gen), torch.randint(0, 600, (6,), generator=gen)
    factors = influence.fit(model, lossfn, (X, y), strategy="diagonal", fisher_type="empirical")
    prepared = influence.precondition_queries(model, lossfn, factors, (X[:2], y[:2]))
    want = influence.scores(model, lossfn, factors, prepared, (X, y))
    with NewStorages() as new:
        got = influence.scores(model, lossfn, factors, prepared, (X, y), method="jvp", batch_size=1)
    batch_outputs = [s for s in new.sizes if 6 * 600 <= s < 600 * 600]  # the weight [600, 600]'s tangent aside
    assert not batch_outputs, batch_outputs
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
