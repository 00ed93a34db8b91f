"""Models sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``) on 2 gloo processes.

Every rank shards the same model (per block and at the root, the usual recipe; one unit; a
2-D hybrid mesh; a mixed precision policy) and calls ``f`` on its own slice of one global
batch (uneven sizes). Inside the worker its results are checked against the unsharded model
on the whole batch (a copy taken before ``fully_shard``): the gradient against autograd, the
other quantities against curvlib's single-process results (tested against brute force
elsewhere). Summed results are DTensors with the parameter's placements and dtype whose
``full_tensor()`` is the global batch's; Kronecker factors DTensors split along their rows; per-sample
results the rank's own rows; the model's shards, classes and hooks are as they were.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib.extensions import (KFAC, KFLR, BatchDiagGGNExact, BatchDiagHessian, BatchGrad, BatchL2Grad, DiagGGNExact,
                                DiagGGNMC, DiagHessian, SqrtGGNExact, SumGradSquared, Variance)
from oracles.on_device import CPU_ONLY, ON_CPU
from oracles.processes import gloo_available, spawn

pytestmark = [pytest.mark.skipif(not gloo_available(), reason="torch.distributed with gloo is not available"),
              pytest.mark.skipif(not ON_CPU, reason=CPU_ONLY + " (gloo's processes)")]

SIZES = (3, 4)  # the ranks' local batch sizes (four ranks: SIZES_4)
SIZES_4 = (2, 3, 1, 2)
EXACT = [BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance(), DiagGGNExact(), BatchDiagGGNExact(), KFLR(),
         DiagHessian(), BatchDiagHessian(), SqrtGGNExact()]


class _LastToken(nn.Module):
    """A tiny transformers Llama (float64) read at its last position: ``[N, V]`` logits."""

    def __init__(self):
        super().__init__()
        import torchvision_shim  # (a fresh process: transformers imports torchvision)

        torchvision_shim.install()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=32, max_position_embeddings=16)
        self.hf = LlamaForCausalLM(config).double()

    def forward(self, ids):
        return self.hf(input_ids=ids).logits[:, -1]


class _LastTokenGPT2(_LastToken):
    """A tiny transformers GPT-2 (its head tied to its token embedding) at its last position."""

    def __init__(self):
        nn.Module.__init__(self)
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=32, n_positions=16)
        self.hf = GPT2LMHeadModel(config).double().eval()  # (no dropout)


def _model(arch: str) -> nn.Module:
    torch.manual_seed(7)
    if arch == "llama":
        return _LastToken()
    if arch == "gpt2":
        import torchvision_shim

        torchvision_shim.install()
        return _LastTokenGPT2()
    if arch == "frozen_norm":  # a frozen bias and an eval-mode BatchNorm's running statistics
        model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)).double().eval()
        model[1].running_mean.uniform_()
        model[0].bias.requires_grad_(False)
        return model
    if arch == "mlp":
        return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Sigmoid(), nn.Linear(5, 3)).double()
    if arch == "conv":
        return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 3, 3), nn.Flatten(),
                             nn.Linear(12, 3)).double()
    layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=12, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.Linear(4, 8), layer, copy.deepcopy(layer), _MeanTokens(), nn.Linear(8, 3)).double()


class _MeanTokens(nn.Module):
    def forward(self, x):
        return x.mean(1)


def _batch(arch: str, n: int):
    g = torch.Generator(device="cpu").manual_seed(11)  # (ranks run on CPU, gloo)
    if arch in ("llama", "gpt2"):
        return torch.randint(0, 32, (n, 5), generator=g), torch.randint(0, 32, (n,), generator=g)
    if arch == "frozen_norm":
        return torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)
    shape = {"mlp": (n, 4), "conv": (n, 2, 4, 4), "transformer": (n, 5, 4)}[arch]
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def _shard(model: nn.Module, how: str, mesh=None, mp=None) -> None:
    from torch.distributed.fsdp import fully_shard

    kw = {k: v for k, v in (("mesh", mesh), ("mp_policy", mp)) if v is not None}
    if how == "layers":  # (a transformers model's decoder layers, then the root)
        for layer in (model.hf.model.layers if hasattr(model.hf, "model") else model.hf.transformer.h):
            fully_shard(layer, **kw)
    elif how == "blocks":
        for m in model:
            if any(True for _ in m.parameters()):
                fully_shard(m, **kw)
    fully_shard(model, **kw)


def _rows(rank: int, sizes=SIZES):
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _close(a, b, what, rtol=1e-10):
    torch.testing.assert_close(a, b, rtol=rtol, atol=rtol, msg=lambda m: f"{what}: {m}")


def _check_results(q, r, sharded_model, rank, rtol=1e-10, mc=(), sizes=SIZES):
    from torch.distributed.tensor import DTensor, Shard

    shards = dict(sharded_model.named_parameters())
    _close(q["loss"], r["loss"].to(q["loss"].dtype), "loss", rtol)
    per_sample = {"grad_batch": 0, "batch_l2": 0, "diag_ggn_exact_batch": 0, "diag_h_batch": 0, "sqrt_ggn_exact": 1}
    for key, value in q.items():
        if key == "loss":
            continue
        for name, t in value.items():
            p = shards[name]
            ref = r[key][name]
            if key in per_sample:  # the rank's own rows, plain
                assert not isinstance(t, DTensor), key
                if sizes is not None:  # (else the reference's rows are the rank's already)
                    rows = _rows(rank, sizes)
                    ref = ref.narrow(per_sample[key], rows.start, sizes[rank])
                _close(t, ref.to(t.dtype), f"{key}[{name}]", rtol)
            elif isinstance(t, list):  # Kronecker factors: split along their rows like the parameter
                rows = tuple(Shard(0) if pl.is_shard() else pl for pl in p.placements)
                for k, (a, b) in enumerate(zip(t, ref)):
                    assert isinstance(a, DTensor) and a.placements == rows, (key, a.placements)
                    if (key, k) not in mc:
                        _close(a.full_tensor(), b.to(a.dtype), f"{key}[{name}][{k}]", rtol)
            else:  # summed: sharded like the parameter
                assert isinstance(t, DTensor) and t.placements == p.placements and t.dtype == p.dtype, (key, name)
                if key not in mc:
                    _close(t.full_tensor(), ref.to(t.dtype), f"{key}[{name}]", rtol)


def _state(model: nn.Module):
    return ([(n, type(p).__name__, p.to_local().clone()) for n, p in model.named_parameters()],
            [(type(m).__name__, len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()])


def _same_as_unsharded(rank, world, arch, how, lossfn, exts, sizes=SIZES):
    model = _model(arch)
    ref = copy.deepcopy(model)
    _shard(model, how)
    Xg, yg = _batch(arch, sum(sizes))
    before = _state(model)
    rows = _rows(rank, sizes)
    with _GatherCount() as count:
        q = curvature(model, lossfn, exts)(Xg[rows], yg[rows])
    if not any(e.hessian for e in exts):  # (never the whole model at once; the Hessian keeps what it saves)
        assert count.peak < sum(p.numel() * p.element_size() for p in ref.parameters()), (arch, count.peak)
    after = _state(model)
    assert [(a[0], a[1]) for a in before[0]] == [(a[0], a[1]) for a in after[0]] and before[1] == after[1]
    assert all(torch.equal(a[2], b[2]) for a, b in zip(before[0], after[0]))
    mc = {("kfac", 0), "diag_ggn_mc"}
    if arch in ("llama", "gpt2"):
        # (its RMSNorm computes in float32: a float64 matrix product's last bit, which depends on
        # the batch's size, can move the float32 rounding by one unit, 6e-8 relative. Against the
        # unsharded model on the same local batches aggregated over the ranks to 1e-10, against
        # the whole batch at float32 precision)
        import torch.distributed as dist

        ddp = curvature(ref, lossfn, exts, process_group=dist.group.WORLD)(Xg[rows], yg[rows])
        _check_results(q, ddp, model, rank, mc=mc, sizes=None)
        _check_results(q, curvature(ref, lossfn, exts)(Xg, yg), model, rank, rtol=1e-4, mc=mc, sizes=sizes)
        return
    _check_results(q, curvature(ref, lossfn, exts)(Xg, yg), model, rank, mc=mc, sizes=sizes)
    # the gradient against autograd on the whole batch
    ref.zero_grad()
    lossfn(ref(Xg), yg).backward()
    assert set(q["grad"]) == {name for name, p in ref.named_parameters() if p.requires_grad}
    for name, p in ref.named_parameters():
        if p.requires_grad:
            _close(q["grad"][name].full_tensor(), p.grad, f"autograd grad[{name}]")


@pytest.mark.parametrize("arch,how", [("mlp", "blocks"), ("conv", "root"), ("transformer", "blocks")])
def test_sharded_equals_unsharded(arch, how):
    spawn(_same_as_unsharded, (arch, how, nn.CrossEntropyLoss(), EXACT), world=len(SIZES))


def _models(rank, world, cases):
    for arch, how, exts in cases:
        _same_as_unsharded(rank, world, arch, how, nn.CrossEntropyLoss(), exts)


def test_tied_weights_frozen_parameters_and_buffers():
    """GPT-2's head tied to its embedding (one parameter, one result); a frozen parameter (no
    result) and an eval-mode BatchNorm's running statistics (the model's buffers)."""
    exts = [BatchL2Grad(), DiagGGNExact(), KFLR()]
    spawn(_models, ([("gpt2", "layers", exts), ("frozen_norm", "blocks", exts)],), world=len(SIZES), timeout_s=240)


def test_transformers_llama_sharded_per_layer():
    exts = [BatchGrad(), BatchL2Grad(), SumGradSquared(), DiagGGNExact(), KFLR(), DiagHessian()]
    spawn(_same_as_unsharded, ("llama", "layers", nn.CrossEntropyLoss(), exts), world=len(SIZES), timeout_s=240)


@pytest.mark.slow
@pytest.mark.parametrize("arch,how", [("mlp", "blocks"), ("transformer", "blocks"), ("llama", "layers")])
def test_four_ranks(arch, how):
    exts = EXACT if arch != "llama" else [BatchL2Grad(), DiagGGNExact(), KFLR()]
    spawn(_same_as_unsharded, (arch, how, nn.CrossEntropyLoss(), exts, SIZES_4), world=len(SIZES_4), timeout_s=300)


def test_sum_reduction_and_monte_carlo():
    spawn(_same_as_unsharded, ("mlp", "blocks", nn.CrossEntropyLoss(reduction="sum"),
                               [BatchGrad(), DiagGGNExact(), DiagGGNMC(), KFAC(), KFLR()]), world=len(SIZES))


def _read_into_shards(rank, world):
    """With no formed quantity (no Variance), each first-order result is reduce-scattered into the
    rank's rows as soon as it is read; in batch slices (``batch_chunk_size``), after the call,
    the ranks running different numbers of slices (one of 3 samples, two of 3 and 1)."""
    exts = [BatchL2Grad(), SumGradSquared(), DiagGGNExact(), KFLR()]
    for arch, how in (("mlp", "blocks"), ("transformer", "blocks")):
        _same_as_unsharded(rank, world, arch, how, nn.CrossEntropyLoss(), exts)
    model = _model("mlp")
    ref = copy.deepcopy(model)
    _shard(model, "blocks")
    Xg, yg = _batch("mlp", sum(SIZES))
    rows = _rows(rank)
    q = curvature(model, nn.CrossEntropyLoss(), exts, batch_chunk_size=3)(Xg[rows], yg[rows])
    _check_results(q, curvature(ref, nn.CrossEntropyLoss(), exts)(Xg, yg), model, rank)


def test_first_order_read_into_shards_and_batch_slices():
    spawn(_read_into_shards, (), world=len(SIZES), timeout_s=240)


def _equal_batches(rank, world):
    """Every rank with the same number of samples: each result's weight is then the same on every
    rank and is applied after the sum, a result whose rows divide evenly reduce-scattered as it
    is (no scaled copy); the mean and the sum reductions, first order and the one-column diagonal."""
    exts = [BatchL2Grad(), SumGradSquared(), DiagGGNMC(), DiagGGNExact(), KFAC()]
    for arch in ("mlp", "transformer"):
        for lossfn in (nn.CrossEntropyLoss(), nn.CrossEntropyLoss(reduction="sum")):
            _same_as_unsharded(rank, world, arch, "blocks", lossfn, exts, sizes=(3, 3))


def test_equal_micro_batches_reduced_without_copies():
    spawn(_equal_batches, (), world=len(SIZES), timeout_s=240)


def _mixed_precision(rank, world):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = _model("mlp")
    ref = copy.deepcopy(model).float()
    _shard(model, "blocks", mp=MixedPrecisionPolicy(param_dtype=torch.float32))
    Xg, yg = _batch("mlp", sum(SIZES))
    exts = [BatchGrad(), DiagGGNExact(), KFLR(), DiagHessian()]
    q = curvature(model, nn.CrossEntropyLoss(), exts)(Xg[_rows(rank)], yg[_rows(rank)])
    r = curvature(ref, nn.CrossEntropyLoss(), exts)(Xg.float(), yg)
    assert q["grad"]["0.weight"].dtype == torch.float64  # (the parameters' dtype; computed in float32)
    _check_results(q, r, model, rank, rtol=1e-5)


def test_mixed_precision_policy():
    spawn(_mixed_precision, (), world=len(SIZES))


def _hybrid(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    model = _model("mlp")
    ref = copy.deepcopy(model)
    _shard(model, "blocks", mesh=mesh)
    Xg, yg = _batch("mlp", sum(SIZES))
    exts = [BatchL2Grad(), SumGradSquared(), DiagGGNExact(), KFLR()]
    q = curvature(model, nn.CrossEntropyLoss(), exts)(Xg[_rows(rank)], yg[_rows(rank)])
    _check_results(q, curvature(ref, nn.CrossEntropyLoss(), exts)(Xg, yg), model, rank)


def test_hybrid_sharding_mesh():
    spawn(_hybrid, (), world=len(SIZES))


def _params_and_refusals(rank, world):
    model = _model("mlp")
    ref = copy.deepcopy(model)
    _shard(model, "blocks")
    Xg, yg = _batch("mlp", sum(SIZES))
    # (train/eval set after curvature was built reaches the call: dropout on, then off)
    dropped = nn.Sequential(nn.Dropout(0.5), copy.deepcopy(ref))
    _shard(dropped, "root")
    f = curvature(dropped, nn.CrossEntropyLoss(), [DiagGGNExact()])
    dropped.eval()
    plain = curvature(nn.Sequential(nn.Dropout(0.5), ref).eval(), nn.CrossEntropyLoss(), [DiagGGNExact()])
    _check_results(f(Xg[_rows(rank)], yg[_rows(rank)]), plain(Xg, yg), dropped, rank)
    chosen = {n: p for n, p in model.named_parameters() if n.startswith("2.")}
    q = curvature(model, nn.CrossEntropyLoss(), [DiagGGNExact()])(Xg[_rows(rank)], yg[_rows(rank)], params=chosen)
    assert set(q["diag_ggn_exact"]) == set(chosen) == set(q["grad"])
    r = curvature(ref, nn.CrossEntropyLoss(), [DiagGGNExact()])(
        Xg, yg, params={n: p.detach() for n, p in ref.named_parameters() if n in chosen})
    _check_results(q, r, model, rank)
    import torch.distributed as dist

    with pytest.raises(CurvatureError, match="not a parameter of the model"):
        curvature(model, nn.CrossEntropyLoss(), [DiagGGNExact()])(Xg[_rows(rank)], yg[_rows(rank)], params={"nope": Xg})
    for kw, match in [({"process_group": dist.group.WORLD}, "leave process_group out"), ({"compile": True}, "compile")]:
        with pytest.raises(CurvatureError, match=match):
            curvature(model, nn.CrossEntropyLoss(), [DiagGGNExact()], **kw)


def test_params_subset_and_refusals():
    spawn(_params_and_refusals, (), world=len(SIZES))


def _dp_sgd(rank, world):
    """DP-SGD's clipped sum on a sharded model: per-sample norms from curvlib, then the model's
    own (FSDP) backward of the reweighted loss ``Σ_n c_n ℓ_n`` (examples/dp_sgd.py, ghost way)."""
    model = _model("mlp")
    ref = copy.deepcopy(model)
    _shard(model, "blocks")
    for m in model.modules():  # (FSDP averages gradients over the ranks: the clipped *sum*)
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(1.0)
    lossfn, per_sample, max_norm = nn.CrossEntropyLoss(reduction="sum"), nn.CrossEntropyLoss(reduction="none"), 1.2
    Xg, yg = _batch("mlp", sum(SIZES))
    X, y = Xg[_rows(rank)], yg[_rows(rank)]

    def clip(batch_l2):
        return (max_norm / (torch.stack(list(batch_l2.values())).sum(0).sqrt() + 1e-6)).clamp(max=1.0)

    c = clip(curvature(model, lossfn, [BatchL2Grad()])(X, y)["batch_l2"])
    (c * per_sample(model(X), y)).sum().backward()
    # reference: one process, the whole batch, individual gradients materialised
    qs = curvature(ref, lossfn, [BatchGrad(), BatchL2Grad()])(Xg, yg)
    c_all = clip(qs["batch_l2"])
    _close(c, c_all[_rows(rank)], "clip factors")
    assert 0 < int((c_all < 1).sum()) < len(c_all)  # (some clipped, some not)
    for name, p in model.named_parameters():
        _close(p.grad.full_tensor(), torch.einsum("n,n...->...", c_all, qs["grad_batch"][name]), f"clipped sum[{name}]")


def test_dp_sgd_clipping_under_fsdp():
    spawn(_dp_sgd, (), world=len(SIZES))


def _preconditioned(rank, world):
    """Kronecker preconditioning on sharded results: each layer's factors eigendecomposed by its
    owner, the step scattered back in shards; ``KFACOptimizer`` on the sharded model takes the
    same steps as on the unsharded one over the whole batch."""
    from torch.distributed.tensor import DTensor

    from curvlib.optim import KFACOptimizer
    from curvlib.precondition import kron_inverse_vp

    model = _model("mlp")
    ref = copy.deepcopy(model)
    _shard(model, "blocks")
    Xg, yg = _batch("mlp", sum(SIZES))
    X, y = Xg[_rows(rank)], yg[_rows(rank)]
    qs = curvature(model, nn.CrossEntropyLoss(), [KFLR()])(X, y)
    rs = curvature(ref, nn.CrossEntropyLoss(), [KFLR()])(Xg, yg)
    import curvlib.precondition as pre

    decomposed, eigen_of = [], pre.eigen_of
    pre.eigen_of = lambda *a: (decomposed.append(a[2]), eigen_of(*a))[1]
    try:
        kron_inverse_vp(qs["kflr"], qs["grad"], 1e-2)
    finally:
        pre.eigen_of = eigen_of
    assert decomposed == [n for k, n in enumerate(sorted(qs["grad"])) if k % world == rank]  # (the owner's only)
    with pytest.raises(CurvatureError, match="ekfac"):
        KFACOptimizer(model, nn.CrossEntropyLoss(), curvature="ekfac")
    for method in ("pi", "exact"):
        step = kron_inverse_vp(qs["kflr"], qs["grad"], 1e-2, method=method)
        expected = kron_inverse_vp(rs["kflr"], rs["grad"], 1e-2, method=method)
        for name, t in step.items():
            assert isinstance(t, DTensor) and t.placements == qs["grad"][name].placements
            _close(t.full_tensor(), expected[name], f"{method} step[{name}]")
    kw = dict(lr=0.2, damping=1e-2, curvature="kflr", momentum=0.5, weight_decay=1e-3)
    opt, ref_opt = KFACOptimizer(model, nn.CrossEntropyLoss(), **kw), KFACOptimizer(ref, nn.CrossEntropyLoss(), **kw)
    for _ in range(3):
        _close(opt.step(X, y), ref_opt.step(Xg, yg), "loss")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert isinstance(p, DTensor)
        _close(p.full_tensor(), q.detach(), f"after three steps: {name}")


def test_kronecker_preconditioning_and_kfac_optimizer():
    spawn(_preconditioned, (), world=len(SIZES))


class _GatherCount:
    """Bytes of whole parameters alive at once: every ``DTensor.full_tensor()`` result counted
    from its creation until it is freed, the largest sum kept."""

    def __init__(self):
        self.alive = self.peak = self.calls = 0

    def __enter__(self):
        import weakref

        from torch.distributed.tensor import DTensor

        self._cls, self._full = DTensor, DTensor.full_tensor

        def full_tensor(t, *args, **kwargs):
            out = self._full(t, *args, **kwargs)
            size = out.numel() * out.element_size()
            self.alive, self.calls = self.alive + size, self.calls + 1
            self.peak = max(self.peak, self.alive)
            weakref.finalize(out, self._freed, size)
            return out

        DTensor.full_tensor = full_tensor
        return self

    def _freed(self, size):
        self.alive -= size

    def __exit__(self, *exc):
        self._cls.full_tensor = self._full


def _gathered_layer_by_layer(rank, world):
    """A call holds the parameters of the layers it computes, not the model's: six equal blocks,
    the peak of gathered bytes below a third of the model; the results as the unsharded model's."""
    torch.manual_seed(3)
    blocks = [m for _ in range(6) for m in (nn.Linear(12, 12), nn.Tanh())]
    model = nn.Sequential(*blocks, nn.Linear(12, 3)).double()
    ref = copy.deepcopy(model)
    _shard(model, "blocks")
    total = sum(p.numel() * p.element_size() for p in ref.parameters())
    g = torch.Generator(device="cpu").manual_seed(5)  # (ranks run on CPU, gloo)
    Xg, yg = torch.randn(sum(SIZES), 12, generator=g, dtype=torch.float64), torch.randint(0, 3, (sum(SIZES),), generator=g)
    rows = _rows(rank)
    for exts in ([BatchL2Grad()], [DiagGGNExact(), KFLR()], [DiagGGNMC(), KFAC()], [SumGradSquared(), Variance()]):
        f = curvature(model, nn.CrossEntropyLoss(), exts)
        with _GatherCount() as count:
            q = f(Xg[rows], yg[rows])
        assert count.calls >= len(list(ref.parameters())), exts  # (every parameter gathered)
        assert count.peak < total / 3, (exts, count.peak, total)
        _check_results(q, curvature(ref, nn.CrossEntropyLoss(), exts)(Xg, yg), model, rank,
                       mc={("kfac", 0), "diag_ggn_mc"})


