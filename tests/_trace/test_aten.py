"""The ATen-level front end (curvlib._trace.aten) on models torch.fx cannot trace, against brute force.

Each model here breaks torch.fx's symbolic trace the way real model code does (an assertion on
a shape, a branch on a value, ``x.shape[0]`` passed to ``expand``, a container output, keyword
inputs); curvlib then traces it with make_fx on the call's input. Every exact quantity is
compared with the float64 oracles of ``oracles.reference`` (per-sample loops, jacobians, hessians);
the transposed Linear's Kronecker factors with those of the same model written with nn.Linear.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib.extensions import KFLR, BatchGrad, DiagGGNExact, DiagHessian
from oracles.on_device import seeded
from oracles.first_order import individual_gradients
from oracles.reference import assert_close, assert_matches, exact_extensions, reference

DT = torch.float64


class AssertsShape(nn.Module):
    """An assertion on the input's rank (fx: a proxy has no truth value) and a tanh MLP."""

    def __init__(self, d=3, h=4, c=3):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, c)

    def forward(self, x):
        assert x.dim() == 2, "expects [N, D]"
        return self.fc2(torch.tanh(self.fc1(x)))


class ClassToken(nn.Module):
    """ViT-style: a class token expanded to the batch size read from the input, a position
    embedding added, a layer norm, the class token's row to a head; asserts its input's rank."""

    def __init__(self, d=4, t=3, c=3):
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, t + 1, d))
        self.proj, self.norm, self.head = nn.Linear(2, d), nn.LayerNorm(d), nn.Linear(d, c)

    def forward(self, x):
        assert x.dim() == 3
        h = self.proj(x)
        h = torch.cat([self.cls.expand(x.shape[0], -1, -1), h], dim=1) + self.pos
        return self.head(torch.sigmoid(self.norm(h))[:, 0])


class TransposedLinear(nn.Module):
    """GPT-2's ``Conv1D``: weight stored ``[in, out]``, ``addmm`` on the input flattened to rows."""

    def __init__(self, nx, nf):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(nx, nf) / nx**0.5), nn.Parameter(torch.randn(nf))

    def forward(self, x):
        size = x.size()[:-1] + (self.weight.shape[1],)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size)


class Conv1DNet(nn.Module):
    def __init__(self, d=3, h=4, c=3):
        super().__init__()
        self.c1, self.c2 = TransposedLinear(d, h), TransposedLinear(h, c)

    def forward(self, x):
        if not isinstance(x.shape[-1], int):  # pragma: no cover - fx gives a proxy, fails below
            raise TypeError
        assert x.shape[-1] == self.c1.weight.shape[0]
        return self.c2(torch.tanh(self.c1(x))).sum(1)


@dataclasses.dataclass
class Output:
    hidden: torch.Tensor
    logits: torch.Tensor


class KeywordModel(nn.Module):
    """Hugging Face style: keyword inputs, an optional mask, a dataclass output."""

    def __init__(self, v=5, d=4, c=3):
        super().__init__()
        self.emb, self.head = nn.Embedding(v, d), nn.Linear(d, c)

    def forward(self, input_ids, attention_mask=None):
        h = torch.tanh(self.emb(input_ids))
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        return Output(hidden=h, logits=self.head(h.sum(1)))


def _data(shape, c=3, seed=0):
    g = seeded(seed)
    return torch.randn(shape, generator=g, dtype=DT), torch.randint(0, c, (shape[0],), generator=g)


@pytest.mark.parametrize("build, shape", [(AssertsShape, (4, 3)), (ClassToken, (3, 3, 2)), (Conv1DNet, (3, 2, 3))])
def test_every_exact_extension_matches_brute_force(build, shape):
    torch.manual_seed(0)
    model = build().to(DT)
    X, y = _data(shape)
    lossfn = nn.CrossEntropyLoss()
    qs = curvature(model, lossfn, exact_extensions(hessian=True))(X, y)
    assert_matches(qs, reference(model, lossfn, X, y, hessian=True, pchmp=False), build.__name__)


