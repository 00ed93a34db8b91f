"""Samples mixed inside the model (``curvlib._plan.independence``): refused where per-sample
quantities are undefined, exact everywhere else.

* every mixing pattern (reductions, pairings and shifts over the batch,
  softmax/cumsum/sort/... along it, tensor indexing, contractions, regrouping
  reshapes, batch statistics, attention/recurrence across the batch, generic
  layers and unknown modules that mix) is refused, naming the node, for every
  extension but HMP and GGNMP, and for ``batch_chunk_size``; ``loss`` and
  ``grad`` still work;
* the allowed patterns (per-sample reductions, reshapes merging and splitting
  the batch, input-only preprocessing, softmax over features, attention within
  a sample, the zoo of ``models``) equal the float64 per-sample oracle;
* HMP and GGNMP of a mixing model equal ``torch.func`` brute force.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import CurvatureError, curvature, extensions as E

from oracles import models
from oracles.checks import _assert_same_state, check_first_order, check_ggn_columns, state_snapshot
from oracles.first_order import assert_close_dicts, first_order_reference
from oracles.second_order import ggn_block, hessian_block, trainable_names
from oracles.cases import HotNet, hot_data
from oracles.on_device import seeded

DT = torch.float64
N = 5


# pattern -> (function of the hot activation h [N, 4], message fragment naming the node and why)
MIXING = {
    "mean0": (lambda h: h - h.mean(0), r"graph node 'mean' \(Tensor\.mean over the batch dim 0 of 'a'"),
    "sum0_keepdim": (lambda h: h * torch.sum(h, 0, keepdim=True), r"torch\.sum over the batch dim 0"),
    "pick_row": (lambda h: h + h[0], r"indexing keeps one row of the batch dim 0"),
    "gram": (lambda h: h @ (h.t() @ h), r"'matmul' \(operator\.matmul sums over the batch dim 1 of 't'"),
    "pairs": (lambda h: (h @ h.T) @ h, r"batch size in dims \[0, 1\]"),
    "shift": (lambda h: torch.cat([h[1:] - h[:-1], h[:1]]), r"not a multiple of N"),
    "softmax": (lambda h: torch.softmax(h, 0), r"'softmax' \(torch\.softmax along the batch dim 0"),
    "log_softmax": (lambda h: F.log_softmax(h, dim=0), r"F\.log_softmax along the batch dim 0"),
    "softmin": (lambda h: F.softmin(h, 0), r"F\.softmin along the batch dim 0"),
    "cumsum": (lambda h: h.cumsum(0), r"Tensor\.cumsum along the batch dim 0"),
    "cumprod": (lambda h: torch.cumprod(h, 0), r"torch\.cumprod along"),
    "cummax": (lambda h: h.cummax(0)[0], r"Tensor\.cummax along"),
    "logcumsumexp": (lambda h: torch.logcumsumexp(h, 0), r"logcumsumexp along"),
    "flip": (lambda h: h.flip(0), r"Tensor\.flip along the batch dim 0"),
    "roll": (lambda h: torch.roll(h, 1, 0), r"torch\.roll along"),
    "roll_flat": (lambda h: torch.roll(h, 1), r"over all dims of 'a', the batch dim 0 included"),
    "sort": (lambda h: h.sort(0)[0], r"(Tensor|torch)\.sort along"),
    "argsort": (lambda h: h.gather(1, h.argsort(0)[:, :1].expand(-1, 4)), r"Tensor\.argsort along"),
    "normalize": (lambda h: F.normalize(h, dim=0), r"F\.normalize along the batch dim 0"),
    "index_select": (lambda h: h.index_select(0, torch.arange(h.shape[0]).flip(0)), r"index_select along"),
    "gather": (lambda h: h.gather(0, torch.zeros_like(h, dtype=torch.long)), r"Tensor\.gather along"),
    "scatter": (lambda h: torch.zeros_like(h).scatter(0, torch.zeros_like(h, dtype=torch.long), h),
                r"Tensor\.scatter along"),
    "take_along_dim": (lambda h: torch.take_along_dim(h, torch.zeros_like(h, dtype=torch.long), 0),
                       r"take_along_dim along"),
    "perm": (lambda h: h[torch.arange(h.shape[0]).flip(0)], r"indexes the batch dim 0 with a tensor"),
    "mask_drops_a_sample": (lambda h: h + h[torch.arange(h.shape[0]) > 0].sum(0), r"indexing of 'a'.*not a multiple of N"),
    "batch_norm": (lambda h: F.batch_norm(h, None, None, training=True),
                   r"F\.batch_norm normalises 'a' with the statistics of the batch"),
    "regroup": (lambda h: h.reshape(-1).reshape(4, -1).t(), r"regroups entries of different samples"),
    "einsum": (lambda h: torch.einsum("nd,md->md", h, h), r"torch\.einsum sums over the batch dim 0"),
    "std": (lambda h: h / h.std(0), r"Tensor\.std over the batch dim 0"),
    "fft": (lambda h: torch.fft.fft(h, dim=0).real,  # not in curvlib's tables: tested numerically
            r"graph node 'fft_fft'.*changing sample 0's input changed other samples' outputs"),
}


@pytest.mark.parametrize("pattern", sorted(MIXING))
def test_mixing_is_refused_naming_the_node(pattern):
    fn, match = MIXING[pattern]
    X, y = hot_data()
    model = HotNet(fn).to(DT)
    before = state_snapshot(model)
    with pytest.raises(CurvatureError, match=r"Samples are mixed inside the model: .*" + match):
        curvature(model, nn.MSELoss(), [E.BatchGrad()])(X, y)
    _assert_same_state(before, state_snapshot(model))


class Mods(nn.Module):
    """``nn.Sequential``-like chain with a module in the middle (KFRA needs a chain)."""

    def __init__(self, mid: nn.Module):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 4), mid, nn.Linear(4, 2))

    def forward(self, x):
        return self.net(x)


PER_SAMPLE = [
    E.BatchGrad(), E.BatchL2Grad(), E.SumGradSquared(), E.Variance(), E.DiagGGNExact(), E.DiagGGNMC(),
    E.BatchDiagGGNExact(), E.BatchDiagGGNMC(), E.DiagHessian(), E.BatchDiagHessian(), E.KFAC(), E.KFLR(),
    E.KFRA(), E.SqrtGGNExact(), E.SqrtGGNMC(), E.PCHMP(),
]


@pytest.mark.parametrize("ext", PER_SAMPLE, ids=lambda e: type(e).__name__)
def test_every_per_sample_and_ggn_extension_is_refused_before_any_work(ext, monkeypatch):
    X, y = hot_data()
    model = Mods(nn.Softmax(dim=0)).to(DT)
    import curvlib._transform.call as transform

    def no_forward(*args, **kwargs):
        raise AssertionError("the forward ran before the refusal")

    monkeypatch.setattr(transform, "forward_with_probes", no_forward)
    with pytest.raises(CurvatureError) as info:
        curvature(model, nn.MSELoss(), [ext])(X, y)
    msg = str(info.value)
    assert "graph node 'net_1' (module 'net.1' (Softmax) along the batch dim 0 of 'net_0')" in msg
    assert f"curvlib refuses {type(ext).__name__}." in msg
    assert "Still exact on this model: loss, grad, and the products HMP and GGNMP" in msg
    assert "model.eval()" in msg


def test_loss_grad_hmp_ggnmp_stay_exact_on_a_mixing_model():
    """Whole-batch autodiff: loss, grad, HMP and GGNMP against torch.func brute force."""
    X, y = hot_data(1)
    model = HotNet(lambda h: h - h.mean(0)).to(DT)
    lossfn = nn.CrossEntropyLoss()
    y = torch.randint(0, 2, (N,), generator=seeded(3))
    qs = curvature(model, lossfn, [E.HMP(), E.GGNMP()])(X, y)
    params = dict(model.named_parameters())
    loss = lossfn(model(X), y)
    torch.testing.assert_close(qs["loss"], loss.detach())
    grads = torch.autograd.grad(loss, list(params.values()))
    assert_close_dicts(qs["grad"], dict(zip(params, grads)), "grad")
    assert curvature(model, lossfn)(X, y)["grad"].keys() == params.keys()
    for name in trainable_names(model):
        p = params[name]
        V = torch.randn((3,) + tuple(p.shape), dtype=DT, generator=seeded(4))
        flat = V.reshape(3, -1)
        H, G = hessian_block(model, lossfn, X, y, name), ggn_block(model, lossfn, X, y, name)
        torch.testing.assert_close(qs["hmp"][name](V).reshape(3, -1), flat @ H.T)
        torch.testing.assert_close(qs["ggnmp"][name](V).reshape(3, -1), flat @ G.T)
    # ... and the per-sample read-off would be wrong: the GGN diagonal is refused
    with pytest.raises(CurvatureError, match="curvlib refuses DiagGGNExact"):
        curvature(model, lossfn, [E.DiagGGNExact(), E.HMP()])(X, y)


def test_batch_chunk_size_is_refused_even_for_loss_and_grad():
    X, y = hot_data()
    f = curvature(HotNet(lambda h: h - h.mean(0)).to(DT), nn.MSELoss(), batch_chunk_size=2)
    with pytest.raises(CurvatureError, match=r"refuses batch_chunk_size \(slices of the batch"):
        f(X, y)


# ----------------------------------------------------------------------------- allowed


ALLOWED = {
    "mean_features": lambda h: h - h.mean(1, keepdim=True),
    "softmax_features": lambda h: torch.softmax(h, -1) * 4,
    "normalize_features": lambda h: F.normalize(h),
    "merge_split": lambda h: h.reshape(-1).reshape(h.shape[0], 4),
    "merge_pairs": lambda h: (h.reshape(-1, 2) * 2).reshape(h.shape[0], 4),
    "cat_batch_and_fold": lambda h: torch.cat([h, h.exp()]).reshape(2, h.shape[0], 4).sum(0),
    "repeat_interleave": lambda h: h.repeat_interleave(3, 0).reshape(h.shape[0], 3, 4).mean(1),
    "arange_index": lambda h: h[torch.arange(h.shape[0])] + h[torch.arange(h.shape[0]), 1:2],
    "sizes_only": lambda h: h + h.new_ones(h.size(0), 4) + torch.zeros_like(h),
    "sort_features": lambda h: h.sort(-1)[0],
    "cumsum_features": lambda h: h.cumsum(1),
    "fft_features": lambda h: torch.fft.fft(h, dim=-1).real,
    "per_sample_gram": lambda h: (h[:, :, None] @ h[:, None, :]).sum(-1),
}


@pytest.mark.parametrize("pattern", sorted(ALLOWED))
def test_per_sample_patterns_equal_the_oracle(pattern):
    X, y = hot_data(2)
    check_first_order(HotNet(ALLOWED[pattern]).to(DT), nn.MSELoss(), X, y)


class Around(nn.Module):
    """``b(post(mid(pre(a(x)))))``: a parameter-free module ``mid`` between two Linear layers."""

    def __init__(self, mid: nn.Module, pre=None, post=None):
        super().__init__()
        self.a, self.mid, self.b = nn.Linear(3, 4), mid, nn.Linear(4, 2)
        self.pre, self.post = pre or (lambda h: h), post or (lambda h: h)

    def forward(self, x):
        return self.b(self.post(self.mid(self.pre(self.a(x)))))


# name -> (module, pre, post, input shape per sample, None if allowed else the message fragment)
MODULES = {
    "softmax_dim0": (nn.Softmax(dim=0), None, None, (3,), r"module 'mid' \(Softmax\) along the batch dim 0"),
    "softmax_legacy_3d": (nn.Softmax(), None, lambda h: h.mean(1), (2, 3), r"\(Softmax\) along the batch dim 0"),
    "group_norm_batch_in_dim1": (nn.GroupNorm(1, 5, affine=False), lambda h: h.transpose(0, 1),
                                 lambda h: h.transpose(0, 1).mean(1), (5, 3), r"the batch is in dim 1"),
    "batch_norm_train": (nn.BatchNorm1d(4, affine=False), None, None, (3,), r"BatchNorm layer 'mid'.*training"),
    "softmax_legacy_2d": (nn.Softmax(), None, None, (3,), None),
    "flatten0_unflatten": (nn.Sequential(nn.Flatten(0), nn.Unflatten(0, (-1, 4))), None, None, (3,), None),
    "max_pool_features": (nn.MaxPool1d(2), None, lambda h: h.repeat(1, 2), (3,), None),
    "instance_norm": (nn.InstanceNorm1d(4), lambda h: h.transpose(1, 2), lambda h: h.mean(2), (5, 3), None),
    "upsample": (nn.Upsample(scale_factor=2), lambda h: h.transpose(1, 2), lambda h: h.mean(2), (5, 3), None),
    "layer_norm": (nn.LayerNorm(4, elementwise_affine=False), None, None, (3,), None),
}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_parameter_free_modules(name):
    mid, pre, post, shape, match = MODULES[name]
    X, y = hot_data(5, shape=shape)
    model = Around(mid, pre, post).to(DT)
    if match is None:
        check_first_order(model, nn.MSELoss(), X, y)
        return
    with pytest.raises(CurvatureError, match=match):
        curvature(model, nn.MSELoss(), [E.BatchGrad()])(X, y)


@pytest.mark.parametrize("name", sorted(models.ZOO))
def test_the_zoo_has_no_mixing(name):
    case = models.ZOO[name]()
    curvature(case.model, case.lossfn, [E.BatchGrad()])(case.X, case.y)  # values: test_graphs


def test_input_only_preprocessing_is_exact():
    """``X - X.mean(0)`` before every layer: the oracle is the model on the centred input."""
    X, y = hot_data(3)
    model = HotNet(lambda h: h, pre=lambda x: (x - x.mean(0)) / x.std(0)).to(DT)
    qs = curvature(model, nn.MSELoss(), [E.BatchGrad(), E.DiagGGNExact()])(X, y)
    plain = HotNet(lambda h: h).to(DT)
    plain.load_state_dict(model.state_dict())
    Z = (X - X.mean(0)) / X.std(0)
    ref = first_order_reference(plain, nn.MSELoss(), Z, y)
    assert_close_dicts(qs["grad_batch"], ref["grad_batch"], "grad_batch")
    assert_close_dicts(qs["diag_ggn_exact"], curvature(plain, nn.MSELoss(), [E.DiagGGNExact()])(Z, y)["diag_ggn_exact"])


def test_detached_batch_statistics_are_constants():
    """``h - h.detach().mean(0)``: no gradient flows between samples; the oracle holds the mean fixed."""
    X, y = hot_data(4)
    model = HotNet(lambda h: h - h.detach().mean(0)).to(DT)
    qs = curvature(model, nn.MSELoss(), [E.BatchGrad()])(X, y)
    with torch.no_grad():
        mean = model.a(X).mean(0)
    fixed = HotNet(lambda h: h - mean).to(DT)
    fixed.load_state_dict(model.state_dict())
    assert_close_dicts(qs["grad_batch"], first_order_reference(fixed, nn.MSELoss(), X, y)["grad_batch"])


# ----------------------------------------------------------------------------- random configurations

OPS = {
    "softmax": lambda h, d: torch.softmax(h, d),
    "cumsum": lambda h, d: h.cumsum(d),
    "flip": lambda h, d: h.flip(d),
    "sort": lambda h, d: h.sort(d)[0],
    "center": lambda h, d: h - h.mean(d, keepdim=True),
    "normalize": lambda h, d: F.normalize(h, dim=d),
    "logsumexp": lambda h, d: h - torch.logsumexp(h, d, keepdim=True),
}


class Placed(nn.Module):
    """``[N, T, 3]`` input, batch moved to dim ``batch_at``; ``op`` along dim ``axis`` of the
    input (``where="pre"``: X only) or of the first layer's output (``"post"``: hot)."""

    def __init__(self, op, axis: int, batch_at: int, where: str):
        super().__init__()
        self.op, self.axis, self.batch_at, self.where = OPS[op], axis, batch_at, where
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):
        x = x.movedim(0, self.batch_at)
        if self.where == "pre":
            x = self.op(x, self.axis)
        h = torch.tanh(self.a(x))
        if self.where == "post":
            h = self.op(h, self.axis)
        return self.b(h.movedim(self.batch_at, 0).mean(1))


