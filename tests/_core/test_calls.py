"""One argument of a call, by position or keyword (``curvlib._core.calls.argument``)."""

import pytest
import torch
from torch import nn

from curvlib._core.calls import argument


def test_argument_by_position_keyword_or_default():
    """Positional wins where that many were passed; else the keyword; else the default; a
    required argument passed neither way is a ``KeyError``."""
    assert argument(("a", "b"), {"input": "k"}, 0, "input") == "a"
    assert argument(("a",), {"hx": "h"}, 1, "hx") == "h"
    assert argument((), {"input": "k"}, 0, "input") == "k"
    assert argument(("a",), {}, 1, "hx", None) is None
    assert argument((), {}, 0, "input", 3) == 3
    with pytest.raises(KeyError):
        argument((), {}, 0, "input")


@pytest.mark.parametrize("by_keyword", [False, True])
def test_layer_called_with_its_input_by_keyword(by_keyword):
    """A Linear and an RNN called as ``m(x)`` and as ``m(input=x)`` give the same individual
    gradients (their forwards read the input through :func:`argument`)."""
    from curvlib import curvature
    from curvlib.extensions import BatchGrad

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.lin = nn.RNN(3, 4, batch_first=True), nn.Linear(4, 2)

        def forward(self, x):
            out, _ = self.rnn(input=x) if by_keyword else self.rnn(x)
            h = out[:, -1]
            return self.lin(input=h) if by_keyword else self.lin(h)

    torch.manual_seed(0)
    model = Net().double()
    X, y = torch.randn(5, 2, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    got = curvature(model, nn.CrossEntropyLoss(reduction="sum"), [BatchGrad()])(X, y)["grad_batch"]
    for n in range(X.shape[0]):  # the oracle: one plain backward per sample
        model.zero_grad()
        nn.functional.cross_entropy(model(X[n:n + 1]), y[n:n + 1], reduction="sum").backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(got[name][n], p.grad)


def test_hessian_residuals_of_layers_called_by_keyword():
    """The Hessian's residuals of a LayerNorm and an RNN called with ``input=`` (and ``hx=``)
    read the same arguments as when called positionally: equal Hessian diagonals."""
    from curvlib import curvature
    from curvlib.extensions import DiagHessian

    class Net(nn.Module):
        def __init__(self, by_keyword):
            super().__init__()
            self.by_keyword = by_keyword
            self.rnn, self.norm, self.lin = nn.RNN(3, 4, batch_first=True), nn.LayerNorm(4), nn.Linear(4, 2)
            self.init = nn.Linear(3, 4)

        def forward(self, x):
            h0 = torch.tanh(self.init(x[:, 0])).unsqueeze(0)  # an initial state from the input
            out, _ = self.rnn(input=x, hx=h0) if self.by_keyword else self.rnn(x, h0)
            h = self.norm(input=out[:, -1]) if self.by_keyword else self.norm(out[:, -1])
            return self.lin(h)

    X, y = torch.randn(5, 2, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    got = {}
    for by_keyword in (False, True):
        torch.manual_seed(0)
        model = Net(by_keyword).double()
        got[by_keyword] = curvature(model, nn.CrossEntropyLoss(), [DiagHessian()])(X, y)["diag_h"]
    for name in got[False]:
        torch.testing.assert_close(got[True][name], got[False][name], rtol=1e-12, atol=1e-14)
