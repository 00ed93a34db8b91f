"""Models and inputs that used to break curvlib, against brute-force float64 oracles.

* spectral norm in training mode (its ``u``/``v`` buffers must not move);
* KFRA through in-place activations;
* (custom ``autograd.Function``s: :mod:`test_custom_function`);
* ``Variance`` with one sample;
* hooked and BackPACK-extended models;
* ``X`` as a dict / tuple / ``UserDict`` of tensors.
"""

from __future__ import annotations

import copy
import warnings
from collections import UserDict

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.nn.utils import spectral_norm as hooked_spectral_norm
from torch.nn.utils.parametrizations import spectral_norm

from curvlib import CurvatureError, curvature
from curvlib.extensions import (
    GGNMP, KFLR, KFRA, PCHMP, BatchDiagHessian, BatchGrad, DiagGGNExact, DiagHessian, SumGradSquared, Variance,
)

from oracles.checks import _assert_same_state, state_snapshot
from oracles.first_order import first_order_reference
from oracles.reference import assert_close, assert_matches, assert_same, exact_extensions, kflr_map, reference
from oracles.second_order import kfra_reference
from oracles.on_device import seeded

DT = torch.float64


def _data(n=5, d=3, seed=1, classes=2):
    g = seeded(seed)
    return torch.randn(n, d, generator=g, dtype=DT), torch.randint(0, classes, (n,), generator=g)


def _shapes(model):
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------- spectral norm


