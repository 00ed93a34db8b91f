"""One check per (zoo model, extension group): curvlib against tests/oracles/zoo_reference.py (float64).

``check(model_name, group)`` (``check_problem(problem, group)`` for any ``zoo.Problem``) raises ``Wrong`` (an AssertionError) naming the quantity, the
parameter and the relative error when values differ, lets curvlib's exceptions through,
and returns ``{quantity: max relative error}`` when everything agrees. The relative error
of a quantity is ``max|a - b| / max|b|`` with the maximum taken over the whole result
(every parameter). ``PYTHONPATH=src:tests python -m oracles.zoo_checks [models...]`` prints a table for the report.
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict

import torch

from oracles import zoo_reference as oz
from oracles.on_device import seeded
from oracles import zoo
from curvlib import curvature, operators
from curvlib.extensions import (HMP, KFAC, KFLR, BatchDiagGGNExact, BatchDiagGGNMC, BatchDiagHessian, BatchGrad,
                                BatchL2Grad, DiagGGNExact, DiagGGNMC, DiagHessian, GGNMP, SumGradSquared, Variance)

GROUPS = ["first_order", "ggn", "hessian", "kflr", "products", "mc_ggn", "mc_kfac", "operators"]

# 4 x 256 = 1024 draws per sample: an entry's MC standard error is ~ sqrt(var/mean^2 / 1024),
# a few % of the largest entry for CE over 3-160 outputs; the max over thousands of entries
# is a few of those. 8 / sqrt(1024) = 0.25 still catches any mis-scaling (>= 0.5 off).
MC_DRAWS, MC_SAMPLES = 4, 256
MC_RTOL = 8 / (MC_DRAWS * MC_SAMPLES) ** 0.5


class Wrong(AssertionError):
    pass


PHASE = ["-"]  # what runs now: "curvlib" or "oracle" (named by a timeout)


def _phase(what):
    PHASE[0] = what


def run(prob, extensions, **kw):
    """curvlib's quantities for ``prob``, computed on ``prob.computed`` where it has one."""
    _phase("curvlib")
    prob = prob.computed if getattr(prob, "computed", None) is not None else prob
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f = curvature(prob.model, prob.lossfn, extensions, output=prob.output)
        return f(prob.X, prob.y, **kw)


def _relerr(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor], what: str):
    missing = [k for k in expected if k not in actual]
    if missing:
        raise Wrong(f"{what}: no entry for {missing[:3]}{'...' if len(missing) > 3 else ''}")
    worst, where = 0.0, None
    # (an empty parameter, MobileBERT's LM-head ``dense`` of hidden - embedding size = 0 rows here: nothing to compare)
    scale = max([float(v.abs().max()) for v in expected.values() if v.numel()] or [0.0])
    for k, e in expected.items():
        a = actual[k]
        if tuple(a.shape) != tuple(e.shape):
            raise Wrong(f"{what}[{k}]: shape {tuple(a.shape)} != {tuple(e.shape)}")
        a = a.to(e.dtype)  # (a float32 twin's result against a float64 reference)
        if e.numel() == 0:
            continue
        err = float((a - e).abs().max()) / scale if scale > 0 else float((a - e).abs().max())
        if not err <= worst and not (err == err):  # NaN
            return float("nan"), k
        if err > worst:
            worst, where = err, k
    return worst, where


def compare(qs_key, actual, expected, rtol, errors):
    err, where = _relerr(actual, expected, qs_key)
    errors[qs_key] = err
    if not err <= rtol:
        raise Wrong(f"{qs_key}: rel. error {err:.2e} (at {where}) > {rtol:.0e}")


def _dense(f: torch.Tensor) -> torch.Tensor:
    return torch.diag(f) if f.dim() == 1 else f


def _kron_rows(factors, rows: slice) -> torch.Tensor:
    """Rows ``rows`` of the first factor's blocks of ``kron(*factors)``: ``[r, *rest]`` (one or
    two factors), never the whole product."""
    first = _dense(factors[0])[rows]
    if len(factors) == 1:
        return first
    rest = oz.kron(factors[1:])
    return first[:, :, None, None] * rest  # [r, O, I, I]: rows of B ⊗ A, block by block


