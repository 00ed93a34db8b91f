"""Bad input is refused with a clear ValueError/TypeError naming the culprit."""

import re

import pytest
import torch
from torch import nn

import curvlib
from curvlib import curvature
from curvlib.extensions import BatchGrad, BatchL2Grad, Variance
from oracles.checks import check_first_order

DT = torch.float64


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)).to(DT)


X = torch.randn(5, 4, dtype=DT)
Y = torch.randint(0, 3, (5,))


def test_error_type_is_exported_and_a_value_error():
    assert issubclass(curvlib.CurvatureError, ValueError)
    assert issubclass(curvlib.CurvatureTypeError, TypeError)


@pytest.mark.parametrize(
    "y, match",
    [
        (torch.randint(0, 3, (5, 2)), r"y has shape \(5, 2\).*must have shape \(5,\)"),
        (torch.rand(5, dtype=DT), r"class probabilities must have the model output's shape \(5, 3\)"),
        (torch.rand(5, 3), r"class probabilities y have dtype torch.float32.*float64"),
        (torch.tensor([True, False, True, True, False]), r"class indices \(an integer dtype\).*torch.bool"),
        (torch.tensor([0, 1, 2, 3, 0]), r"class index 3, outside \[0, 2\]"),
        (torch.tensor([0, 1, -1, 2, 0]), r"class index -1.*ignore_index=-100"),
        (torch.randint(0, 3, (4,)), r"batch size 5"),
    ],
)
def test_cross_entropy_target_errors(y, match):
    f = curvature(_mlp(), nn.CrossEntropyLoss(), [BatchGrad()])
    with pytest.raises((ValueError, TypeError), match=match):
        f(X, y)


def test_mse_target_shape_and_dtype():
    f = curvature(_mlp(), nn.MSELoss(), [BatchGrad()])
    with pytest.raises(ValueError, match=r"MSELoss: y has shape \(5, 2\).*\(5, 3\)"):
        f(X, torch.randn(5, 2, dtype=DT))
    with pytest.raises(TypeError, match=r"MSELoss needs floating-point targets.*int64"):
        f(X, torch.randint(0, 3, (5, 3)))
    with pytest.raises(TypeError, match=r"dtype torch.float32.*float64"):
        f(X, torch.randn(5, 3))


def test_bce_target_shape():
    f = curvature(_mlp(), nn.BCEWithLogitsLoss(), [BatchGrad()])
    with pytest.raises(ValueError, match=r"BCEWithLogitsLoss: y has shape"):
        f(X, torch.rand(5, dtype=DT))


@pytest.mark.parametrize(
    "lossfn, match",
    [
        (nn.CrossEntropyLoss(reduction="none"), r"reduction='none'.*Use reduction='sum' \(or 'mean'\)"),
        (nn.MSELoss(reduction="none"), r"MSELoss\(reduction='none'\)"),
        (nn.NLLLoss(reduction="none"), r"NLLLoss\(reduction='none'\)"),
        (nn.GaussianNLLLoss(), r"GaussianNLLLoss needs 3 arguments \(input, target, var\).*lossfn\(output, y\)"),
        (lambda o, y, w: o.sum(), r"needs 3 arguments"),
        ("mse", r"lossfn must be a loss module instance or a function"),
        (nn.MSELoss, r"lossfn must be a loss module instance"),
    ],
)
def test_unsupported_losses(lossfn, match):
    with pytest.raises((ValueError, TypeError), match=match):
        curvature(_mlp(), lossfn, [BatchGrad()])


def test_not_an_extension():
    with pytest.raises(TypeError, match=r"'grad_batch'.*not a curvlib extension"):
        curvature(_mlp(), nn.CrossEntropyLoss(), ["grad_batch"])
    with pytest.raises(TypeError, match=r"class BatchGrad, not an instance"):
        curvature(_mlp(), nn.CrossEntropyLoss(), [BatchGrad])
    with pytest.raises(TypeError, match=r"list or tuple"):
        curvature(_mlp(), nn.CrossEntropyLoss(), {BatchGrad()})


