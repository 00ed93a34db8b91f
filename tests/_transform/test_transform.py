"""The transform itself: purity, params=, vmap composition, graphs and the generic rule."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st
from torch import nn
from torch.func import stack_module_state, vmap

from curvlib import curvature
from curvlib.extensions import HMP, KFLR, BatchGrad, BatchL2Grad, DiagGGNExact, Variance

from oracles.checks import check_first_order
from oracles.first_order import assert_close_dicts, first_order_reference
from oracles.on_device import seeded

DT = torch.float64


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)


def _data(n=5, seed=1):
    g = seeded(seed)
    return torch.randn(n, 4, generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g)


def test_result_layout_and_loss():
    model, (X, y) = _mlp(), _data()
    qs = curvature(model, nn.CrossEntropyLoss(), [BatchGrad()])(X, y)
    assert set(qs) == {"loss", "grad", "grad_batch"}
    assert type(qs) is dict and type(qs["grad"]) is dict
    assert list(qs["grad"]) == [n for n, _ in model.named_parameters()]
    assert qs["loss"].dim() == 0
    torch.testing.assert_close(qs["loss"], nn.CrossEntropyLoss()(model(X), y))
    assert not qs["loss"].requires_grad


def test_frozen_parameters_are_left_out():
    model, (X, y) = _mlp(), _data()
    model[0].bias.requires_grad_(False)
    qs = curvature(model, nn.CrossEntropyLoss(), [BatchGrad(), Variance()])(X, y)
    assert "0.bias" not in qs["grad"] and "0.bias" not in qs["grad_batch"]
    ref = first_order_reference(model, nn.CrossEntropyLoss(), X, y)
    assert_close_dicts(qs["grad_batch"], ref["grad_batch"])


def test_params_substitution_gives_quantities_at_those_params():
    model, (X, y) = _mlp(), _data()
    other = _mlp(seed=7)
    params = {n: p.detach() for n, p in other.named_parameters() if n.startswith("2.")}
    qs = curvature(model, nn.CrossEntropyLoss(), [BatchGrad()])(X, y, params=params)
    assert list(qs["grad_batch"]) == ["2.weight", "2.bias"]
    mixed = _mlp()
    mixed[2].load_state_dict(other[2].state_dict())
    ref = first_order_reference(mixed, nn.CrossEntropyLoss(), X, y, names=["2.weight", "2.bias"])
    assert_close_dicts(qs["grad_batch"], ref["grad_batch"])


def test_vmap_over_stacked_ensemble():
    """f is a pure function of params: vmap over stack_module_state works for BatchGrad."""
    models = [_mlp(seed=s) for s in range(3)]
    X, y = _data()
    params, _ = stack_module_state(models)
    f = curvature(models[0], nn.CrossEntropyLoss(), [BatchGrad(), BatchL2Grad()])
    batched = vmap(lambda p: f(X, y, params=p))(params)
    assert batched["grad_batch"]["0.weight"].shape == (3, 5, 5, 4)
    for i, m in enumerate(models):
        ref = first_order_reference(m, nn.CrossEntropyLoss(), X, y)
        assert_close_dicts({k: v[i] for k, v in batched["grad_batch"].items()}, ref["grad_batch"])
        assert_close_dicts({k: v[i] for k, v in batched["batch_l2"].items()}, ref["batch_l2"])
        torch.testing.assert_close(batched["loss"][i], nn.CrossEntropyLoss()(m(X), y))


class Residual(nn.Module):
    """Functional ops, a skip connection, a gate and a module used twice."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.block = nn.Linear(6, 6)
        self.gate = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = F.relu(self.inp(x))
        h = h + torch.tanh(self.block(h))  # skip connection
        h = h * torch.sigmoid(self.gate(h))  # gate
        h = self.block(h).view(h.shape[0], -1)  # shared module, second use
        return self.head(F.gelu(h) * 0.5)


def test_residual_shared_and_functional_ops():
    torch.manual_seed(0)
    model = Residual().to(DT)
    X, y = _data(6)
    check_first_order(model, nn.CrossEntropyLoss(), X, y)