@given(op=st.sampled_from(sorted(OPS)), axis=st.integers(0, 1), batch_at=st.integers(0, 1),
       where=st.sampled_from(["pre", "post"]), seed=st.integers(0, 10))
def test_placed_ops_refused_iff_they_mix_trainable_values(op, axis, batch_at, where, seed):
    X, y = hot_data(seed, shape=(3, 3))
    model = Placed(op, axis, batch_at, where).to(DT)
    mixes = axis == batch_at
    if mixes and where == "post":
        with pytest.raises(CurvatureError, match=f"along the batch dim {batch_at}|over the batch dim {batch_at}"):
            curvature(model, nn.MSELoss(), [E.BatchGrad()])(X, y)
        return
    qs = curvature(model, nn.MSELoss(), [E.BatchGrad()])(X, y)
    if where == "pre":  # oracle: the model without the op on the preprocessed input
        plain = Placed(op, axis, batch_at, "none").to(DT)
        plain.load_state_dict(model.state_dict())
        Z = OPS[op](X.movedim(0, batch_at), axis).movedim(batch_at, 0)
        ref = first_order_reference(plain, nn.MSELoss(), Z, y)
    else:
        ref = first_order_reference(model, nn.MSELoss(), X, y)
    assert_close_dicts(qs["grad_batch"], ref["grad_batch"], "grad_batch")