def test_base_classes_are_refused():
    from curvlib.extensions import Extension, SecondOrder

    for base in (Extension(), SecondOrder()):
        with pytest.raises(TypeError, match=r"base class"):
            curvature(_mlp(), nn.CrossEntropyLoss(), [base])


def test_duplicate_extension_names():
    with pytest.raises(ValueError, match=r"same name 'variance'"):
        curvature(_mlp(), nn.CrossEntropyLoss(), [Variance(), BatchL2Grad(), Variance()])


def test_model_not_a_module():
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module"):
        curvature(lambda x: x, nn.CrossEntropyLoss(), [BatchGrad()])


def test_params_unknown_name_and_wrong_shape():
    model = _mlp()
    f = curvature(model, nn.CrossEntropyLoss(), [BatchGrad()])
    with pytest.raises(ValueError, match=r"'1.weight' that is not a parameter.*'0.weight'"):
        f(X, Y, params={"1.weight": torch.zeros(5, 4, dtype=DT)})
    with pytest.raises(ValueError, match=r"params\['0.weight'\] has shape \(4, 5\).*\(5, 4\)"):
        f(X, Y, params={"0.weight": torch.zeros(4, 5, dtype=DT)})
    with pytest.raises(TypeError, match=r"params must be a dict"):
        f(X, Y, params=[torch.zeros(5, 4)])
    with pytest.raises(TypeError, match=r"params\['0.weight'\] must be a tensor"):
        f(X, Y, params={"0.weight": 1.0})


def test_bad_X():
    f = curvature(_mlp(), nn.CrossEntropyLoss(), [BatchGrad()])
    with pytest.raises(TypeError, match=r"X must be a torch.Tensor"):
        f([[1.0]], Y)


def test_refused_before_any_work():
    """A bad target is refused before the model runs (no forward call at all)."""
    calls = []
    model = _mlp()
    f = curvature(model, nn.CrossEntropyLoss(), [BatchGrad()])
    f(X, Y)  # plan once
    handle = model[1].register_forward_hook(lambda *a: calls.append(1))  # ReLU runs as a module
    try:
        with pytest.raises(ValueError):
            f(X, torch.tensor([0, 1, 2, 9, 0]))
    finally:
        handle.remove()
    assert calls == []


def test_layer_on_merged_batch_is_exact():
    """``[N, 4] -> [2N, 2]`` before a Linear (the batch merged with features, batch-major):
    the planner splits it off around the layer, not refused (tests/_plan/test_merged_batch.py)."""

    class Merge(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 3)

        def forward(self, x):  # [N, 4] -> [2N, 2]: batch merged with features
            return self.fc(x.reshape(-1, 2)).reshape(x.shape[0], -1)

    check_first_order(Merge().to(DT), nn.MSELoss(), X, torch.randn(5, 6, dtype=DT))


class _DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        return {"logits": self.lin(x), "hidden": x}


class _TupleOut(_DictOut):
    def forward(self, x):
        if x.sum() > 1e9:  # data-dependent: run untraced, the eager path's refusal
            x = x * 2
        return self.lin(x), x


@pytest.mark.parametrize("model, entry", [(_DictOut(), "['logits']"), (_TupleOut(), "[0]")])
def test_container_output_takes_the_logits_and_says_so(model, entry):
    """A dict, tuple, dataclass or ModelOutput: the loss takes the entry named ``logits``, else the
    first tensor (unless ``curvature(..., output=)`` names one), and curvlib says which, once."""
    X, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    with pytest.warns(UserWarning, match=re.escape(entry)):
        qs = curvature(model, nn.CrossEntropyLoss(), [BatchGrad()])(X, y)
    assert qs["grad_batch"]["lin.weight"].shape == (4, 2, 3)
    torch.testing.assert_close(qs["loss"], nn.CrossEntropyLoss()(model.lin(X), y))


def test_output_without_a_tensor_names_the_users_type_and_the_fix():
    class Named(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            return {"logits": self.lin(x), "hidden": x}

    X, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    with pytest.raises(curvlib.CurvatureError, match=r"returned dict \(entries: logits, hidden\): no tensor entry "
                                                     r"named 'scores'.*output=NAME"):
        curvature(Named(), nn.CrossEntropyLoss(), [BatchGrad()], output="scores")(X, y)