def _kron_error(a, e) -> float:
    """``max |kron(a) - kron(e)|`` of two factor lists, first bounded through ``B⊗A - B'⊗A' =
    (B - B')⊗A + B'⊗(A - A')`` (``≤ max|B - B'|·max|A| + max|B'|·max|A - A'|``, cheap); only a
    bound above ``tol`` is replaced by the exact value, in blocks of the first factor's rows."""
    a, e = [_dense(f) for f in a], [_dense(f) for f in e]
    if len(e) == 1:
        return float((a[0] - e[0]).abs().max())
    amax = lambda t: float(t.abs().max()) if t.numel() else 0.0  # noqa: E731
    return (amax(a[0] - e[0]) * amax(oz.kron(a[1:])) + amax(e[0]) * amax(oz.kron(a[1:]) - oz.kron(e[1:])))


def _kron_error_exact(a, e) -> float:
    n = _dense(e[0]).shape[0]
    per_row = max(1, int(torch.tensor([_dense(f).numel() for f in e]).prod()) // max(n, 1))
    step, worst = max(1, 2**24 // per_row), 0.0
    for r in range(0, n, step):
        rows = slice(r, r + step)
        worst = max(worst, float((_kron_rows(a, rows) - _kron_rows(e, rows)).abs().max()))
    return worst


def compare_kron(actual, expected, rtol, errors, what="kflr"):
    """``compare`` of Kronecker products ``{name: factors}`` without forming them (a weight of
    32768 entries has an 8 GB product): the max abs. difference of ``kron(actual)`` and
    ``kron(expected)`` (an upper bound where it is below ``rtol``, see :func:`_kron_error`) over
    ``max |kron(expected)|``, the product of the factors' max abs. values."""
    missing = [k for k in expected if k not in actual]
    if missing:
        raise Wrong(f"{what}: no entry for {missing[:3]}")
    scale = max(float(torch.tensor([float(f.abs().max()) for f in v]).prod()) for v in expected.values()) or 1.0
    worst, where = 0.0, None
    for k, e in expected.items():
        a = actual[k]
        shapes = [[tuple(_dense(f).shape) for f in fs] for fs in (a, e)]
        if shapes[0] != shapes[1]:
            raise Wrong(f"{what}[{k}]: factor shapes {shapes[0]} != {shapes[1]}")
        err = _kron_error(a, e) / scale
        if not err <= rtol:  # (the bound, or NaN: the exact value decides)
            err = _kron_error_exact(a, e) / scale
        if err != err:
            errors[what] = float("nan")
            raise Wrong(f"{what}: NaN (at {k})")
        if err > worst:
            worst, where = err, k
    errors[what] = worst
    if not worst <= rtol:
        raise Wrong(f"{what}: rel. error {worst:.2e} (at {where}) > {rtol:.0e}")


def product_param(model) -> str:
    """The parameter whose GGN/Hessian block products are checked: a weight of at most 300
    entries in the middle of ``named_parameters()``."""
    names = [k for k, p in oz.trainable(model).items() if p.dim() >= 2 and p.numel() <= 300]
    return names[len(names) // 2]


def check(name: str, group: str) -> Dict[str, float]:
    """``check_problem`` on the zoo model ``name``."""
    return check_problem(zoo.build(name), group)


def _check_operators(prob: zoo.Problem, rtol: float, errors: Dict[str, float]) -> None:
    """The whole-network GGN and Hessian products (``curvlib.operators``) with one random
    direction over every trainable parameter, against plain autograd on the model itself."""
    _phase("curvlib")
    computed = prob.computed if getattr(prob, "computed", None) is not None else prob
    gen = seeded(0)
    v = {k: torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
         for k, p in oz.trainable(prob.model).items()}
    dtypes = {k: p.dtype for k, p in oz.trainable(computed.model).items()}
    v_computed = {k: t.to(dtypes[k]) for k, t in v.items()}
    data = (computed.X, computed.y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gv = operators.GGN(computed.model, computed.lossfn, data, output=computed.output) @ v_computed
        hv = operators.Hessian(computed.model, computed.lossfn, data, output=computed.output) @ v_computed
    _phase("oracle")
    gv_ref, hv_ref = oz.operator_products(prob, v)
    compare("ggn_product", {k: t.to(torch.float64) for k, t in gv.items()}, gv_ref, rtol, errors)
    compare("hessian_product", {k: t.to(torch.float64) for k, t in hv.items()}, hv_ref,
            10 * rtol if rtol > 1e-8 else rtol, errors)  # (float32 norms: as the "hessian" group)


def check_problem(prob: zoo.Problem, group: str) -> Dict[str, float]:
    """Curvlib against the oracles for one ``Problem`` and one group of :data:`GROUPS`."""
    rtol, errors = prob.rtol, {}
    if group == "first_order":
        qs = run(prob, [BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()])
        _phase("oracle")
        gb = oz.individual_gradients(prob)
        n = gb[next(iter(gb))].shape[0]
        loss = prob.lossfn(oz.forward(prob.model, prob.X, prob.output), prob.y)
        compare("loss", {"": qs["loss"]}, {"": loss.detach()}, rtol, errors)
        compare("grad", qs["grad"], {k: v.sum(0) for k, v in gb.items()}, rtol, errors)
        compare("grad_batch", qs["grad_batch"], gb, rtol, errors)
        compare("batch_l2", qs["batch_l2"], {k: (v**2).flatten(1).sum(1) for k, v in gb.items()}, rtol, errors)
        compare("sum_grad_squared", qs["sum_grad_squared"], {k: (v**2).sum(0) for k, v in gb.items()}, rtol, errors)
        compare("variance", qs["variance"], {k: (v**2).sum(0) / n - (v.sum(0) / n) ** 2 for k, v in gb.items()},
                rtol, errors)
    elif group == "ggn":
        qs = run(prob, [DiagGGNExact(), BatchDiagGGNExact()])
        _phase("oracle")
        d = oz.ggn_diagonals(oz.ggn_parts(prob))
        compare("diag_ggn_exact_batch", qs["diag_ggn_exact_batch"], d, rtol, errors)
        compare("diag_ggn_exact", qs["diag_ggn_exact"], {k: v.sum(0) for k, v in d.items()}, rtol, errors)
    elif group == "operators":
        _check_operators(prob, rtol, errors)
    elif group == "hessian":
        qs = run(prob, [DiagHessian(), BatchDiagHessian()])
        if rtol > 1e-8:
            # float32 normalisations (Llama/Qwen2 RMSNorm, T5LayerNorm): the Hessian diagonal of
            # the embedding rows amplifies their rounding to ~3e-6; the all-float64 twin
            # (zoo "llama_f64norm") agrees to 2e-14, so this is float32 noise, not an error
            rtol = 10 * rtol
        _phase("oracle")
        d = oz.hessian_diagonals(prob)
        compare("diag_h_batch", qs["diag_h_batch"], d, rtol, errors)
        compare("diag_h", qs["diag_h"], {k: v.sum(0) for k, v in d.items()}, rtol, errors)
    elif group == "kflr":
        qs = run(prob, [KFLR(kfac_approx="expand")])
        sites = oz.kron_sites(prob.model)
        params = oz.trainable(prob.model)
        weights = [f"{k}.weight" if k else "weight" for k in sites]
        weights = [w for w in weights if w in params]
        # groups > 1 convolutions: one [B, A] pair per group, stacked ([G, O/G, O/G], [G, I/G·K, I/G·K])
        ndim = {f"{k}.weight" if k else "weight": 3 if getattr(m, "groups", 1) > 1 else 2 for k, m in sites.items()}
        # weight-standardised convolutions (timm's StdConv2d family) convolve a function of the weight,
        # not the weight: docs/supported-models.md's fallback, the diagonal of the exact block
        standardised = [f"{k}.weight" for k, m in sites.items() if "StdConv" in type(m).__name__]
        # a Linear weight tied to an Embedding's (RoBERTa's decoder, named first): tied across
        # layers, the same fallback (docs/supported-models.md)
        embedded = {id(m.weight) for m in prob.model.modules() if isinstance(m, torch.nn.Embedding)}
        standardised += [w for w in weights if id(params[w]) in embedded and w not in standardised]
        # a weight the forward does not use (an LM class's cross-attention) has zero factors in a
        # generic parameter's layout (curvlib.rules.fixed_rows.unused_block): checked zero below
        unused = [w for w in weights if w in qs["kflr"] and len(qs["kflr"][w]) == 1
                  and qs["kflr"][w][0].numel() == params[w].numel() and not qs["kflr"][w][0].any()]
        standardised += unused
        # a layer on an input that is the same for every sample (MarkupLM's xpath layers on the
        # default ids) is part of a parameter-only chain: the same fallback (docs/supported-models.md);
        # where the constant reaches the layer through a tensor that also holds data (CaiT's class
        # token, row 0 of a LayerNorm over [class token, patches]), curvlib reads it as a site of its
        # own, and its two factors are checked against the oracle's like every other site's
        inputs, constant_sites = oz.site_inputs(prob), oz.constant_sites(prob)
        constant = {f"{k}.weight": k for k in inputs
                    if k in constant_sites and f"{k}.weight" in params and f"{k}.weight" not in standardised}
        as_site = {k: inputs[k] for w, k in constant.items() if w in qs["kflr"] and len(qs["kflr"][w]) == 2
                   and oz.plain(prob.model.get_submodule(k), inputs[k])}
        standardised += [w for w, k in constant.items() if k not in as_site]
        # a layer the forward calls several times (CoAT's shared MLPs and position convolutions): a
        # Linear's calls are more positions sharing the weight (two factors, tests/_evaluate/
        # test_kfac_approx.py), any other layer's block is the diagonal of the exact block
        repeated = [f"{k}.weight" for k in oz.repeated_sites(prob) if f"{k}.weight" in params]
        standardised += [w for w in repeated if w in qs["kflr"] and len(qs["kflr"][w]) == 1 and w not in standardised]
        # a convolution on rows that merge the batch with heads (MViTv2's pooling) is run by the
        # generic rule: the same fallback (docs/supported-models.md)
        merged = [f"{k}.weight" for k in oz.merged_row_sites(prob) if f"{k}.weight" in params]
        standardised += [w for w in merged if w in qs["kflr"] and len(qs["kflr"][w]) == 1 and w not in standardised]
        # a Linear subclass whose own forward is not F.linear of its input (DeepSeek-V4's grouped
        # output projection: a bmm of the input's head groups with blocks of the weight) is not a
        # Linear layer to curvlib (its family needs the class's own forward): a generic layer, the
        # same fallback (docs/supported-models.md), its one factor checked below
        own_map = [f"{k}.weight" for k, m in sites.items()
                   if k in inputs and f"{k}.weight" in params and not oz.plain(m, inputs[k])]
        standardised += [w for w in own_map if w in qs["kflr"] and len(qs["kflr"][w]) == 1 and w not in standardised]
        not_two = {w: [tuple(f.shape) for f in qs["kflr"][w]] for w in weights if w not in standardised
                   and w in qs["kflr"] and (len(qs["kflr"][w]) != 2 or any(f.dim() != ndim[w] for f in qs["kflr"][w]))}
        missing = [w for w in weights if w not in qs["kflr"]]
        if missing:
            raise Wrong(f"kflr: no entry for {missing[:3]}")
        if not_two:
            some = dict(list(not_two.items())[:3])
            raise Wrong(f"kflr: {len(not_two)} of {len(weights)} Linear/Conv weights lack two matrix factors, "
                        f"e.g. {some}")
        _phase("oracle")
        if standardised:
            diag = {k: v.sum(0) for k, v in oz.ggn_diagonals(oz.ggn_parts(prob)).items()}
            compare("kflr (diagonal of a standardised or tied weight)",
                    {w: qs["kflr"][w][0].reshape(diag[w].shape) for w in standardised if len(qs["kflr"][w]) == 1},
                    {w: diag[w] for w in standardised}, rtol, errors)
        ref = oz.kflr_factors(prob, "expand", {**oz.kflr_sites(prob), **as_site})
        compare_kron({k: qs["kflr"][k] for k in ref if k in qs["kflr"]}, ref, rtol, errors)
        errors["kflr_sites_checked"] = f"{sum(k.endswith('weight') for k in ref)}/{len(weights)}"
    elif group == "products":
        p = product_param(prob.model)
        qs = run(prob, [GGNMP(), HMP()])
        shape = oz.trainable(prob.model)[p].shape
        V = torch.randn(4, *shape, generator=seeded(3), dtype=torch.float64)
        _phase("oracle")
        G = oz.ggn_block(oz.ggn_parts(prob), p)
        H = oz.hessian_block(prob, p)
        compare("ggnmp", {p: qs["ggnmp"][p](V)}, {p: (V.flatten(1) @ G).reshape(V.shape)}, rtol, errors)
        compare("hmp", {p: qs["hmp"][p](V)}, {p: (V.flatten(1) @ H).reshape(V.shape)}, rtol, errors)
        errors["param"] = p
    elif group == "mc_ggn":
        _phase("oracle")
        d = oz.ggn_diagonals(oz.ggn_parts(prob))
        mean, bmean = None, None
        for s in range(MC_DRAWS):
            qs = run(prob, [DiagGGNMC(mc_samples=MC_SAMPLES), BatchDiagGGNMC(mc_samples=MC_SAMPLES)],
                     generator=seeded(100 + s))
            mean = {k: v / MC_DRAWS + (0 if mean is None else mean[k]) for k, v in qs["diag_ggn_mc"].items()}
            bmean = {k: v / MC_DRAWS + (0 if bmean is None else bmean[k]) for k, v in qs["diag_ggn_mc_batch"].items()}
        compare("diag_ggn_mc", mean, {k: v.sum(0) for k, v in d.items()}, MC_RTOL, errors)
        compare("diag_ggn_mc_batch", bmean, d, MC_RTOL, errors)
    elif group == "mc_kfac":
        exact = run(prob, [KFLR(kfac_approx="expand")])["kflr"]
        mean = None
        for s in range(MC_DRAWS):
            qs = run(prob, [KFAC(mc_samples=MC_SAMPLES, kfac_approx="expand")],
                     generator=seeded(200 + s))
            k_ = {k: oz.kron(v) / MC_DRAWS for k, v in qs["kfac"].items()}
            mean = k_ if mean is None else {k: mean[k] + v for k, v in k_.items()}
        # against curvlib's own KFLR (checked against the oracle by the "kflr" group)
        compare("kfac", mean, {k: oz.kron(v) for k, v in exact.items()}, MC_RTOL, errors)
    else:
        raise KeyError(group)
    return errors


def _alarm(signum, frame):
    raise TimeoutError("still running after the time limit")


def outcome(name: str, group: str, limit: int = 0) -> str:
    """``pass (...)`` / ``wrong: ...`` / ``error: Type: first line``, for the report."""
    return outcome_of(lambda: check(name, group), limit)


def outcome_of(run_check: Callable[[], Dict[str, float]], limit: int = 0) -> str:
    """``outcome`` of ``run_check()`` (a ``check`` or ``check_problem`` call)."""
    import signal

    PHASE[0] = "build"
    if limit:
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(limit)
    try:
        errs = run_check()
    except Wrong as e:
        return f"wrong: {e}"
    except Exception as e:  # noqa: BLE001 - the report lists it
        first = (str(e).strip().splitlines() or [""])[0]
        return f"error in {PHASE[0]}: {type(e).__name__}: {first[:300]}"
    finally:
        if limit:
            signal.alarm(0)
    nums = [v for v in errs.values() if isinstance(v, float)]
    extra = "; ".join(f"{k}={v}" for k, v in errs.items() if not isinstance(v, float))
    return f"pass (max rel. err {max(nums):.1e}{'; ' + extra if extra else ''})"


if __name__ == "__main__":
    import sys
    import time

    import torchvision_shim

    torchvision_shim.install()
    torch.set_num_threads(1)
    args = sys.argv[1:]
    limit = int(args.pop(0)[2:]) if args and args[0].startswith("-t") else 150
    groups = [a for a in args if a in GROUPS] or GROUPS
    names = [a for a in args if a not in GROUPS] or zoo.NAMES
    for name in names:
        for group in groups:
            t = time.time()
            print(f"{name}\t{group}\t{outcome(name, group, limit)}\t{time.time() - t:.1f}s", flush=True)


def check_exact(prob, rtol: float = 1e-9, kflr_skip: tuple = ()) -> None:
    """BatchGrad, DiagGGNExact and KFLR of ``prob`` (a :class:`oracles.zoo.Problem`) equal the
    float64 brute force of tests/oracles/zoo_reference.py (the model's own autograd, every
    sample alone); raises :class:`Wrong` naming the quantity and parameter. ``kflr_skip``:
    prefixes of layers whose Kronecker factors the oracle does not define as curvlib does
    (a layer on constants is a functional site: its exact block, not ``B ⊗ A``)."""
    errors: Dict[str, float] = {}
    compare("grad_batch", run(prob, [BatchGrad()])["grad_batch"], oz.individual_gradients(prob), rtol, errors)
    ggn = {k: v.sum(0) for k, v in oz.ggn_diagonals(oz.ggn_parts(prob)).items()}
    compare("diag_ggn_exact", run(prob, [DiagGGNExact()])["diag_ggn_exact"], ggn, rtol, errors)
    expected = {k: v for k, v in oz.kflr_factors(prob).items() if not k.startswith(kflr_skip)}
    if expected:
        kflr = run(prob, [KFLR()])["kflr"]
        compare("kflr", {k: oz.kron(kflr[k]) for k in expected if k in kflr},
                {k: oz.kron(v) for k, v in expected.items()}, rtol, errors)