def _spectral(which: str, frozen: bool = False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    (spectral_norm if which == "parametrization" else hooked_spectral_norm)(model[0])
    if frozen:
        model[0].requires_grad_(False)
    return model.train()


def _spectral_oracle_model(model, X):
    """The weight of one ``model(X)`` from the current state: ``W / σ`` with ``u, v`` after
    one power iteration, held constant (as torch does); then those ``u, v`` fixed (eval)."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        ref(X)
    ref[0].eval()
    if hasattr(ref[0], "parametrizations"):
        ref[0].parametrizations.weight[0].eval()
    return ref


@pytest.mark.parametrize("which", ["parametrization", "hook"])
@pytest.mark.parametrize("frozen", [False, True])
def test_spectral_norm_in_training_mode(which, frozen):
    """Buffers (``_u``, ``_v``) and everything else unchanged after calls and product
    evaluations; results equal the oracle from one ``model(X)`` of the current state,
    the same on every call. With the layer trainable, the extensions that run it under
    forward mode / vmap over its weight are refused (torch.func cannot run the in-place
    power iteration); frozen, they run."""
    model = _spectral(which, frozen)
    X, y = _data()
    before = state_snapshot(model)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    assert any(k.endswith(("_u", "weight_u")) for k in buffers)
    exts = exact_extensions(hessian=frozen)
    if not frozen:
        exts = [e for e in exts if e.name != "ggnmp"]
    f = curvature(model, nn.CrossEntropyLoss(), exts)
    attrs = {k: v for k, v in vars(model[0]).items() if isinstance(v, torch.Tensor)}  # (the hook's module.weight)
    first, second = f(X, y), f(X, y)
    assert all(vars(model[0])[k] is v for k, v in attrs.items()), "a tensor attribute was replaced"
    copy.deepcopy(model)  # (a torch.func wrapper left in module.weight could not be copied)
    assert_same(first, second, "two calls", _shapes(model))
    _assert_same_state(before, state_snapshot(model))
    assert all(torch.equal(buffers[k], v) for k, v in model.named_buffers())
    ref = reference(_spectral_oracle_model(model, X), nn.CrossEntropyLoss(), X, y, hessian=frozen, pchmp=False)
    assert_matches(first, ref, f"spectral norm ({which})")
    if not frozen:
        for ext in (GGNMP(), DiagHessian(), BatchDiagHessian(), PCHMP()):
            with pytest.raises(CurvatureError, match=rf"{type(ext).__name__} runs layer '0' .*training mode its forward "
                                                     r"updates buffers in place \(.*spectral.*\.eval\(\)"):
                curvature(model, nn.CrossEntropyLoss(), [ext])(X, y)
        assert all(torch.equal(buffers[k], v) for k, v in model.named_buffers())
        evaluated = _spectral_oracle_model(model, X)  # the advice: one step in training mode, then eval
        exts = [e for e in exact_extensions() if e.name != "pchmp"]
        assert_matches(curvature(evaluated, nn.CrossEntropyLoss(), exts)(X, y),
                       reference(evaluated, nn.CrossEntropyLoss(), X, y, pchmp=False), f"eval spectral norm ({which})")


# ----------------------------------------------------------------------------- KFRA, in-place


class FunctionalRelu(nn.Module):
    def forward(self, x):
        return F.relu(x, inplace=True)


class MethodElu(nn.Module):
    def forward(self, x):
        return F.elu_(x)


IN_PLACE = {
    "ReLU": (lambda: nn.ReLU(inplace=True), nn.ReLU),
    "ELU": (lambda: nn.ELU(inplace=True), nn.ELU),
    "SELU": (lambda: nn.SELU(inplace=True), nn.SELU),
    "LeakyReLU": (lambda: nn.LeakyReLU(0.1, inplace=True), lambda: nn.LeakyReLU(0.1)),
    "F.relu": (FunctionalRelu, nn.ReLU),
    "F.elu_": (MethodElu, nn.ELU),
}


@pytest.mark.parametrize("act", sorted(IN_PLACE))
@settings(max_examples=2)
@given(n=st.integers(1, 5), reduction=st.sampled_from(["mean", "sum"]), seed=st.integers(0, 2**16))
def test_kfra_with_in_place_activations(act, n, reduction, seed):
    """KFRA (and the Hessian diagonal) of the in-place chain equal the out-of-place chain's,
    and KFRA equals the oracle (ELU/SELU were wrong: the Jacobian was taken at φ(a))."""
    inplace, twin = IN_PLACE[act]
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), inplace(), nn.Linear(4, 4), inplace(), nn.Linear(4, 2)).to(DT)
    plain = nn.Sequential(nn.Linear(3, 4), twin(), nn.Linear(4, 4), twin(), nn.Linear(4, 2)).to(DT)
    plain.load_state_dict(model.state_dict())
    X, y = _data(n, seed=seed)
    lossfn = nn.CrossEntropyLoss(reduction=reduction)
    got = curvature(model, lossfn, [KFRA(), KFLR(), DiagHessian()])(X, y)
    want = curvature(plain, lossfn, [KFRA(), KFLR(), DiagHessian()])(X, y)
    assert_same(got, want, f"in-place {act}", rtol=1e-12)  # (ELU's in-place backward uses its output)
    ref = kfra_reference(plain, lossfn, X, y)
    for name, factors in ref.items():
        for i, (a, b) in enumerate(zip(got["kfra"][name], factors)):
            assert_close(a, b, f"kfra[{name}][{i}] ({act})")


# ----------------------------------------------------------------------------- Variance, N = 1


@pytest.mark.parametrize("chunk", [None, 1, 2])
@pytest.mark.parametrize("n", [1, 4])
def test_variance_non_negative_and_exact(n, chunk):
    """``N = 1``: ``g² − g²`` is zero, not slightly negative (square roots stay real); otherwise
    the oracle. Also with ``batch_chunk_size``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).to(DT)
    for scale in (1.0, 1e3):
        X, y = _data(n)
        X = X * scale
        qs = curvature(model, nn.CrossEntropyLoss(), [Variance(), SumGradSquared()], batch_chunk_size=chunk)(X, y)
        ref = first_order_reference(model, nn.CrossEntropyLoss(), X, y)
        for name, v in qs["variance"].items():
            assert (v >= 0).all(), f"variance[{name}] has negative entries (N={n})"
            assert not v.sqrt().isnan().any()
            assert_close(v, ref["variance"][name].clamp(min=0), f"variance[{name}]", atol=1e-12)


# ----------------------------------------------------------------------------- hooks, BackPACK


