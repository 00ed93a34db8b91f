"""``python -m curvlib``: run every extension on a tiny CNN and check it.

The demo builds a small seeded float64 problem (Conv2d, ReLU, MaxPool2d,
Flatten, Linear; ``N = 8``; ``CrossEntropyLoss()``), runs every extension that
:mod:`curvlib.extensions` exports, and compares each result with a
brute-force reference computed with plain autograd / :mod:`torch.func`:

* individual gradients ``g_n = (1/N) ∇_θ ℓ_n`` from ``vmap(grad(ℓ_n))`` (the
  ``1/N`` is the ``"mean"`` reduction's factor, BackPACK's convention); every
  first-order quantity is built from them;
* Hessians: ``H = ∇²_θ L`` of the batch loss and ``H_n = ∇²_θ (c·ℓ_n)`` of
  each sample's share of it, by :func:`torch.func.hessian` on the flattened
  parameters;
* GGN ``G = Jᵀ (∇²_f L) J`` with ``J = ∂f/∂θ`` ``[N·C, P]`` the Jacobian of
  the whole output, and per sample ``G_n = J_nᵀ (∇²_{f_n} L) J_n``; a square
  root ``S`` of a GGN block (known only up to rotation) is checked through
  ``SᵀS``.

:data:`REFERENCES` maps an extension's result name to its reference; a name
mapped to ``None`` (Monte-Carlo estimates, Kronecker factors) or missing is
reported as *unchecked*. Matrix-product extensions (results that are
callables ``[V, *p.shape] -> [V, *p.shape]``) are compared on seeded random
``V``. The exit code is 1 if any checked deviation exceeds :data:`TOLERANCE`
or an extension raises. The problem and the references live in
:mod:`curvlib._demo.problem` (re-exported here).

Timings: each extension alone, ``curvature(model, lossfn, [ext])(X, y)``,
median over interleaved rounds, relative to a plain gradient
``lossfn(model(X), y).backward()`` timed in the same rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from .. import curvature
from .. import extensions as _extensions
from .cli import COLUMNS, device_of, parser, selected
from .problem import REFERENCES, Gram, Reference, problem
from ..extensions import Extension

__all__ = [
    "REFERENCES", "ROUNDS", "TOLERANCE", "Gram", "Reference", "deviation", "exported_extensions",
    "instantiate", "main", "problem", "summary",
]

TOLERANCE = 1e-8
ROUNDS = 15


# --------------------------------------------------------------------------- comparison


def exported_extensions() -> List[type]:
    """Every extension class :mod:`curvlib.extensions` exports, in ``__all__`` order."""
    found = []
    for name in getattr(_extensions, "__all__", dir(_extensions)):
        obj = getattr(_extensions, name)
        # Base classes (Extension, SecondOrder, ...) have no result name.
        if isinstance(obj, type) and issubclass(obj, Extension) and obj.name:
            found.append(obj)
    return found


def instantiate(cls: type, device: Union[str, torch.device] = "cpu") -> Extension:
    """Default instance; Monte-Carlo extensions get a seeded generator on ``device``."""
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    if "generator" in fields:
        return cls(generator=torch.Generator(device).manual_seed(0))
    return cls()


def _probe(value: Callable[[Tensor], Tensor], shape: torch.Size, dtype: torch.dtype) -> Tensor:
    # the same CPU stream on every device; the demo runs under its device as the default
    V = torch.randn(2, *shape, generator=torch.Generator().manual_seed(1), dtype=dtype, device="cpu")
    V = V.to(torch.get_default_device())
    return value(V)


def _as_tensor(value: object, shape: torch.Size, dtype: torch.dtype) -> Optional[Tensor]:
    """A tensor standing for a result: itself, its factors concatenated, or its product with a probe."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, Tensor) for v in value):
        return torch.cat([v.flatten() for v in value]) if value else torch.zeros(0, dtype=dtype)
    if callable(value):
        return _probe(value, shape, dtype)
    return None


def summary(value: object, shape: torch.Size, dtype: torch.dtype) -> str:
    """Norm of the result (of its factors; of its product with the probe ``V``)."""
    t = _as_tensor(value, shape, dtype)
    if t is None:
        return type(value).__name__
    return f"{t.norm().item():.4e}"


def deviation(value: object, expected: object, shape: torch.Size, dtype: torch.dtype) -> float:
    """``max |value − expected|``; ``inf`` if the layouts differ."""
    if isinstance(expected, Gram):
        return expected.deviation(value)
    a, e = _as_tensor(value, shape, dtype), _as_tensor(expected, shape, dtype)
    if a is None or e is None or a.shape != e.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return (a - e).abs().max().item()


def _layout(value: object) -> str:
    if isinstance(value, Tensor):
        return str(list(value.shape))
    if isinstance(value, (list, tuple)):
        return f"{len(value)} factors " + " ".join(str(list(v.shape)) for v in value if isinstance(v, Tensor))
    if callable(value):
        return "callable"
    return type(value).__name__


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = lambda row: "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)])


# --------------------------------------------------------------------------- main


