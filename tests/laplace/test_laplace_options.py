"""Options laplace-torch passes to curvlib's backends: honoured, or refused by name.

laplace-torch forwards ``backend_kwargs`` to the constructor and
``asdl_fisher_kwargs`` to ``diag``/``kron``; its curvlinops backend forwards
``mc_samples`` and ``kfac_approx`` to curvlinops. References: laplace's
curvlinops and BackPACK backends, and curvlib's exact curvature.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from oracles.on_device import seeded

pytest.importorskip(
    "laplace",
    reason="optional dependency laplace-torch is not installed "
    "(pip install --no-deps laplace-torch==0.3 and its requirements)",
)

from laplace import Laplace
from laplace.curvature import CurvlinopsGGN

from curvlib import CurvatureError, CurvatureTypeError
from curvlib.laplace import CurvlibEF, CurvlibGGN
from oracles.laplace_torch import C, DT, LIKELIHOODS, N_DATA, close, compare_laplace, data, fitted, loader, mlp

pytestmark = pytest.mark.filterwarnings(
    "ignore:Full backward hook:UserWarning",
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning",
    "ignore:By default `link_approx`:UserWarning",
)

ARGS = {"diag": lambda X, y: (X, y), "full": lambda X, y: (X, y), "kron": lambda X, y: (X, y, 3 * N_DATA)}


def conv_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(2, 3, 2), nn.Tanh(), nn.Flatten(), nn.Linear(12, C)).to(DT)


class SequenceModel(nn.Module):
    """A Linear layer shared by the 4 positions of each sample, then mean pooling."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 5)
        self.out = nn.Linear(5, C)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)).mean(1))


def sequence_model(seed=0):
    torch.manual_seed(seed)
    return SequenceModel().to(DT)


def kron_matrix(result):
    return result[1].to_matrix()


# ------------------------------------------------------------ unknown keywords
@pytest.mark.parametrize("method", ["diag", "full", "kron"])
@pytest.mark.parametrize("backend_cls", [CurvlibGGN, CurvlibEF])
def test_unknown_method_keywords_are_refused(backend_cls, method):
    X, y = data("classification")
    backend = backend_cls(mlp(), "classification")
    accepted = {"diag": "N, mc_samples", "full": "N, mc_samples", "kron": "mc_samples, kfac_approx"}[method]
    with pytest.raises(CurvatureTypeError, match=rf"{backend_cls.__name__}\.{method}: unknown keyword "
                       rf"argument 'damping'; accepted: {accepted}\."):
        getattr(backend, method)(*ARGS[method](X, y), damping=0.1)


def test_unknown_constructor_keywords_are_refused():
    with pytest.raises(CurvatureTypeError, match=r"CurvlibGGN\(\.\.\.\): unknown keyword argument "
                       r"'mc_samples'; accepted: .*stochastic, num_samples"):
        CurvlibGGN(mlp(), "classification", mc_samples=3)
    with pytest.raises(CurvatureTypeError, match=r"CurvlibEF\(\.\.\.\): unknown keyword argument 'stochastic'"):
        CurvlibEF(mlp(), "classification", stochastic=True)
    with pytest.raises(CurvatureError, match=r"num_samples=0"):
        CurvlibGGN(mlp(), "classification", stochastic=True, num_samples=0)
    la = Laplace(mlp(), "classification", "all", "diag", backend=CurvlibGGN,
                 backend_kwargs={"damping": 1.0})  # laplace builds the backend lazily
    with pytest.raises(CurvatureTypeError, match="'damping'"):
        la.fit(loader("classification"))


# ------------------------------------------------------------------ mc_samples
@pytest.mark.parametrize("method", ["diag", "full", "kron"])
@pytest.mark.parametrize("backend_cls", [CurvlibGGN, CurvlibEF])
def test_exact_backends_take_one_sample_only(backend_cls, method):
    """As curvlinops' KFAC: mc_samples != 1 is an error unless the Fisher is sampled."""
    X, y = data("regression")
    backend = backend_cls(mlp(), "regression")
    if backend_cls is CurvlibGGN:
        close(kron_matrix(backend.kron(X, y, N_DATA, mc_samples=1)) if method == "kron"
              else backend.full(X, y, mc_samples=1)[1],
              kron_matrix(backend.kron(X, y, N_DATA)) if method == "kron" else backend.full(X, y)[1])
    with pytest.raises(CurvatureError, match=rf"\.{method}\(mc_samples=3\): mc_samples applies to the "
                       r"Monte-Carlo Fisher \(CurvlibGGN\(\.\.\., stochastic=True\)\)"):
        getattr(backend, method)(*ARGS[method](X, y), mc_samples=3)
    with pytest.raises(ValueError, match="mc_samples"):  # laplace's curvlinops backend agrees
        CurvlinopsGGN(mlp(), "regression").kron(X, y, N_DATA, mc_samples=3)