def test_hooked_activation_modules_are_run_without_their_hooks():
    """Forward and full backward hooks on the activations: the Hessian family (which takes
    their second derivative), KFRA and the products equal the un-hooked model's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Sigmoid(), nn.Linear(4, 2)).to(DT)
    plain = copy.deepcopy(model)
    calls = []
    model[1].register_forward_hook(lambda m, i, o: o * 2)
    model[3].register_full_backward_hook(lambda m, gi, go: calls.append(1))
    X, y = _data()
    with pytest.warns(UserWarning, match=r"does not run the forward hooks of '1' \(Tanh\)"):
        f = curvature(model, nn.CrossEntropyLoss(), exact_extensions(kfra=True))
    assert_same(f(X, y), curvature(plain, nn.CrossEntropyLoss(), exact_extensions(kfra=True))(X, y), "hooks",
                _shapes(model))
    assert calls == []


def test_backpack_extended_model():
    """After ``backpack.extend`` and a BackPACK backward (its hooks and stored inputs on
    every module), curvlib gives the un-extended model's results, Linear keeps its rule
    (KFLR, KFRA), and no hook warning is raised."""
    backpack = pytest.importorskip("backpack")
    from backpack.extensions import KFLR as BackpackKFLR, BatchGrad as BackpackBatchGrad

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    model, lossfn = backpack.extend(copy.deepcopy(plain)), backpack.extend(nn.CrossEntropyLoss())
    X, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with backpack.backpack(BackpackKFLR(), BackpackBatchGrad()):
            lossfn(model(X), y).backward()
    exts = exact_extensions(kflr=True, kfra=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        qs = curvature(model, lossfn, exts)(X, y)
    assert_same(qs, curvature(plain, nn.CrossEntropyLoss(), exts)(X, y), "extended", _shapes(plain))
    for name in ("0.weight", "2.bias"):
        for a, b in zip(qs["kflr"][name], getattr(dict(model.named_parameters())[name], "kflr")):
            assert_close(a, b, f"kflr[{name}] vs BackPACK's")
    assert_matches(qs, reference(plain, nn.CrossEntropyLoss(), X, y, kflr=kflr_map(plain), kfra=True), "extended")


# ----------------------------------------------------------------------------- dict / tuple inputs


class DictNet(nn.Module):
    """A Hugging Face-style model: one mapping argument (features and token ids)."""

    def __init__(self):
        super().__init__()
        self.a, self.emb, self.b = nn.Linear(3, 4), nn.Embedding(6, 2), nn.Linear(6, 2)

    def core(self, x, ids):
        return self.b(torch.cat([torch.tanh(self.a(x)), self.emb(ids)], 1))

    def forward(self, batch):
        return self.core(batch["x"], batch["ids"])


class TupleNet(DictNet):
    def forward(self, batch):
        x, ids = batch
        return self.core(x, ids)


class TensorNet(DictNet):
    """The same model on one tensor ``[x, ids]`` (ids as floats, turned into indices)."""

    def forward(self, z):
        return self.core(z[:, :3], z[:, 3].long())


@pytest.mark.parametrize("container", ["dict", "UserDict", "tuple", "list"])
def test_mapping_and_tuple_inputs(container):
    """Every extension equals the tensor-input model's (and the oracle); batch chunks
    work; tensors with different batch sizes are refused."""
    torch.manual_seed(0)
    dict_model = (TupleNet if container in ("tuple", "list") else DictNet)().to(DT)
    tensor_model = TensorNet().to(DT)
    tensor_model.load_state_dict(dict_model.state_dict())
    X, y = _data(5)
    ids = torch.randint(0, 6, (5,), generator=seeded(2))
    inp = {"dict": lambda: {"x": X, "ids": ids}, "UserDict": lambda: UserDict(x=X, ids=ids),
           "tuple": lambda: (X, ids), "list": lambda: [X, ids]}[container]()
    Z = torch.cat([X, ids[:, None].to(DT)], 1)
    exts = exact_extensions()
    got = curvature(dict_model, nn.CrossEntropyLoss(), exts)(inp, y)
    assert_same(got, curvature(tensor_model, nn.CrossEntropyLoss(), exts)(Z, y), container, _shapes(dict_model))
    assert_matches(got, reference(tensor_model, nn.CrossEntropyLoss(), Z, y, pchmp=False), container)
    chunked = curvature(dict_model, nn.CrossEntropyLoss(), [BatchGrad(), DiagGGNExact(), Variance()], batch_chunk_size=2)
    c = chunked(inp, y)
    for key in ("grad_batch", "diag_ggn_exact", "variance", "grad"):
        for name, v in c[key].items():
            assert_close(v, got[key][name], f"chunked {key}[{name}]")
    short = {"dict": lambda: {"x": X, "ids": ids[:4]}, "UserDict": lambda: UserDict(x=X, ids=ids[:4]),
             "tuple": lambda: (X, ids[:4]), "list": lambda: [X, ids[:4]]}[container]()
    with pytest.raises(CurvatureError, match=r"The tensors of X have different sizes in dim 0 .*\[5, 3\].*\[4\]"):
        curvature(dict_model, nn.CrossEntropyLoss(), [BatchGrad()])(short, y)