def test_transposed_linear_has_kronecker_factors_of_the_linear_it_is():
    """``addmm(b, x.view(-1, k), W)`` is a Linear site whose weight is ``Wᵀ``: factors ``[A, B]``,
    those of the same model with ``nn.Linear(weight=Wᵀ)`` in the parameter's own order."""
    torch.manual_seed(0)
    model = Conv1DNet().to(DT)
    twin = nn.ModuleDict({"c1": nn.Linear(3, 4), "c2": nn.Linear(4, 3)})
    with torch.no_grad():
        for k in ("c1", "c2"):
            twin[k].weight.copy_(getattr(model, k).weight.t())
            twin[k].bias.copy_(getattr(model, k).bias)

    class Twin(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = twin.to(DT)

        def forward(self, x):
            return self.m["c2"](torch.tanh(self.m["c1"](x))).sum(1)

    X, y = _data((3, 2, 3))
    got = curvature(model, nn.CrossEntropyLoss(), [KFLR()])(X, y)["kflr"]
    want = curvature(Twin(), nn.CrossEntropyLoss(), [KFLR()])(X, y)["kflr"]
    for k in ("c1", "c2"):
        B, A = want[f"m.{k}.weight"]
        assert [tuple(t.shape) for t in got[f"{k}.weight"]] == [tuple(A.shape), tuple(B.shape)]
        assert_close(got[f"{k}.weight"][0], A, f"{k} A")
        assert_close(got[f"{k}.weight"][1], B, f"{k} B")
        assert_close(got[f"{k}.bias"][0], want[f"m.{k}.bias"][0], f"{k} bias")


def test_keyword_inputs_and_dataclass_output():
    torch.manual_seed(0)
    model = KeywordModel().to(DT)
    ids = torch.randint(0, 5, (4, 3))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=DT)
    y = torch.randint(0, 3, (4,))
    with pytest.warns(UserWarning, match=r"Output\['logits'\]|Output\.logits"):
        qs = curvature(model, nn.CrossEntropyLoss(), [BatchGrad()])({"input_ids": ids, "attention_mask": mask}, y)

    class Plain(nn.Module):  # the oracle's view: one tensor in, the logits out
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):
            return self.m(x[:, 0].long(), x[:, 1]).logits

    ref = individual_gradients(Plain(), nn.CrossEntropyLoss(), torch.stack([ids.to(DT), mask], 1), y)
    for name, g in qs["grad_batch"].items():
        assert_close(g, ref[f"m.{name}"], name)


@pytest.mark.parametrize("output, expect", [("hidden", None), (1, None), (lambda o: o.logits * 2, None),
                                             ("nope", "no tensor entry named 'nope'"), (7, "no tensor at position 7")])
def test_output_selector(output, expect):
    torch.manual_seed(0)
    model = KeywordModel().to(DT)
    X = {"input_ids": torch.randint(0, 5, (4, 3))}
    y = torch.randn(4, 3, 4, dtype=DT) if output == "hidden" else torch.randn(4, 3, dtype=DT)
    f = curvature(model, nn.MSELoss(), [BatchGrad()], output=output)
    if expect is not None:
        with pytest.raises(CurvatureError, match=expect):
            f(X, y)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an explicit choice is not announced
        qs = f(X, y)
    out = model(**X)
    chosen = out.hidden if output == "hidden" else (out.logits if output == 1 else out.logits * 2)
    assert_close(qs["loss"], nn.MSELoss()(chosen, y), "loss")


class Branches(nn.Module):
    """Reads a value of its input to choose a branch (``if mask.all()``, as Hugging Face's
    attention masks do): the graph holds the branch of the traced input, guarded."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        if bool((x[:, 0] > 0).all()):
            return self.fc(x)
        return self.fc(torch.tanh(x))


@given(first=st.booleans(), seed=st.integers(0, 100))
def test_an_input_that_takes_another_branch_is_traced_again(first, seed):
    """One call per branch with the same function (the sign of column 0 is the same for all
    samples of a batch, so that each sample alone takes the batch's branch: the oracle's view)."""
    torch.manual_seed(0)
    model = Branches().to(DT)
    f = curvature(model, nn.CrossEntropyLoss(), [BatchGrad(), DiagGGNExact()])
    y = torch.tensor([0, 1, 2])
    for positive in (first, not first, first):
        X, _ = _data((3, 3), seed=seed)
        X[:, 0] = (1.0 if positive else -1.0) * (X[:, 0].abs() + 0.1)
        qs = f(X, y)
        ref = reference(model, nn.CrossEntropyLoss(), X, y, hessian=False)
        assert_close(qs["grad_batch"]["fc.weight"], ref["grad_batch"]["fc.weight"], "grad_batch")
        assert_close(qs["diag_ggn_exact"]["fc.weight"], ref["diag_ggn_exact"]["fc.weight"], "diag_ggn")


def test_a_new_batch_size_is_traced_again():
    torch.manual_seed(0)
    model = ClassToken().to(DT)
    f = curvature(model, nn.CrossEntropyLoss(), [DiagHessian()])
    for n in (2, 5):
        X, y = _data((n, 3, 2), seed=n)
        ref = reference(model, nn.CrossEntropyLoss(), X, y, hessian=True, pchmp=False)
        for name, d in f(X, y)["diag_h"].items():
            assert_close(d, ref["diag_h"][name], f"N={n} {name}")


class MaskShortcut(nn.Module):
    """Hugging Face's padding-mask shortcut: ``if mask.all()`` skips the mask, which changes
    nothing in value (a mask of ones), so a padded batch with unpadded samples is exact; the
    forwards are counted."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.calls = 0

    def forward(self, x, mask):
        self.calls += 1
        if bool(mask.all()):
            return self.fc(x).sum(1)
        return (self.fc(x) * mask.unsqueeze(-1)).sum(1)


