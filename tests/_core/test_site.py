"""The canonical site layout: the recorder hands every rule its site batch first."""

import torch
from hypothesis import given, strategies as st

from curvlib._core.batch_layout import batch_first, batch_first_shape, from_batch_first
from curvlib._core.site import Recorder, Site
from curvlib.rules.batchnorm import BATCHNORM
from curvlib.rules.linear import LINEAR

from oracles.on_device import seeded


@given(shape=st.lists(st.integers(1, 4), min_size=2, max_size=5), data=st.data())
def test_batch_first_moves_only_the_batch(shape, data):
    """``batch_first`` puts dim ``b`` in front and keeps the order of the others (and the
    channel axes right after the batch); ``from_batch_first`` undoes it."""
    channels = data.draw(st.integers(0, min(1, len(shape) - 2)))
    b = data.draw(st.integers(channels + 1, len(shape) - 1) if len(shape) > channels + 1 else st.just(0))
    t = torch.arange(torch.Size(shape).numel()).reshape(shape)
    c = batch_first(t, b, channels)
    others = [d for d in range(len(shape)) if d != b]
    expected = t.permute([b] + others) if channels == 0 else t.permute([b, 1] + [d for d in others if d != 1])
    assert torch.equal(c, expected)
    assert batch_first_shape(shape, b, channels) == tuple(c.shape)
    assert torch.equal(from_batch_first(c, b, channels), t)


def _recorded(rule, saved, out, batch_dim):
    """A site recorded with ``batch_dim`` from the plan: its site, its probe and the output."""
    shape = batch_first_shape(out.shape, batch_dim, rule.channel_axes)
    probe = torch.zeros(shape, dtype=out.dtype, requires_grad=True)
    rec = Recorder([probe], batch_dims=[batch_dim])
    site = Site(rule, {"weight": "w"}, "layer", saved=dict(saved))
    return site, probe, rec.add(site, out)


def test_linear_site_batch_first():
    """A sequence-first Linear (``[T, N, I] -> [T, N, O]``): its input is saved ``[N, T, I]`` and
    its output gradient arrives ``[N, T, O]``; the output itself keeps the layer's layout."""
    gen = seeded(0)
    x = torch.randn(3, 5, 2, generator=gen, dtype=torch.float64)
    out = torch.randn(3, 5, 4, generator=gen, dtype=torch.float64)
    site, probe, moved = _recorded(LINEAR, {"x": x}, out, 1)
    assert torch.equal(site.saved["x"], x.transpose(0, 1))
    assert torch.equal(moved.detach(), out)
    w = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (g,) = torch.autograd.grad((moved * w).sum(), probe)
    assert torch.equal(g, w.transpose(0, 1))


def test_batchnorm_site_keeps_channels():
    """BatchNorm (``channel_axes=1``) with the batch in dim 2 of ``[H, C, N, W]``: saved and
    gradient ``[N, C, H, W]``."""
    gen = seeded(1)
    xhat = torch.randn(2, 3, 5, 4, generator=gen, dtype=torch.float64)
    site, probe, moved = _recorded(BATCHNORM, {"xhat": xhat}, xhat.clone(), 2)
    assert torch.equal(site.saved["xhat"], xhat.permute(2, 1, 0, 3))
    w = torch.randn(xhat.shape, generator=gen, dtype=torch.float64)
    (g,) = torch.autograd.grad((moved * w).sum(), probe)
    assert torch.equal(g, w.permute(2, 1, 0, 3))


def test_direct_target_gradient_moved_batch_first():
    """Plain autograd reads a site's output directly (no probe, no copy) in any layout; the
    recorder moves its gradient batch first (columns in front too)."""
    x = torch.randn(3, 5, 2, dtype=torch.float64)
    w = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    probes = [torch.zeros(5, 3, 4, dtype=torch.float64, requires_grad=True)]
    rec = Recorder(probes, batch_dims=[1], direct=True)
    out = x @ w.t()
    assert rec.add(Site(LINEAR, {"weight": "w"}, "a", saved={"x": x}), out) is out
    assert rec.targets[0] is out
    g = torch.randn(3, 5, 4, dtype=torch.float64)
    assert rec.layouts == [(1, 0)]
    assert torch.equal(batch_first(g, *rec.layouts[0]), g.transpose(0, 1))
    cols = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    assert torch.equal(batch_first(cols, *rec.layouts[0], lead=1), cols.transpose(1, 2))
