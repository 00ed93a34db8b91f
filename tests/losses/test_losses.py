"""curvlib.losses: Hessian roots and products against torch.func.hessian of the loss."""

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

from curvlib.losses import hessian_matvec, loss_spec, reduction_factor, sqrt_hessian, sqrt_hessian_sampled

from oracles.second_order import loss_hessian_blocks, loss_root
from oracles.on_device import seeded

LOSSES = {"mse": nn.MSELoss, "ce": nn.CrossEntropyLoss, "bce": nn.BCEWithLogitsLoss}


def _case(kind, n, c, extra, seed, scale=2.0):
    """Logits ``[N, C, *extra]`` and targets for ``kind``."""
    gen = seeded(seed)
    out = scale * torch.randn((n, c, *extra), generator=gen, dtype=torch.float64)
    if kind == "ce":
        y = torch.randint(0, c, (n, *extra), generator=gen)
    elif kind == "bce":
        y = torch.rand(out.shape, generator=gen, dtype=torch.float64)
    else:
        y = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    return out, y


cases = dict(
    kind=st.sampled_from(sorted(LOSSES)),
    reduction=st.sampled_from(["mean", "sum"]),
    n=st.integers(1, 3),
    c=st.integers(1, 4),
    extra=st.lists(st.integers(1, 3), max_size=2),
    seed=st.integers(0, 2**16),
)


@given(**cases)
def test_sqrt_hessian_reproduces_loss_hessian(kind, reduction, n, c, extra, seed):
    """``Σ_v S[v, n] S[v, n]ᵀ = H_n`` (sample ``n``'s block of ``∇²_o lossfn``), ``S [C, N, *out[1:]]``."""
    lossfn = LOSSES[kind](reduction=reduction)
    out, y = _case(kind, n, c, extra, seed)
    spec = loss_spec(lossfn)
    S = sqrt_hessian(spec, out, y)
    per = out[0].numel()
    assert S.shape == (per, n) + tuple(out.shape[1:])
    Sf = S.reshape(per, n, per)
    got = torch.einsum("vnc,vnd->ncd", Sf, Sf)
    H = loss_hessian_blocks(lossfn, out, y)
    torch.testing.assert_close(got, H, rtol=1e-10, atol=1e-12)
    # BackPACK's root exactly (column order and signs), and the reference is one
    ref = loss_root(lossfn, out, y)
    torch.testing.assert_close(S, ref, rtol=1e-10, atol=1e-12)
    rf = ref.reshape(per, n, per)
    torch.testing.assert_close(torch.einsum("vnc,vnd->ncd", rf, rf), H, rtol=1e-10, atol=1e-12)


@given(**cases, v=st.integers(1, 3))
def test_hessian_matvec(kind, reduction, n, c, extra, seed, v):
    """``hessian_matvec(mat)[v, n] = H_n mat[v, n]``."""
    lossfn = LOSSES[kind](reduction=reduction)
    out, y = _case(kind, n, c, extra, seed)
    gen = seeded(seed + 1)
    mat = torch.randn((v,) + tuple(out.shape), generator=gen, dtype=torch.float64)
    got = hessian_matvec(loss_spec(lossfn), out, y, mat)
    assert got.shape == mat.shape
    H = loss_hessian_blocks(lossfn, out, y)
    want = torch.einsum("ncd,vnd->vnc", H, mat.reshape(v, n, -1)).reshape(mat.shape)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", sorted(LOSSES))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_reduction_factor(kind, reduction):
    """``c`` = 1 (sum), 1/numel (MSE/BCE mean), 1/(N·prod(D)) (CE mean)."""
    out, _ = _case(kind, 2, 3, [4], 0)
    c = reduction_factor(loss_spec(LOSSES[kind](reduction=reduction)), out)
    if reduction == "sum":
        assert c == 1.0
    else:
        assert c == pytest.approx(1 / (8 if kind == "ce" else 24))


def _sampled_error(kind, reduction, n, c, extra, mc, seed):
    lossfn = LOSSES[kind](reduction=reduction)
    out, y = _case(kind, n, c, extra, 3, scale=1.0)
    S = sqrt_hessian_sampled(loss_spec(lossfn), out, y, mc, seeded(seed))
    assert S.shape == (mc,) + tuple(out.shape)
    Sf = S.reshape(mc, n, -1)
    est = torch.einsum("vnc,vnd->ncd", Sf, Sf)
    H = loss_hessian_blocks(lossfn, out, y)
    return ((est - H).norm() / H.norm()).item()


@pytest.mark.parametrize("kind", sorted(LOSSES))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("extra", [[], [2]])
def test_sampled_root_is_unbiased(kind, reduction, extra):
    """``Σ_m s_m s_mᵀ`` -> ``H_n``: relative error ~ 1/√M, small at M = 20000."""
    errs = {m: _sampled_error(kind, reduction, 2, 3, extra, m, seed=11) for m in (200, 20000)}
    assert errs[20000] < 0.05, errs
    assert errs[20000] < errs[200] / 3, errs