def test_parameters_gathered_layer_by_layer():
    spawn(_gathered_layer_by_layer, (), world=len(SIZES))


def _diagonal_reduced_per_layer(rank, world):
    """With the default settings, on sites far below ``stream_min_bytes``, a one-column
    second-order diagonal (``DiagGGNMC``) is reduce-scattered layer by layer during its column's
    backward, the last layer first, not built up whole and reduced after the call (in name order):
    a rank never holds every layer's local diagonal at once. The results stay the unsharded model's."""
    import torch.distributed as dist

    from curvlib.distributed import _scatter

    torch.manual_seed(3)
    blocks = [m for _ in range(4) for m in (nn.Linear(12, 12), nn.Tanh())]
    model = nn.Sequential(*blocks, nn.Linear(12, 3)).double()
    ref = copy.deepcopy(model)
    _shard(model, "blocks")
    g = torch.Generator(device="cpu").manual_seed(5)
    Xg, yg = torch.randn(sum(SIZES), 12, generator=g, dtype=torch.float64), torch.randint(0, 3, (sum(SIZES),), generator=g)
    X, y = Xg[_rows(rank)], yg[_rows(rank)]
    order, scatter = [], _scatter.RowScatter.__call__

    def recorded(self, name, t, pre, post):
        order.append(name)
        return scatter(self, name, t, pre, post)

    _scatter.RowScatter.__call__ = recorded
    try:
        mc = lambda: DiagGGNMC(generator=torch.Generator(device="cpu").manual_seed(1))  # noqa: E731
        q = curvature(model, nn.CrossEntropyLoss(), [mc()])(X, y)
    finally:
        _scatter.RowScatter.__call__ = scatter
    r = curvature(ref, nn.CrossEntropyLoss(), [mc()], process_group=dist.group.WORLD)(X, y)
    for name, t in q["diag_ggn_mc"].items():
        _close(t.full_tensor(), r["diag_ggn_mc"][name], f"diag_ggn_mc[{name}]")
    weights = [n for n in order if n.endswith("weight")]
    names = [n for n, _ in ref.named_parameters() if n.endswith("weight")]
    # the gradient's reads, then the diagonal's: each in the backward's order, the head's first
    assert weights == names[::-1] * 2, weights


