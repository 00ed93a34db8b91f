"""CONTRIBUTING.md's two checklists, followed: a toy quantity and a toy layer family, each added
by its record alone, work end to end through ``curvlib.curvature`` against a brute force.

* The quantity ``SumAbsGrad``, ``Σ_n |g_n|`` per entry (``g_n`` the individual gradients, with
  the loss's reduction factor ``c``), is one frozen dataclass: its value from the individual
  gradients (``from_individual``) and how slices combine it (``Combine.SUM``: it carries ``c``).
* The family ``Scale`` (``y = w ⊙ x``) is one module, one rule and one ``Family`` record,
  registered with ``curvlib.rules.register``.

Nothing else in the package changes for either; each registration is undone afterwards.
"""

from dataclasses import dataclass
from typing import ClassVar, Optional

import pytest
import torch
from torch import Tensor, nn

from curvlib import curvature, rules
from curvlib._core.family import Family
from curvlib._core.site import Rule, Site
from curvlib.extensions import BatchGrad, DiagGGNExact, DiagHessian, Extension
from curvlib.extensions.combine import Combine

DT = torch.float64


# ----------------------------------------------------------------------------- the toy quantity


@dataclass(frozen=True)
class SumAbsGrad(Extension):
    """``Σ_n |g_n|``, entry-wise: the record is all there is to it."""

    name: ClassVar[str] = "sum_abs_grad"
    quantity: ClassVar[str] = "sum_abs_grad"
    slices: ClassVar[Optional[Combine]] = Combine.SUM
    ranks: ClassVar[Optional[Combine]] = Combine.SUM

    def from_individual(self, batch: Tensor) -> Tensor:
        return batch.abs().sum(0)


# ----------------------------------------------------------------------------- the toy family


class Scale(nn.Module):
    """``y = w ⊙ x`` over the last dim."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


def _scale_grad_batch(site: Site, g: Tensor, roles):
    """``[N, D]``: ``Σ_positions g ⊙ x`` per sample."""
    x = site.saved["x"]
    return {"weight": (g * x).reshape(g.shape[0], -1, g.shape[-1]).sum(1)}


SCALE = Rule(kind="toy_scale", grad_batch=_scale_grad_batch)


def _scale_forward(module: Scale, where: str, names: dict, tensors: dict, args, kwargs, rec):
    x = args[0] if args else kwargs["x"]
    out = x * tensors["weight"]
    return rec.add(Site(SCALE, names, where, saved={"x": x} if "weight" in names else {}), out)


SCALE_FAMILY = Family("toy_scale", (Scale,), _scale_forward, affine_in_input=True, affine_in_parameters=True)


@pytest.fixture
def scale_family():
    remove = rules.register(SCALE_FAMILY)
    try:
        yield SCALE_FAMILY
    finally:
        remove()


# ----------------------------------------------------------------------------- brute force


def _model(seed: int, scale: bool) -> nn.Module:
    torch.manual_seed(seed)
    mid = Scale(5) if scale else nn.Identity()
    return nn.Sequential(nn.Linear(4, 5), mid, nn.Tanh(), nn.Linear(5, 3)).to(DT)


def _individual_gradients(model, lossfn, X, y):
    """``{name: [N, *p]}``: ``g_n = ∂(c·ℓ_n)/∂p`` from ``L(X[n:n+1] rows kept in the batch)``:
    the gradient of the whole loss with every other sample's term held at its value."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    rows = []
    for n in range(X.shape[0]):
        def loss_n(p, n=n):
            out = torch.func.functional_call(model, p, (X,))
            mask = torch.zeros(X.shape[0], 1, dtype=DT)
            mask[n] = 1
            return lossfn(out * mask + (out * (1 - mask)).detach(), y)
        rows.append(torch.func.grad(loss_n)(params))
    return {k: torch.stack([r[k] for r in rows]) for k in params}