@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_sampled_root_mean_over_seeds(kind):
    """Averaging many independent single-draw estimates (different generators) also gives ``H``."""
    lossfn = LOSSES[kind]()
    out, y = _case(kind, 2, 3, [], 5, scale=1.0)
    spec = loss_spec(lossfn)
    acc = 0
    k = 4000
    for seed in range(k):
        s = sqrt_hessian_sampled(spec, out, y, 1, seeded(seed)).reshape(1, 2, -1)
        acc = acc + torch.einsum("vnc,vnd->ncd", s, s)
    H = loss_hessian_blocks(lossfn, out, y)
    assert ((acc / k - H).norm() / H.norm()).item() < 0.08


@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_sampled_root_reproducible_and_structured(kind):
    lossfn = LOSSES[kind](reduction="sum")
    out, y = _case(kind, 3, 4, [2], 0)
    spec = loss_spec(lossfn)
    a = sqrt_hessian_sampled(spec, out, y, 7, seeded(1))
    b = sqrt_hessian_sampled(spec, out, y, 7, seeded(1))
    c = sqrt_hessian_sampled(spec, out, y, 7, seeded(2))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    scale = (1 / 7) ** 0.5
    if kind == "ce":
        # column = √(c/M) (p − onehot): sums to zero over classes, one entry of p − 1
        torch.testing.assert_close(a.sum(2), torch.zeros_like(a.sum(2)), atol=1e-12, rtol=0)
        p = torch.softmax(out, 1)
        hot = (p.unsqueeze(0) - a / scale).round()
        assert ((hot == 0) | (hot == 1)).all() and (hot.sum(2) == 1).all()
    elif kind == "bce":
        s = torch.sigmoid(out)
        draws = s.unsqueeze(0) - a / scale
        torch.testing.assert_close(draws, draws.round(), atol=1e-12, rtol=0)


def test_sampled_root_default_generator_follows_global_seed():
    spec = loss_spec(nn.MSELoss())
    out, y = _case("mse", 2, 2, [], 0)
    torch.manual_seed(3)
    a = sqrt_hessian_sampled(spec, out, y, 4)
    torch.manual_seed(3)
    b = sqrt_hessian_sampled(spec, out, y, 4)
    assert torch.equal(a, b)


def test_sampled_classes_follow_the_softmax():
    """CE's sampled labels: class frequencies within 4σ of softmax(f), none for a ~0 class."""
    out = torch.tensor([[0.0, 2.0, -30.0, 1.0], [3.0, -1.0, 0.5, 0.5]], dtype=torch.float64)
    y = torch.tensor([0, 1])
    m = 40000
    spec = loss_spec(nn.CrossEntropyLoss(reduction="sum"))
    S = sqrt_hessian_sampled(spec, out, y, m, seeded(3))  # √(1/M)(p − onehot)
    p = torch.softmax(out, 1)
    onehot = p - S * m**0.5  # [M, N, K]
    assert torch.allclose(onehot, onehot.round(), atol=1e-9)
    freq = onehot.mean(0)
    sigma = (p * (1 - p) / m).sqrt()
    assert ((freq - p).abs() <= 4 * sigma + 1e-12).all(), (freq, p)
    assert onehot[:, 0, 2].sum() == 0


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("read", ["concrete", "vmap"])
def test_cross_entropy_mean_counts_weighted_targets(weighted, read):
    """Cross-entropy ``"mean"`` divides by the summed class weights of the targets not
    ``ignore_index`` (their count without weights): ``c`` is the ratio of torch's mean to its
    sum, read from host values (``normaliser``) and as a tensor where they cannot be read (under
    ``vmap``)."""
    from curvlib.losses import normaliser

    gen = seeded(7)
    out = torch.randn(6, 4, 3, generator=gen, dtype=torch.float64)
    y = torch.tensor([[0, 3, 1], [-1, 2, 2], [1, -1, 0], [3, 3, -1], [2, 0, 1], [-1, -1, 2]])
    weight = torch.tensor([0.5, 2.0, 1.25, 3.0], dtype=torch.float64) if weighted else None
    lossfn = nn.CrossEntropyLoss(weight=weight, ignore_index=-1)
    spec = loss_spec(lossfn)
    want = lossfn(out, y) / nn.CrossEntropyLoss(weight=weight, ignore_index=-1, reduction="sum")(out, y)
    if read == "concrete":
        assert normaliser(spec, y) == pytest.approx(1 / want.item(), rel=1e-12)
        c = reduction_factor(spec, y)
    else:  # a batched y: its values cannot be read on the host, c is a tensor
        c = torch.func.vmap(lambda t: reduction_factor(spec, t))(torch.stack([y, y]))[1]
    torch.testing.assert_close(torch.as_tensor(c, dtype=torch.float64), want, rtol=1e-12, atol=0)