def test_shared_module_statelessness():
    """functional_call on a model holding a submodule twice must not leave tensors behind."""
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.Linear(4, 3)).to(DT)
    X, y = _data()
    params_before = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    check_first_order(model, nn.CrossEntropyLoss(), X, y)
    for n, p in model.named_parameters(remove_duplicate=False):
        assert p is params_before[n] and isinstance(p, nn.Parameter)


class TiedAutoencoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(5, 3)
        self.dec = nn.Linear(3, 5)
        self.dec.weight = nn.Parameter(self.enc.weight.detach().t().clone())

    def forward(self, x):
        return self.dec(torch.tanh(self.enc(x)))


class TiedSameParameter(nn.Module):
    """One Parameter held by two Linear modules (weight tying)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def test_tied_parameter_sums_uses_before_squaring():
    torch.manual_seed(0)
    model = TiedSameParameter().to(DT)
    X = torch.randn(5, 4, dtype=DT)
    qs = check_first_order(model, nn.MSELoss(), X, torch.randn(5, 4, dtype=DT))
    assert "b.weight" not in qs["grad"]  # canonical name only


class CustomScale(nn.Module):
    """A parametrized module without a hand-written rule (generic torch.func rule)."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(d))
        self.shift = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return torch.tanh(x * self.scale) + self.shift**2


class RootOwnsParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4))
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(torch.tanh(x @ self.w.t()))


def test_generic_rule_for_unknown_module():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), CustomScale(3), nn.Linear(3, 2)).to(DT)
    X = torch.randn(5, 4, dtype=DT)
    check_first_order(model, nn.MSELoss(reduction="sum"), X, torch.randn(5, 2, dtype=DT))


def test_generic_rule_for_model_owning_parameters():
    torch.manual_seed(0)
    model = RootOwnsParameter().to(DT)
    X = torch.randn(5, 4, dtype=DT)
    check_first_order(model, nn.BCEWithLogitsLoss(), X, torch.rand(5, 2, dtype=DT))


@given(
    widths=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    act=st.sampled_from([nn.ReLU, nn.Tanh, nn.Sigmoid, nn.ELU, nn.SELU, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Softplus]),
    n=st.integers(1, 4),
    reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 1000),
)
def test_random_mlps(widths, act, n, reduction, seed):
    torch.manual_seed(seed)
    dims = [3, *widths, 4]
    layers = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [nn.Linear(a, b), act()]
    model = nn.Sequential(*layers[:-1]).to(DT)
    X = torch.randn(n, 3, dtype=DT)
    check_first_order(model, nn.CrossEntropyLoss(reduction=reduction), X, torch.randint(0, 4, (n,)))


def test_dropout_train_mode_differentiates_the_forward_mask():
    """In training mode, the dropout mask of the forward that ran is the one differentiated:
    the individual gradients still sum to the gradient of the returned loss."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3)).to(DT).train()
    X, y = _data()
    qs = curvature(model, nn.CrossEntropyLoss(), [BatchGrad()])(X, y)
    for k in qs["grad"]:
        torch.testing.assert_close(qs["grad_batch"][k].sum(0), qs["grad"][k])


def test_parametrized_linear_uses_the_generic_rule():
    from torch.nn.utils import parametrize

    class Positive(nn.Module):
        def forward(self, w):
            return w.exp()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).to(DT)
    parametrize.register_parametrization(model[0], "weight", Positive())
    X = torch.randn(5, 4, dtype=DT)
    check_first_order(model, nn.MSELoss(), X, torch.randn(5, 2, dtype=DT))


def test_hooks_are_not_run_and_a_warning_says_so():
    """User hooks are not part of the math: a forward and a full backward hook on a layer
    and a backward hook on the loss change nothing (the layer keeps its own rule: KFLR)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).to(DT)
    calls = []
    model[2].register_forward_hook(lambda m, i, o: o * 2.0)
    model[0].register_full_backward_hook(lambda m, gi, go: calls.append("backward"))
    lossfn = nn.MSELoss()
    lossfn.register_full_backward_hook(lambda m, gi, go: calls.append("loss"))
    X, y = torch.randn(5, 4, dtype=DT), torch.randn(5, 2, dtype=DT)
    plain = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).to(DT)
    plain.load_state_dict(model.state_dict())
    exts = [BatchGrad(), DiagGGNExact(), KFLR(), HMP()]
    with pytest.warns(UserWarning, match=r"does not run the forward hooks of '2' \(Linear\)"):
        f = curvature(model, lossfn, exts)
    qs, ref = f(X, y), curvature(plain, nn.MSELoss(), exts)(X, y)
    for key in ("grad", "grad_batch", "diag_ggn_exact"):
        assert_close_dicts(qs[key], ref[key], key)
    V = torch.randn(2, 3, 4, dtype=DT)
    torch.testing.assert_close(qs["hmp"]["0.weight"](V), ref["hmp"]["0.weight"](V))
    assert calls == []


