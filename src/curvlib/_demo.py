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
or an extension raises.

Timings: each extension alone, ``curvature(model, lossfn, [ext])(X, y)``,
median over interleaved rounds, relative to a plain gradient
``lossfn(model(X), y).backward()`` timed in the same rounds.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import sys
import time
from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, hessian, jacrev, vmap

from . import curvature
from . import extensions as _extensions
from .extensions import Extension

TOLERANCE = 1e-8
ROUNDS = 15


# --------------------------------------------------------------------------- problem


def problem(n: int = 8, seed: int = 0) -> Tuple[nn.Module, nn.Module, Tensor, Tensor]:
    """Tiny CNN on ``[N, 1, 6, 6]`` inputs with 3 classes, float64, seeded."""
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(
            OrderedDict(
                conv=nn.Conv2d(1, 3, 3),
                relu=nn.ReLU(),
                pool=nn.MaxPool2d(2),
                flatten=nn.Flatten(),
                fc=nn.Linear(3 * 2 * 2, 3),
            )
        ).double()
    X = torch.randn(n, 1, 6, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=gen)
    return model, nn.CrossEntropyLoss(), X, y


# --------------------------------------------------------------------------- references


class Reference:
    """Brute-force quantities of one problem, computed lazily and cached.

    Attributes:
        names: trainable parameter names, in the model's order.
        shapes: their shapes; ``P`` is the sum of their sizes.
    """

    def __init__(self, model: nn.Module, lossfn: nn.Module, X: Tensor, y: Tensor):
        self.model, self.lossfn, self.X, self.y = model, lossfn, X, y
        self.params = {n: p.detach() for n, p in model.named_parameters()}
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.shapes = [self.params[n].shape for n in self.names]
        self.sizes = [self.params[n].numel() for n in self.names]
        self._cache: Dict[str, object] = {}

    # helpers ------------------------------------------------------------

    def _cached(self, key: str, make: Callable[[], object]):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def _unflatten(self, theta: Tensor) -> Dict[str, Tensor]:
        return {**self.params, **dict(zip(self.names, (t.view(s) for t, s in zip(theta.split(self.sizes), self.shapes))))}

    def _theta(self) -> Tensor:
        return torch.cat([self.params[n].flatten() for n in self.names])

    def _blocks(self, flat: Tensor) -> Dict[str, Tensor]:
        """``[..., P] -> {name: [..., *p.shape]}``."""
        lead = flat.shape[:-1]
        return {n: t.reshape(*lead, *s) for n, t, s in zip(self.names, flat.split(self.sizes, -1), self.shapes)}

    def _diag_blocks(self, mat: Tensor) -> Dict[str, Tensor]:
        """Block diagonals of ``[..., P, P]`` as ``{name: [..., *p.shape]}``."""
        return self._blocks(torch.diagonal(mat, dim1=-2, dim2=-1))

    def _block_grams(self, mat: Tensor) -> Dict[str, "Gram"]:
        """``{name: Gram(M_pp)}`` for the diagonal blocks of ``[P, P]``."""
        out, start = {}, 0
        for n, size in zip(self.names, self.sizes):
            out[n] = Gram(mat[start : start + size, start : start + size])
            start += size
        return out

    def _block_products(self, mat: Tensor) -> Dict[str, Callable[[Tensor], Tensor]]:
        """``{name: V ↦ V · M_pp}`` for the diagonal blocks of a symmetric ``[P, P]``."""
        out, start = {}, 0
        for n, size, shape in zip(self.names, self.sizes, self.shapes):
            block = mat[start : start + size, start : start + size]
            out[n] = lambda V, block=block, shape=shape: (V.flatten(1) @ block).reshape(V.shape[0], *shape)
            start += size
        return out

    @property
    def scale(self) -> float:
        """The reduction factor ``c`` of one sample's loss (``1/N`` for ``"mean"``)."""
        return 1.0 / self.X.shape[0] if self.lossfn.reduction == "mean" else 1.0

    # first order ----------------------------------------------------------

    def grad(self) -> Dict[str, Tensor]:
        """Autograd's gradient of ``lossfn(model(X), y)``."""

        def make():
            ps = [p for n, p in self.model.named_parameters() if n in self.names]
            gs = torch.autograd.grad(self.lossfn(self.model(self.X), self.y), ps)
            return dict(zip(self.names, gs))

        return self._cached("grad", make)

    def grad_batch(self) -> Dict[str, Tensor]:
        """``g_n = c ∇_θ ℓ_n`` by ``vmap(grad)`` over samples, ``[N, *p.shape]``."""

        def make():
            def loss_one(trainable, x, t):
                out = functional_call(self.model, {**self.params, **trainable}, (x.unsqueeze(0),))
                return self.lossfn(out, t.unsqueeze(0)) * self.scale

            trainable = {n: self.params[n] for n in self.names}
            return vmap(grad(loss_one), in_dims=(None, 0, 0))(trainable, self.X, self.y)

        return self._cached("grad_batch", make)

    # second order ---------------------------------------------------------

    def hessian(self) -> Tensor:
        """``∇²_θ L`` of the batch loss, ``[P, P]``."""

        def make():
            def loss(theta):
                return self.lossfn(functional_call(self.model, self._unflatten(theta), (self.X,)), self.y)

            return hessian(loss)(self._theta())

        return self._cached("hessian", make)

    def hessian_batch(self) -> Tensor:
        """``H_n = ∇²_θ (c·ℓ_n)``, ``[N, P, P]``; they sum to :meth:`hessian`."""

        def make():
            def loss_one(theta, x, t):
                out = functional_call(self.model, self._unflatten(theta), (x.unsqueeze(0),))
                return self.lossfn(out, t.unsqueeze(0)) * self.scale

            theta = self._theta()
            return torch.stack([hessian(loss_one)(theta, x, t) for x, t in zip(self.X, self.y)])

        return self._cached("hessian_batch", make)

    def _jacobian_and_output_hessian(self) -> Tuple[Tensor, Tensor]:
        """``J = ∂f/∂θ`` ``[N, K, P]`` and ``∇²_f L`` ``[N, K, N, K]`` (``K`` outputs per sample)."""

        def make():
            theta = self._theta()
            out = functional_call(self.model, self.params, (self.X,)).detach()
            J = jacrev(lambda th: functional_call(self.model, self._unflatten(th), (self.X,)))(theta)
            H = hessian(lambda o: self.lossfn(o, self.y))(out)
            n = out.shape[0]
            k = out[0].numel()
            return J.reshape(n, k, -1), H.reshape(n, k, n, k)

        return self._cached("ggn_pieces", make)

    def ggn(self) -> Tensor:
        """``G = Jᵀ (∇²_f L) J``, ``[P, P]``."""
        J, H = self._jacobian_and_output_hessian()
        return torch.einsum("nkp,nkml,mlq->pq", J, H, J)

    def ggn_batch(self) -> Tensor:
        """``G_n = J_nᵀ (∇²_{f_n} L) J_n``, ``[N, P, P]``; they sum to :meth:`ggn`."""
        J, H = self._jacobian_and_output_hessian()
        return torch.einsum("nkp,nknl,nlq->npq", J, H, J)


