"""First order on every zoo model: curvlib's BatchGrad against torch.func's ``vmap(grad)``.

    python benchmarks/zoo_first_order.py [--n 32] [--repeats 7] [--models gpt2_eager bert ...]

The models are those of ``tests/oracles/zoo.py`` (tiny configs from Hugging Face transformers, timm
and torchvision, random weights, nothing downloaded), in float32 with the batch tiled to
``--n`` samples, one torch thread. For each: the median time of a plain ``loss.backward()``,
of ``vmap(grad)`` over samples (each sample's share of the loss, ``functional_call``), and of
one ``curvature(model, lossfn, [BatchGrad()], output=...)`` call (traced before timing);
the ratio BatchGrad / vmap(grad) is the measure (target: at most 1.5). A model whose
``vmap(grad)`` fails (no batching rule) is reported as such.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import torchvision_shim  # noqa: E402  (before transformers, timm, torchvision import it)

torchvision_shim.install()

from oracles import zoo  # noqa: E402
from curvlib import curvature  # noqa: E402
from curvlib._core.outputs import select  # noqa: E402
from curvlib.extensions import BatchGrad  # noqa: E402


def _tiled(t: torch.Tensor, n: int) -> torch.Tensor:
    reps = -(-n // t.shape[0])
    return t.repeat((reps,) + (1,) * (t.dim() - 1))[:n]


def _problem(name: str, n: int):
    """The zoo problem in float32 with ``n`` samples."""
    p = zoo.build(name)
    model = p.model.float()
    cast = lambda t: _tiled(t.float() if t.is_floating_point() else t, n)  # noqa: E731
    X = {k: cast(v) for k, v in p.X.items()} if isinstance(p.X, dict) else cast(p.X)
    return model, X, _tiled(p.y.float() if p.y.is_floating_point() else p.y, n), p.lossfn, p.output


def _call(model, params, X):
    return (torch.func.functional_call(model, params, (), X) if isinstance(X, dict)
            else torch.func.functional_call(model, params, (X,)))


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure(name: str, n: int, repeats: int) -> dict:
    model, X, y, lossfn, output = _problem(name, n)
    pick = lambda o: select(o, output)[0]  # noqa: E731  (curvature's own rule, output= as given)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def backward():
        model.zero_grad(set_to_none=True)
        lossfn(pick(_call(model, dict(model.named_parameters()), X)), y).backward()

    def share(p, x, t):  # one sample's share of the mean loss (its own forward)
        x1 = {k: v[None] for k, v in x.items()} if isinstance(x, dict) else x[None]
        return lossfn(pick(_call(model, p, x1)), t[None]) / n

    per_sample = torch.func.vmap(torch.func.grad(share), in_dims=(None, 0, 0))
    f = curvature(model, lossfn, [BatchGrad()], output=output)
    row = {"model": name, "backward": _median_ms(backward, repeats)}
    try:
        row["vmap(grad)"] = _median_ms(lambda: per_sample(params, X, y), repeats)
    except Exception as exc:  # noqa: BLE001 - reported: no batching rule, data-dependent control flow
        row["vmap(grad)"] = f"fails: {type(exc).__name__}"
    row["BatchGrad"] = _median_ms(lambda: f(X, y), repeats)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--models", nargs="*", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    print(f"N = {args.n}, float32, 1 thread, torch {torch.__version__}; median of {args.repeats} calls (ms)\n")
    print("| model | backward | vmap(grad) | BatchGrad | BatchGrad / vmap(grad) |")
    print("|---|---:|---:|---:|---:|")
    for name in args.models or zoo.NAMES:
        row = measure(name, args.n, args.repeats)
        vg = row["vmap(grad)"]
        ratio = f"{row['BatchGrad'] / vg:.2f}" if isinstance(vg, float) else "n/a"
        vg_text = f"{vg:.1f}" if isinstance(vg, float) else vg
        print(f"| {name} | {row['backward']:.1f} | {vg_text} | {row['BatchGrad']:.1f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