@pytest.mark.parametrize("method", ["diag", "full", "kron"])
def test_mc_samples_per_call_overrides_num_samples(method):
    X, y = data("classification")

    def run(num_samples, **kwargs):
        backend = CurvlibGGN(mlp(), "classification", stochastic=True, num_samples=num_samples,
                             generator=seeded(4))
        out = getattr(backend, method)(*ARGS[method](X, y), **kwargs)
        return out[1].to_matrix() if method == "kron" else out[1]

    close(run(1, mc_samples=7), run(7))
    assert not torch.allclose(run(1), run(7))
    with pytest.raises(CurvatureError, match=r"mc_samples=0\): mc_samples must be a positive int"):
        run(1, mc_samples=0)


@pytest.mark.parametrize("likelihood", LIKELIHOODS)
def test_more_mc_samples_approach_kflr(likelihood):
    """laplace's own check: kron with 1 sample is farther from the exact factors than with many."""
    X, y = data(likelihood)
    exact = kron_matrix(CurvlibGGN(mlp(), likelihood).kron(X, y, N_DATA))

    def error(samples, seed):
        backend = CurvlibGGN(mlp(), likelihood, stochastic=True, generator=seeded(seed))
        return (kron_matrix(backend.kron(X, y, N_DATA, mc_samples=samples)) - exact).norm() / exact.norm()

    assert error(3000, 1) < 0.1
    assert all(error(3000, s) < error(1, s) for s in range(3))


# ----------------------------------------------------------------- kfac_approx
@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("likelihood", LIKELIHOODS)
def test_kfac_approx_without_weight_sharing_matches_curvlinops(likelihood, approx):
    """Without positions sharing a weight, 'expand' and 'reduce' are both curvlib's KFLR."""
    X, y = data(likelihood)
    loss, kron = CurvlibGGN(mlp(), likelihood).kron(X, y, 3 * N_DATA, kfac_approx=approx)
    ref_loss, ref = CurvlinopsGGN(mlp(), likelihood).kron(X, y, 3 * N_DATA, kfac_approx=approx)
    close(loss, ref_loss)
    for F, G in zip(kron.kfacs, ref.kfacs):
        for a, b in zip(F, G):
            close(a, b)
    close(kron.to_matrix(), kron_matrix(CurvlibGGN(mlp(), likelihood).kron(X, y, 3 * N_DATA)))


def test_kfac_approx_through_laplace_matches_curvlinops():
    kw = {"asdl_fisher_kwargs": {"kfac_approx": "reduce", "mc_samples": 1}}
    la = fitted(mlp, "classification", "kron", CurvlibGGN, **kw)
    ref = fitted(mlp, "classification", "kron", CurvlinopsGGN, **kw)
    compare_laplace(la, ref, "classification")


@pytest.mark.parametrize("approx", [None, "expand", "reduce"])
@pytest.mark.parametrize("model_fn, X", [
    (conv_model, torch.randn(5, 2, 3, 3, dtype=DT)),
    (sequence_model, torch.randn(5, 4, 3, dtype=DT)),
], ids=["conv", "sequence"])
def test_kfac_approx_with_weight_sharing_matches_curvlinops(model_fn, X, approx):
    """Where positions share a weight: laplace's default ('expand', as its curvlinops
    backend) and both approximations, from curvlib's KFLR(kfac_approx=...)."""
    y = torch.randint(0, C, (5,), generator=seeded(0))
    kw = {} if approx is None else {"kfac_approx": approx}
    loss, kron = CurvlibGGN(model_fn(), "classification").kron(X, y, 10, **kw)
    ref_loss, ref = CurvlinopsGGN(model_fn(), "classification").kron(X, y, 10, **kw)
    close(loss, ref_loss)
    for F, G in zip(kron.kfacs, ref.kfacs):
        for a, b in zip(F, G):
            close(a, b)


def test_bad_kfac_approx_values_are_refused():
    X, y = data("classification")
    backend = CurvlibGGN(mlp(), "classification")
    with pytest.raises(CurvatureError, match=r"kfac_approx='mean'\) is not supported; use one of "
                       r"\('expand', 'reduce'\)"):
        backend.kron(X, y, N_DATA, kfac_approx="mean")
    with pytest.raises(CurvatureTypeError, match=r"CurvlibGGN\.diag: unknown keyword argument 'kfac_approx'"):
        backend.diag(X, y, kfac_approx="expand")