class Gram:
    """Expected value of a matrix square root ``S`` ``[V, N, *p.shape]``, known only up to rotation.

    ``S`` is checked through ``Σ_{v,n} S[v,n] S[v,n]ᵀ`` (flattened over
    ``p``), which must equal the block ``M_pp``.
    """

    def __init__(self, block: Tensor):
        self.block = block

    def deviation(self, value: object) -> float:
        if not isinstance(value, Tensor) or value[0, 0].numel() != self.block.shape[0]:
            return float("inf")
        S = value.flatten(2).flatten(0, 1)
        return (S.T @ S - self.block).abs().max().item()


def _first(q: Callable[[Dict[str, Tensor]], Dict[str, Tensor]]):
    return lambda ref: q(ref.grad_batch())


# Result name -> reference (``None``: no deterministic reference, unchecked).
REFERENCES: Dict[str, Optional[Callable[[Reference], Dict[str, object]]]] = {
    "grad_batch": _first(lambda gb: dict(gb)),
    "batch_l2": _first(lambda gb: {k: (v**2).flatten(1).sum(1) for k, v in gb.items()}),
    "sum_grad_squared": _first(lambda gb: {k: (v**2).sum(0) for k, v in gb.items()}),
    "variance": _first(
        lambda gb: {k: (v**2).mean(0) - v.mean(0) ** 2 for k, v in gb.items()}
    ),
    "diag_ggn_exact": lambda ref: ref._diag_blocks(ref.ggn()),
    "diag_ggn_exact_batch": lambda ref: ref._diag_blocks(ref.ggn_batch()),
    "diag_h": lambda ref: ref._diag_blocks(ref.hessian()),
    "diag_h_batch": lambda ref: ref._diag_blocks(ref.hessian_batch()),
    "ggnmp": lambda ref: ref._block_products(ref.ggn()),
    "hmp": lambda ref: ref._block_products(ref.hessian()),
    # The demo's only nonlinearities are ReLU and max-pooling (f'' = 0) and
    # the cross-entropy Hessian is positive semi-definite, so here the
    # positive-curvature Hessian equals the GGN. Revisit if the problem changes.
    "pchmp": lambda ref: ref._block_products(ref.ggn()),
    "sqrt_ggn_exact": lambda ref: ref._block_grams(ref.ggn()),
    # Monte-Carlo estimates and Kronecker factors: no exact reference here.
    "diag_ggn_mc": None,
    "diag_ggn_mc_batch": None,
    "sqrt_ggn_mc": None,  # Monte-Carlo
    "kfac": None,
    "kflr": None,
    "kfra": None,
}


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