def _time(calls: Dict[str, Callable[[], object]], rounds: int) -> Dict[str, float]:
    """Median seconds per call, interleaved rounds in shuffled order (after one warm-up)."""
    for call in calls.values():
        call()
    times: Dict[str, List[float]] = {k: [] for k in calls}
    order = list(calls)
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for k in order:
            t0 = time.perf_counter()
            calls[k]()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the demo; print the tables; return 0 if every check passes, 1 otherwise.

    ``argv``: command-line arguments (``python -m curvlib --help`` lists them);
    ``None`` runs the defaults without writing a figure. Runs with one torch
    thread (tiny float64 convolutions are far slower with several) and restores
    the caller's thread count afterwards.
    """
    args = parser(ROUNDS).parse_args(list(argv) if argv is not None else ["--no-plot"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


@dataclasses.dataclass
class _Outcome:
    """What the extensions gave, per result name (``"grad"``, ``"loss"``, ``ext.name``).

    Attributes:
        results: name -> parameter name -> value (``"loss"``: the loss tensor).
        expected: name -> parameter name -> reference; ``None``: unchecked.
        calls: timing label -> a call that recomputes it (``"loss.backward"`` first).
        label: result name -> extension class name.
        deviations: result name -> parameter name -> ``max |dev|`` (checked ones only).
        failures, unchecked: messages and class names for the verdict.
    """

    results: Dict[str, Dict[str, object]] = dataclasses.field(default_factory=dict)
    expected: Dict[str, Optional[Dict[str, object]]] = dataclasses.field(default_factory=dict)
    calls: Dict[str, Callable[[], object]] = dataclasses.field(default_factory=dict)
    label: Dict[str, str] = dataclasses.field(default_factory=dict)
    deviations: Dict[str, Dict[str, float]] = dataclasses.field(default_factory=dict)
    failures: List[str] = dataclasses.field(default_factory=list)
    unchecked: List[str] = dataclasses.field(default_factory=list)


def _run(args: argparse.Namespace) -> int:
    """The demo's stages: problem, extensions, loss check, tables, timings, figure, verdict."""
    device = device_of(args.device)
    _progress(f"[1/4] building the problem and its brute-force references on {device}")
    model, lossfn, X, y = problem()  # built on CPU (its CPU generator), then placed
    model, X, y = model.to(device), X.to(device), y.to(device)
    classes = selected(exported_extensions, args.extensions)
    with torch.device(device):
        return _check_and_time(args, model, lossfn, X, y, classes)


def _check_and_time(args: argparse.Namespace, model, lossfn, X: Tensor, y: Tensor, classes) -> int:
    """Stages 2-4 on the demo's device (the default device meanwhile)."""
    ref = Reference(model, lossfn, X, y)
    _print_header(model, lossfn, X, len(classes))
    _progress(f"[2/4] running {len(classes)} extension(s), each against its reference")
    outcome = _run_extensions(model, lossfn, X, y, ref, classes)
    _check_loss(outcome, lossfn(model(X), y).item())
    print(COLUMNS + "\n")
    for name in ref.names:
        _print_parameter(name, ref.params[name], outcome)
    _progress(f"[3/4] timing {len(outcome.calls)} methods, {args.rounds} interleaved rounds")
    ratios = _print_timings(outcome.calls, args.rounds)
    code = _verdict(outcome, len(classes))
    if not args.no_plot:
        _save_figure(args.out, ratios, outcome, ref.names, X, code)
    return code


def _progress(message: str) -> None:
    """A progress line on stderr (the tables go to stdout)."""
    print(message, file=sys.stderr, flush=True)


def _save_figure(path: str, ratios, outcome: "_Outcome", names: Sequence[str], X: Tensor, code: int) -> None:
    """The PNG summary (:mod:`curvlib._demo.plot`); a missing matplotlib is reported, not fatal."""
    deviations = {
        ("grad" if q == "grad" else f"{outcome.label.get(q, q)} ({q})"): outcome.deviations.get(q, {})
        for q in outcome.results if q != "loss"
    }
    verdict = "all checks passed" if code == 0 else "FAILED"
    title = f"curvlib demo: tiny CNN, N={X.shape[0]}, float64, {X.device.type}: {verdict}"
    try:
        from .plot import save_summary  # optional: matplotlib

        _progress(f"[4/4] figure: {save_summary(path, ratios, deviations, list(names), TOLERANCE, title)}")
    except ImportError as err:
        _progress(f"[4/4] no figure: {err} (pip install matplotlib)")


def _print_header(model: nn.Module, lossfn: nn.Module, X: Tensor, count: int) -> None:
    print(
        f"curvlib demo: {count} extensions on a tiny CNN "
        f"({' -> '.join(type(m).__name__ for m in model)}), N={X.shape[0]}, "
        f"X {list(X.shape)}, float64, {type(lossfn).__name__}(reduction={lossfn.reduction!r})"
    )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); tolerance {TOLERANCE:g}\n")