def _ggn_diagonal(model, lossfn, X, y):
    """``diag(Jᵀ ∇²_f L J)`` per parameter, from the full Jacobian of the batch's outputs."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    out = model(X).detach()
    J = torch.func.jacrev(lambda p: torch.func.functional_call(model, p, (X,)))(params)
    H = torch.func.hessian(lambda o: lossfn(o, y))(out).reshape(out.numel(), out.numel())
    diag = {}
    for k, j in J.items():
        jf = j.reshape(out.numel(), -1)
        diag[k] = torch.einsum("ap,ab,bp->p", jf, H, jf).reshape(params[k].shape)
    return diag


def _hessian_diagonal(model, lossfn, X, y):
    """``diag ∇²L`` per parameter (``torch.func.hessian`` of the loss)."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    H = torch.func.hessian(lambda p: lossfn(torch.func.functional_call(model, p, (X,)), y))(params)
    return {k: H[k][k].reshape(p.numel(), p.numel()).diagonal().reshape(p.shape) for k, p in params.items()}


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("batch_chunk_size", [None, 2])
def test_a_new_quantity_is_its_record(batch_chunk_size):
    model, lossfn = _model(0, scale=False), nn.CrossEntropyLoss()
    X, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    qs = curvature(model, lossfn, [SumAbsGrad(), BatchGrad()], batch_chunk_size=batch_chunk_size)(X, y)
    ref = _individual_gradients(model, lossfn, X, y)
    for k, g in ref.items():
        torch.testing.assert_close(qs["sum_abs_grad"][k], g.abs().sum(0), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(qs["grad_batch"][k], g, rtol=1e-10, atol=1e-12)


def test_a_new_quantity_alone_reads_the_individual_gradients():
    """Asked for alone (no ``BatchGrad`` beside it), its record still gets the individual gradients."""
    model, lossfn = _model(1, scale=False), nn.MSELoss()
    X, y = torch.randn(4, 4, dtype=DT), torch.randn(4, 3, dtype=DT)
    qs = curvature(model, lossfn, [SumAbsGrad()])(X, y)
    ref = _individual_gradients(model, lossfn, X, y)
    assert list(qs) == ["loss", "grad", "sum_abs_grad"]
    for k, g in ref.items():
        torch.testing.assert_close(qs["sum_abs_grad"][k], g.abs().sum(0), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("lossfn", [nn.CrossEntropyLoss(), nn.MSELoss(reduction="sum")], ids=["ce", "mse"])
def test_a_new_family_is_its_record(scale_family, lossfn):
    model = _model(2, scale=True)
    X = torch.randn(6, 4, dtype=DT)
    y = torch.randint(0, 3, (6,)) if isinstance(lossfn, nn.CrossEntropyLoss) else torch.randn(6, 3, dtype=DT)
    f = curvature(model, lossfn, [BatchGrad(), DiagGGNExact(), DiagHessian(), SumAbsGrad()])
    qs = f(X, y)
    assert rules.FAMILY_OF["toy_scale"] is scale_family
    ref = _individual_gradients(model, lossfn, X, y)
    ggn, hessian = _ggn_diagonal(model, lossfn, X, y), _hessian_diagonal(model, lossfn, X, y)
    for k in ref:
        torch.testing.assert_close(qs["grad_batch"][k], ref[k], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(qs["sum_abs_grad"][k], ref[k].abs().sum(0), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(qs["diag_ggn_exact"][k], ggn[k], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(qs["diag_h"][k], hessian[k], rtol=1e-10, atol=1e-12)


def test_the_family_runs_its_own_forward():
    """The registered family's forward is the one that runs (not the generic rule's)."""
    calls = []

    def counting(module, where, *args):
        calls.append(where)
        return _scale_forward(module, where, *args)

    remove = rules.register(Family("toy_scale", (Scale,), counting, affine_in_input=True,
                                   affine_in_parameters=True))
    try:
        model = nn.Sequential(nn.Linear(4, 5), Scale(5), nn.Linear(5, 3)).to(DT)
        X, y = torch.randn(3, 4, dtype=DT), torch.randint(0, 3, (3,))
        curvature(model, nn.CrossEntropyLoss(), [BatchGrad()])(X, y)
    finally:
        remove()
    assert "1" in calls


def test_registrations_are_undone():
    assert "toy_scale" not in rules.FAMILY_OF and all(f.kind != "toy_scale" for f in rules.FAMILIES)


@pytest.mark.parametrize("table, flag", [
    ("curvlib._plan.support.EXACT_BLOCK_KINDS", "exact_block"),
    ("curvlib._plan.support.KRON_OVER_USES_KINDS", "kron_over_uses"),
    ("curvlib._plan.support.SHARED_HESSIAN_KINDS", "shared_hessian"),
    ("curvlib._plan.batch_merges._ROW_WISE", "row_wise"),
    ("curvlib._plan.batch_merges._ENTRY_WISE", "entry_wise"),
    ("curvlib.extensions._base.KFRA_FAMILIES", "kron_from_output_matrix"),
    ("curvlib._hessian.residuals.AFFINE_FAMILIES", "affine_in_input"),
    ("curvlib._hessian.residuals.AFFINE_IN_PARAMETERS", "affine_in_parameters"),
    ("curvlib._hessian.residuals.NORM_FAMILIES", "norm_residual"),
])
def test_every_stage_reads_a_registered_familys_record(table, flag):
    """The stages' family tables are views of the registered records: a family registered after
    import is in the table its record's field puts it in, and leaves it when removed."""
    module, name = table.rsplit(".", 1)
    view = getattr(__import__(module, fromlist=[name]), name)
    value = (lambda *args: None) if flag in ("kron_from_output_matrix", "norm_residual") else True
    remove = rules.register(Family("toy_flagged", (Scale,), _scale_forward, **{flag: value}))
    try:
        assert "toy_flagged" in view
    finally:
        remove()
    assert "toy_flagged" not in view