def instantiate(cls: type) -> Extension:
    """Default instance; Monte-Carlo extensions get a seeded generator."""
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    if "generator" in fields:
        return cls(generator=torch.Generator().manual_seed(0))
    return cls()


def _probe(value: Callable[[Tensor], Tensor], shape: torch.Size, dtype: torch.dtype) -> Tensor:
    V = torch.randn(2, *shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
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

    Runs with one torch thread (tiny float64 convolutions are far slower with
    several) and restores the caller's thread count afterwards.
    """
    del argv
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run()
    finally:
        torch.set_num_threads(threads)


def _run() -> int:
    model, lossfn, X, y = problem()
    ref = Reference(model, lossfn, X, y)
    classes = exported_extensions()
    print(
        f"curvlib demo: {len(classes)} extensions on a tiny CNN "
        f"({' -> '.join(type(m).__name__ for m in model)}), N={X.shape[0]}, "
        f"X {list(X.shape)}, float64, {type(lossfn).__name__}(reduction={lossfn.reduction!r})"
    )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); tolerance {TOLERANCE:g}\n")

    failures: List[str] = []
    unchecked: List[str] = []
    results: Dict[str, Dict[str, object]] = {}
    expected: Dict[str, Optional[Dict[str, object]]] = {}
    calls: Dict[str, Callable[[], object]] = {}
    label: Dict[str, str] = {}

    def plain_gradient():
        model.zero_grad(set_to_none=True)
        lossfn(model(X), y).backward()

    calls["loss.backward"] = plain_gradient
    first = curvature(model, lossfn, [])(X, y)
    results["grad"], expected["grad"] = first["grad"], ref.grad()
    results["loss"] = first["loss"]
    for cls in classes:
        ext = instantiate(cls)
        label[ext.name] = cls.__name__
        try:
            f = curvature(model, lossfn, [ext])
            results[ext.name] = f(X, y)[ext.name]
            calls[cls.__name__] = lambda f=f: f(X, y)
        except Exception as err:  # noqa: BLE001 - reported, and the demo fails
            failures.append(f"{cls.__name__}: raised {type(err).__name__}: {err}")
            continue
        make = REFERENCES.get(ext.name)
        if make is None:
            unchecked.append(cls.__name__)
            expected[ext.name] = None
        else:
            expected[ext.name] = make(ref)

    loss_dev = abs(results["loss"].item() - lossfn(model(X), y).item())
    print(f"loss {results['loss'].item():.6f} (deviation {loss_dev:.1e})\n")
    if not loss_dev <= TOLERANCE:
        failures.append(f"loss: deviation {loss_dev:.2e}")

    for name in ref.names:
        p = ref.params[name]
        rows = []
        for q, per_param in results.items():
            if q == "loss":
                continue
            what = "grad" if q == "grad" else f"{label.get(q, q)} ({q})"
            if name not in per_param:
                rows.append([what, "missing", "-", "-"])
                failures.append(f"{what}: no entry for parameter {name!r}")
                continue
            value = per_param[name]
            exp = expected.get(q)
            if exp is None:
                dev_s = "unchecked"
            else:
                dev = deviation(value, exp[name], p.shape, p.dtype)
                dev_s = f"{dev:.1e}"
                if not dev <= TOLERANCE:
                    dev_s += "  FAIL"
                    failures.append(f"{what}[{name}]: max |deviation| {dev:.2e} > {TOLERANCE:g}")
            rows.append([what, _layout(value), summary(value, p.shape, p.dtype), dev_s])
        print(f"parameter {name}  shape {list(p.shape)}")
        print(_table(["quantity", "layout", "norm", "max |dev|"], rows))
        print()

    medians = _time(calls, ROUNDS)
    base = medians["loss.backward"]
    rows = [[k, f"{1e3 * t:.3f}", f"{t / base:.2f}"] for k, t in medians.items()]
    print(f"time per call, median of {ROUNDS} interleaved rounds (each extension alone):")
    print(_table(["method", "ms", "x loss.backward"], rows))
    print()

    if unchecked:
        print(f"unchecked (no exact reference): {', '.join(unchecked)}")
    if failures:
        print("FAILED:")
        for f in failures:
            print(f"  {f}")
        return 1
    print(f"all checks passed: {len(classes) - len(unchecked)} extensions and the gradient match autograd to {TOLERANCE:g}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
