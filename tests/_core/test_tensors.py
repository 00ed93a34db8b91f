"""The tensor facts every stage asks (``curvlib._core.tensors``): torch.func wrappers, transforms
running, tensors safe to write in place, values traced by torch.fx."""

import pytest
import torch
from torch import fx
from torch.func import grad, jvp, vjp, vmap

from curvlib._core.tensors import has_proxy, in_place_safe, inside_transform, is_wrapped


def test_plain_tensors_outside_transforms():
    """Outside any transform a plain tensor is neither wrapped nor inside one, and may be
    written in place unless autograd records it."""
    x = torch.randn(3)
    assert not inside_transform() and not inside_transform(x) and not is_wrapped(x)
    assert in_place_safe(x) and in_place_safe(x, x.clone())
    recorded = torch.randn(3, requires_grad=True)
    assert not in_place_safe(recorded) and not in_place_safe(x, recorded)
    assert not in_place_safe(recorded * 2)  # recorded by autograd: no in-place update


@pytest.mark.parametrize("transform", ["vmap", "grad", "jvp", "vjp", "nested"])
def test_inside_every_torch_func_transform(transform):
    """Under ``vmap``, ``grad``, ``jvp``, ``vjp`` (and nested ones) a transform is running and the
    traced tensors are wrappers, never safe to write in place; a tensor made outside is plain."""
    seen = []
    outside = torch.randn(2)

    def f(x):
        seen.append((inside_transform(), inside_transform(outside), is_wrapped(x), is_wrapped(outside),
                     in_place_safe(x), in_place_safe(outside)))
        return (x * x).sum()

    x = torch.randn(2, 3) if transform in ("vmap", "nested") else torch.randn(3)
    if transform == "vmap":
        vmap(f)(x)
    elif transform == "grad":
        grad(f)(x)
    elif transform == "jvp":
        jvp(f, (x,), (torch.ones_like(x),))
    elif transform == "vjp":
        vjp(f, x)
    else:
        vmap(grad(f))(x)
    assert seen == [(True, True, True, False, False, True)]


def test_a_wrapped_tensor_marks_a_transform():
    """``inside_transform(t)`` is true for a wrapper ``t`` even where no transform level is
    running: a tensor kept from inside a ``vmap`` (a rule's memo) still may not be reused."""
    kept = []
    vmap(lambda x: kept.append(x) or x)(torch.randn(2, 3))
    assert is_wrapped(kept[0]) and not inside_transform()
    assert inside_transform(kept[0]) and inside_transform(torch.zeros(1), kept[0])
    assert not in_place_safe(kept[0])


def test_has_proxy_finds_a_proxy_in_any_nest():
    """A ``torch.fx.Proxy`` anywhere in tuples, lists and dicts is found; tensors, numbers and
    strings are not proxies."""
    graph = fx.Graph()
    proxy = fx.Proxy(graph.placeholder("x"))
    assert has_proxy(proxy)
    assert has_proxy(((1, "a"), {"k": [torch.zeros(1), proxy]}))
    assert not has_proxy(((1, "a"), {"k": [torch.zeros(1), None]}))
    assert not has_proxy(())


def test_has_proxy_while_fx_traces():
    """Under ``torch.fx.symbolic_trace`` the traced function's arguments are proxies."""
    found = []

    def f(x, scale=2.0):
        found.append((has_proxy((x,)), has_proxy({"scale": scale})))
        return x * scale

    fx.symbolic_trace(f, concrete_args={"scale": 2.0})
    f(torch.zeros(1))
    assert found == [(True, False), (False, False)]