@settings(max_examples=10, deadline=None)
@given(n=st.integers(2, 9), seed=st.integers(0, 100))
def test_padded_batch_with_mask_shortcut_is_exact_in_few_forwards(n, seed):
    """Samples whose guard values differ from the batch's are checked as one group (the
    unpadded ones: one forward, and one of them alone), not one forward each."""
    torch.manual_seed(0)
    model = MaskShortcut().to(DT)
    x, _ = _data((n, 4, 3), seed=seed)
    mask = torch.ones(n, 4, dtype=torch.long)
    mask[::2, -1] = 0  # every other sample padded: the batch is not all ones
    y = torch.arange(n) % 3
    f = curvature(model, nn.CrossEntropyLoss(), [BatchGrad()])
    f({"x": x, "mask": mask}, y)
    model.calls = 0
    qs = f({"x": x, "mask": mask}, y)
    assert model.calls <= 3  # the batch, the unpadded group, one unpadded sample alone
    for i in range(n):  # each sample alone, as the oracle sees it
        model.zero_grad()
        nn.CrossEntropyLoss(reduction="sum")(model(x[i:i + 1], mask[i:i + 1]), y[i:i + 1]).backward()
        assert_close(qs["grad_batch"]["fc.weight"][i] * n, model.fc.weight.grad, f"sample {i}")


def test_a_branch_that_changes_a_sample_in_a_mixed_batch_is_refused():
    torch.manual_seed(0)
    X, _ = _data((4, 3), seed=0)
    X[:2, 0], X[2:, 0] = X[:2, 0].abs() + 0.1, -X[2:, 0].abs() - 0.1  # two samples alone take the other branch
    f = curvature(Branches().to(DT), nn.CrossEntropyLoss(), [BatchGrad()])
    with pytest.raises(CurvatureError, match="reads tensor values to choose a branch"):
        f(X, torch.tensor([0, 1, 2, 0]))


class VmappedMask(nn.Module):
    """A mask built with ``torch.vmap`` over position indices inside ``forward`` (transformers'
    mask expansion for combined mask functions), applied to a Linear's output. ``reads_input``:
    the indices are offset by a value computed from the input (zero), so the mask reads it."""

    def __init__(self, d=3, c=3, reads_input=False):
        super().__init__()
        self.fc = nn.Linear(d, c)
        self.reads_input = reads_input

    def forward(self, x):
        if not isinstance(x.shape[-1], int):  # pragma: no cover - fx gives a proxy: make_fx traces
            raise TypeError
        rows = torch.arange(x.shape[1])
        if self.reads_input:
            rows = rows + (x[0, 0, 0] * 0).long()
        mask = torch.vmap(torch.vmap(lambda a, b: (a >= b) | a.new_ones((), dtype=torch.bool), in_dims=(None, 0)),
                          in_dims=(0, None))(rows, rows)
        return (self.fc(x) * mask.to(x.dtype).sum(-1, keepdim=True)).sum(1)


def test_torch_vmap_mask_inside_forward_is_a_constant():
    """A mask the model builds with its own ``torch.vmap`` from index ranges alone (neither
    inputs nor parameters) runs outside the ATen trace: a constant of the graph, exact."""
    model = VmappedMask().to(DT)
    X, y = _data((2, 4, 3))
    lossfn = nn.CrossEntropyLoss()
    qs = curvature(model, lossfn, exact_extensions(hessian=False))(X, y)
    assert_matches(qs, reference(model, lossfn, X, y, hessian=False))


def test_torch_vmap_inside_forward_is_refused_by_name():
    """make_fx(pre_dispatch=True) records the ops inside a model's own ``torch.vmap`` on batched
    tensors that do not outlive it: where the vmapped function reads the input, the ATen trace
    fails naming torch.vmap (never functorch's replay error), so a second-order extension is
    refused with that reason."""
    model = VmappedMask(reads_input=True).to(DT)
    X, y = _data((2, 4, 3))
    with pytest.raises(CurvatureError, match="torch.vmap"):
        curvature(model, nn.CrossEntropyLoss(), [DiagGGNExact()])(X, y)