def test_one_column_diagonal_reduced_layer_by_layer():
    spawn(_diagonal_reduced_per_layer, (), world=len(SIZES))


def _streamed(rank, world):
    """Sites read as the backward reaches them: the first order read during the loss's backward, a
    one-column second-order diagonal (``DiagGGNMC``) reduce-scattered as it is read. A sharded
    call's results go to a sink, so its sites stream whatever ``stream_min_bytes`` says: with
    the threshold at 0 on every rank, then on rank 0 only (were it to decide, the ranks would
    agree on it: the backwards and the reductions stay in the same order on both)."""
    import torch.distributed as dist

    from curvlib._core.settings import override

    for threshold in (0, 0 if rank == 0 else 2**40):
        with override(stream_min_bytes=threshold):
            for arch in ("mlp", "transformer"):
                _same_as_unsharded(rank, world, arch, "blocks", nn.CrossEntropyLoss(),
                                   [BatchL2Grad(), SumGradSquared(), DiagGGNMC(), DiagGGNExact(), KFAC()])
                # the Monte-Carlo diagonal against the unsharded model's over the ranks, same draws
                model = _model(arch)
                ref = copy.deepcopy(model)
                _shard(model, "blocks")
                Xg, yg = _batch(arch, sum(SIZES))
                X, y = Xg[_rows(rank)], yg[_rows(rank)]
                q = curvature(model, nn.CrossEntropyLoss(), [DiagGGNMC(generator=torch.Generator(device="cpu").manual_seed(1))])(X, y)
                r = curvature(ref, nn.CrossEntropyLoss(), [DiagGGNMC(generator=torch.Generator(device="cpu").manual_seed(1))],
                              process_group=dist.group.WORLD)(X, y)
                for name, t in q["diag_ggn_mc"].items():
                    _close(t.full_tensor(), r["diag_ggn_mc"][name], f"diag_ggn_mc[{name}]")