def _run_extensions(
    model: nn.Module, lossfn: nn.Module, X: Tensor, y: Tensor, ref: Reference, classes: Sequence[type]
) -> _Outcome:
    """The plain gradient and loss (no extension), then every extension alone, with references."""
    outcome = _Outcome()

    def plain_gradient():
        model.zero_grad(set_to_none=True)
        lossfn(model(X), y).backward()

    outcome.calls["loss.backward"] = plain_gradient
    first = curvature(model, lossfn, [])(X, y)
    outcome.results["grad"], outcome.expected["grad"] = first["grad"], ref.grad()
    outcome.results["loss"] = first["loss"]
    for k, cls in enumerate(classes, 1):
        if sys.stderr.isatty():  # one line, rewritten in place
            print(f"\r      {k}/{len(classes)} {cls.__name__:<24}", end="", file=sys.stderr, flush=True)
        _run_extension(cls, model, lossfn, X, y, ref, outcome)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    return outcome


def _run_extension(
    cls: type, model: nn.Module, lossfn: nn.Module, X: Tensor, y: Tensor, ref: Reference, outcome: _Outcome
) -> None:
    """``curvature(model, lossfn, [ext])(X, y)`` for one extension class, into ``outcome``."""
    ext = instantiate(cls, X.device)
    outcome.label[ext.name] = cls.__name__
    try:
        f = curvature(model, lossfn, [ext])
        outcome.results[ext.name] = f(X, y)[ext.name]
        outcome.calls[cls.__name__] = lambda f=f: f(X, y)
    except Exception as err:  # noqa: BLE001 - reported, and the demo fails
        outcome.failures.append(f"{cls.__name__}: raised {type(err).__name__}: {err}")
        return
    make = REFERENCES.get(ext.name)
    if make is None:
        outcome.unchecked.append(cls.__name__)
        outcome.expected[ext.name] = None
    else:
        outcome.expected[ext.name] = make(ref)


def _check_loss(outcome: _Outcome, autograd_loss: float) -> None:
    """The loss curvlib returned against ``lossfn(model(X), y)``."""
    loss_dev = abs(outcome.results["loss"].item() - autograd_loss)
    print(f"loss {outcome.results['loss'].item():.6f} (deviation {loss_dev:.1e})\n")
    if not loss_dev <= TOLERANCE:
        outcome.failures.append(f"loss: deviation {loss_dev:.2e}")


def _print_parameter(name: str, p: Tensor, outcome: _Outcome) -> None:
    """One parameter's table: every result's layout, norm and deviation from its reference."""
    rows = []
    for q, per_param in outcome.results.items():
        if q == "loss":
            continue
        what = "grad" if q == "grad" else f"{outcome.label.get(q, q)} ({q})"
        if name not in per_param:
            rows.append([what, "missing", "-", "-"])
            outcome.failures.append(f"{what}: no entry for parameter {name!r}")
            continue
        value = per_param[name]
        dev_s = _deviation_cell(what, name, value, outcome.expected.get(q), p, outcome.failures,
                                outcome.deviations.setdefault(q, {}))
        rows.append([what, _layout(value), summary(value, p.shape, p.dtype), dev_s])
    print(f"parameter {name}  shape {list(p.shape)}")
    print(_table(["quantity", "layout", "norm", "max |dev|"], rows))
    print()


def _deviation_cell(
    what: str, name: str, value: object, exp: Optional[Dict[str, object]], p: Tensor, failures: List[str],
    into: Dict[str, float],
) -> str:
    """``max |value − reference|`` as a table cell (``FAIL`` above :data:`TOLERANCE`, noted in
    ``failures``), also kept in ``into[name]``."""
    if exp is None:
        return "unchecked"
    dev = into[name] = deviation(value, exp[name], p.shape, p.dtype)
    dev_s = f"{dev:.1e}"
    if not dev <= TOLERANCE:
        dev_s += "  FAIL"
        failures.append(f"{what}[{name}]: max |deviation| {dev:.2e} > {TOLERANCE:g}")
    return dev_s


def _print_timings(calls: Dict[str, Callable[[], object]], rounds: int = ROUNDS) -> Dict[str, float]:
    """Median time per call, and relative to the plain ``loss.backward`` (returned: label -> ratio)."""
    medians = _time(calls, rounds)
    base = medians["loss.backward"]
    rows = [[k, f"{1e3 * t:.3f}", f"{t / base:.2f}"] for k, t in medians.items()]
    print(f"time per call, median of {rounds} interleaved rounds (each extension alone):")
    print(_table(["method", "ms", "x loss.backward"], rows))
    print()
    return {k: t / base for k, t in medians.items()}


def _verdict(outcome: _Outcome, count: int) -> int:
    """Print the unchecked extensions and any failures; 0 if none failed, else 1."""
    if outcome.unchecked:
        print(f"unchecked (no exact reference): {', '.join(outcome.unchecked)}")
    if outcome.failures:
        print("FAILED:")
        for f in outcome.failures:
            print(f"  {f}")
        return 1
    print(
        f"all checks passed: {count - len(outcome.unchecked)} extensions and the gradient match autograd to "
        f"{TOLERANCE:g}"
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