class TiedDecoder(nn.Module):
    """The decoder reads the encoder's weight directly in forward (no module of its own)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(5, 3)
        self.dec = nn.Linear(3, 5)

    def forward(self, x):
        h = torch.tanh(self.enc(x))
        return F.linear(h, self.enc.weight.t(), self.dec.bias) + 0.1 * (h @ self.dec.weight.t()).sum(1, keepdim=True)


class RootParameterInForward(nn.Module):
    """The model owns a parameter and uses it in functional ops next to a module."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(torch.tanh(x * self.scale)) + self.scale.sum()


@pytest.mark.parametrize("make", [TiedDecoder, RootParameterInForward])
def test_parameters_read_directly_in_forward(make):
    torch.manual_seed(0)
    model = make().to(DT)
    X = torch.randn(5, 5 if make is TiedDecoder else 4, dtype=DT)
    out = model(X)
    check_first_order(model, nn.MSELoss(), X, torch.randn(out.shape, dtype=DT))


def test_functional_use_with_batch_not_in_dim0_is_exact():
    """A parameter read directly and applied to ``[T, N, I]`` (the batch in dim 1) runs in its own
    layout: first order equals the brute force."""
    class TimeMajor(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(3, 2)

        def forward(self, x):  # a parameter read directly, applied to [T, N, I]
            return (x.transpose(0, 1) @ self.w.weight.t()).transpose(0, 1).sum(1)

    g = seeded(0)
    check_first_order(TimeMajor().to(DT), nn.MSELoss(), torch.randn(4, 6, 3, generator=g, dtype=DT),
                      torch.randn(4, 2, generator=g, dtype=DT))


class BranchOnMapping(nn.Module):
    """Hugging Face style: the batch mapping as one argument, with a branch on its type."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))

    def forward(self, data):
        from collections.abc import Mapping

        x = data["x"] * data["scale"][0][:, None] if isinstance(data, Mapping) else data
        return self.net(x)


def test_mapping_input_takes_the_mapping_branch():
    """A dict X is traced as a dict, so ``isinstance(data, Mapping)`` holds in the graph too
    (tracing with a single proxy took the tensor branch); results equal the oracle's."""
    from collections import UserDict

    torch.manual_seed(0)
    model = BranchOnMapping().to(DT)
    X = torch.randn(5, 4, dtype=DT)
    scale = torch.full((5,), 2.0, dtype=DT)
    y = torch.randint(0, 3, (5,))
    exts = [BatchGrad(), DiagGGNExact()]
    for batch in ({"x": X, "scale": (scale,)}, UserDict(x=X, scale=(scale,))):
        qs = curvature(model, nn.CrossEntropyLoss(), exts)(batch, y)
        ref = curvature(model.net, nn.CrossEntropyLoss(), exts)(2.0 * X, y)
        for key in ("grad", "grad_batch", "diag_ggn_exact"):
            assert_close_dicts({k[4:]: v for k, v in qs[key].items()}, ref[key], key)
        torch.testing.assert_close(qs["loss"], nn.CrossEntropyLoss()(model(batch), y))


def test_plan_checks_once_per_plan(monkeypatch):
    """The checks of the plan alone (layers, sample mixing) run at the first call of each
    input signature; the targets are checked at every call."""
    import curvlib._plan.checks as checks

    calls = []
    real = checks.check_second_order
    monkeypatch.setattr(checks, "check_second_order", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    f = curvature(model, nn.CrossEntropyLoss(), [DiagGGNExact()])
    X, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    for _ in range(3):
        f(X, y)
    f(X[:4], y[:4])
    assert len(calls) == 2
    with pytest.raises(Exception, match="class index 7"):
        f(X, torch.tensor([0, 1, 2, 7, 0, 1]))
