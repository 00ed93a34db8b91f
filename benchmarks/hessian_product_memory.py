"""Where a Hessian-vector product's memory goes: the tensors alive at its peak, by the operation
that allocated them, for curvlib's ``Hessian @ v`` and for plain torch ways of computing it.

    python benchmarks/hessian_product_memory.py [--layers 12] [--methods ...] [--out F.md]

The problem is ``problems.gpt`` at GPT-2-small width (d 768, 12 heads, MLP 3072, vocab 50257,
untied head; N=4, T=128) with ``--layers`` blocks; ``v`` is a flat ``[P]`` vector made before
the measurement. A ``TorchDispatchMode`` sees every tensor an ATen operation returns; a storage
is counted from its first appearance until it is freed, views of storages made before the
measurement (the parameters, ``v``) are not counted. The peak is of tensor bytes, without the
allocator's caching or fragmentation (``operators.py`` measures the process's own peak).

Methods: ``backward`` (``loss.backward()``, the reference), ``curvlib`` (``Hessian @ v``: one vector, reverse over forward), ``curvlib-ror`` (its
reverse-over-reverse path through ``torch.func``), ``curvlib-plain`` (reverse over reverse on
plain autograd), ``eager-for`` (``jvp(grad(loss))`` with ``functional_call`` on the model),
``eager-ror`` (``autograd.grad`` with ``create_graph``, then the gradient of ``⟨∇L, v⟩``).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

VIEWS = frozenset("""alias unsqueeze view t transpose expand detach slice split split_with_sizes as_strided permute
select _unsafe_view squeeze unbind chunk narrow _reshape_alias""".split())
METHODS = ["backward", "curvlib", "curvlib-ror", "curvlib-plain", "eager-for", "eager-ror"]


class LiveTensors(TorchDispatchMode):
    """Bytes of the storages ATen operations allocate while active, and the set alive at the peak."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak, self.at_peak = {}, 0, 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or func.overloadpacket.__name__ in VIEWS:
                continue
            try:
                storage = t.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError):  # (functorch wrappers: no storage of their own)
                continue
            if key in self.live or size == 0:
                continue
            self.live[key] = (func.overloadpacket.__name__, tuple(t.shape), size)
            self.now += size
            weakref.finalize(storage, self._freed, key)
            if self.now > self.peak:
                self.peak, self.at_peak = self.now, dict(self.live)
        return out

    def _freed(self, key):
        entry = self.live.pop(key, None)
        if entry is not None:
            self.now -= entry[2]


def product(method: str, model, lossfn, X, y, v):
    """A zero-argument callable computing ``H v`` by ``method``."""
    from torch.func import functional_call, grad, jvp

    from curvlib.operators import Hessian

    if method == "backward":
        def backward():
            model.zero_grad(set_to_none=True)
            lossfn(model(X), y).backward()
            grads = [p.grad for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            return grads

        return backward
    if method.startswith("curvlib"):
        H = Hessian(model, lossfn, (X, y))
        if method == "curvlib-ror":
            H.forward_mode = False
        elif method == "curvlib-plain":
            H.batch_product = lambda batch, seeds, V: H._plain_product(batch, V)
        H @ v  # (the plan and the symmetry check, once)
        return lambda: H @ v
    params = {k: p.detach() for k, p in model.named_parameters()}
    vs = {k: t.view_as(params[k]) for k, t in zip(params, v.split([p.numel() for p in params.values()]))}
    if method == "eager-for":
        loss = lambda th: lossfn(functional_call(model, th, (X,)), y)  # noqa: E731
        return lambda: jvp(grad(loss), (params,), (vs,))[1]
    leaves = list(model.parameters())

    def ror():
        g = torch.autograd.grad(lossfn(model(X), y), leaves, create_graph=True)
        return torch.autograd.grad(sum((a * b).sum() for a, b in zip(g, vs.values())), leaves)

    return ror


def main(argv=None):
    import problems
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    ap.add_argument("--top", type=int, default=8, help="allocations listed per method")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.backends.mha.set_fastpath_enabled(False)  # (forward-mode AD needs the math kernels)
    model, lossfn, X, y = problems.gpt("cpu", vocab=50257, n=4, length=128, d=768, heads=12, hidden=3072,
                                       layers=args.layers)
    params_mib = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    v = torch.randn(sum(p.numel() for p in model.parameters()), generator=torch.Generator().manual_seed(0))
    lines = [f"# Hessian-vector product: tensors alive at the peak ({args.layers} blocks)", "",
             f"`python benchmarks/hessian_product_memory.py {' '.join(argv or sys.argv[1:])}`; torch "
             f"{torch.__version__}; parameters {params_mib:.0f} MiB (float32).", "",
             "| method | peak (MiB) | peak / parameters | s | largest at the peak (op, shape: MiB) |", "|---|---:|---:|---:|---|"]
    with sdpa_kernel([SDPBackend.MATH]):
        for method in args.methods:
            run = product(method, model, lossfn, X, y, v)
            mode = LiveTensors()
            start = time.perf_counter()
            with mode:
                result = run()
            seconds = time.perf_counter() - start
            del result
            by = collections.Counter()
            for op, shape, size in mode.at_peak.values():
                by[(op, shape)] += size
            top = "; ".join(f"{op} {list(shape)}: {size / 2**20:.0f}" for (op, shape), size in by.most_common(args.top))
            lines.append(f"| {method} | {mode.peak / 2**20:.0f} | {mode.peak / 2**20 / params_mib:.2f} | "
                         f"{seconds:.1f} | {top} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