def test_streamed_reads_agreed_over_ranks():
    spawn(_streamed, (), world=len(SIZES), timeout_s=240)


class _MixesThroughWeight(nn.Module):
    """Adds the batch's mean of ``x Wᵀ`` to every row; data-dependent control flow, so torch.fx
    cannot trace it and only the numeric tests see the mixing, through the weight's values."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d, dtype=torch.float64) / d ** 0.5)

    def forward(self, x):
        if float(x.detach().abs().sum()) >= 0:
            return x + (x @ self.weight.T).mean(0, keepdim=True)
        return x


def _mixing_seen(rank, world):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), _MixesThroughWeight(6), nn.Linear(6, 3)).double()
    plain = copy.deepcopy(model)
    _shard(model, "blocks")
    Xg, yg = _batch("mlp", sum(SIZES))
    for m, X, y in ((plain, Xg, yg), (model, Xg[_rows(rank)], yg[_rows(rank)])):
        with pytest.raises(CurvatureError, match="samples"):  # (mixed, or not independent)
            curvature(m, nn.CrossEntropyLoss(), [BatchGrad()])(X, y)


def test_mixing_through_parameter_values_refused_when_sharded():
    """A module whose mixing of samples only its weights' values show is refused on the sharded
    model as on the unsharded one (the checks before the call see placeholders, not the values)."""
    spawn(_mixing_seen, (), world=len(SIZES))