# ----------------------------------------------------------------------------- a per-sample bias in baddbmm (ALiBi)


class Alibi(nn.Module):
    """ALiBi attention on ``[N, T, 3]``: scores ``baddbmm(alibi, q, kᵀ)`` over ``[N·H, T, T]`` with
    ``alibi [N·H, 1, T]`` built per sample (head slopes times the sample's own positions, counted
    over its unpadded tokens); ``shuffle`` rolls the bias across the batch (it then depends on
    ``a``'s output: samples mixed)."""

    def __init__(self, heads: int, shuffle: bool = False):
        super().__init__()
        self.h, self.shuffle = heads, shuffle
        self.qkv, self.act, self.out = nn.Linear(3, 3 * heads * 2), nn.Tanh(), nn.Linear(heads * 2, 2)
        # [1, H, 1]: (indexing a buffer in forward leaves a folded constant on the model: a front-end issue)
        self.register_buffer("slopes", 2.0 ** -torch.arange(1, heads + 1, dtype=torch.float64)[None, :, None])

    def forward(self, x):
        n, t, _ = x.shape
        pos = (x[..., 0] > -1).to(x.dtype).cumsum(1) - 1
        alibi = (self.slopes * pos[:, None, :]).reshape(n * self.h, 1, t)
        q, k, v = self.qkv(x).view(n, t, 3, self.h, 2).permute(2, 0, 3, 1, 4).reshape(3, n * self.h, t, 2)
        if self.shuffle:
            alibi = alibi + q[:, :1, :1].transpose(1, 2).roll(self.h, 0)
        scores = torch.baddbmm(alibi, q, k.transpose(1, 2), beta=1.0, alpha=0.7)
        o = torch.bmm(torch.softmax(scores, -1), v).view(n, self.h, t, 2).permute(0, 2, 1, 3)
        return self.out(self.act(o.reshape(n, t, self.h * 2)).mean(1))


@settings(max_examples=6)
@given(n=st.integers(2, 4), t=st.integers(2, 4), heads=st.integers(1, 3), seed=st.integers(0, 50))
def test_alibi_bias_per_sample_in_baddbmm_is_exact(n, t, heads, seed):
    g = seeded(seed)
    X, y = torch.randn(n, t, 3, generator=g, dtype=DT), torch.randn(n, 2, generator=g, dtype=DT)
    model = Alibi(heads).to(DT)
    check_first_order(model, nn.MSELoss(), X, y)
    check_ggn_columns(model, nn.MSELoss(), X, y)
    qs = curvature(model, nn.MSELoss(), [E.KFLR()])(X, y)
    assert all(bool(f.isfinite().all()) for fs in qs["kflr"].values() for f in fs)


def test_alibi_bias_shuffled_across_the_batch_is_refused():
    X, y = torch.randn(4, 3, 3, generator=seeded(1), dtype=DT), torch.randn(4, 2, generator=seeded(2), dtype=DT)
    with pytest.raises(CurvatureError, match="Samples are mixed inside the model: graph node 'roll'"):
        curvature(Alibi(2, shuffle=True).to(DT), nn.MSELoss(), [E.BatchGrad()])(X, y)
