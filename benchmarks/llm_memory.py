"""Peak memory and time of curvlib's methods and peers on language models: ``gpt2-small``
and the model-size sweep ``gpt-sweep-d{D}-l{L}`` (``problems.LLM_PROBLEMS``).

    python benchmarks/llm_memory.py                                    # gpt2-small, every method
    python benchmarks/llm_memory.py --methods DiagGGNMC KFAC[max_factor_dim=4096] --rounds 2
    python benchmarks/llm_memory.py --problems sweep --rounds 2        # the diagonal, SWEEP_METHODS
    python benchmarks/llm_memory.py --problems gpt-sweep-d128-l2 --methods backward opacus:ghost-norms \
        opacus:clipping-step curvlinops:KFAC[mlp] --rounds 2           # peers (PEERS)
    python benchmarks/llm_memory.py --check                            # opacus:clipping-step's .grad
    git archive b0adc77 src | tar -x -C /tmp/before                    # another tree as well:
    python benchmarks/llm_memory.py --tree before=/tmp/before/src --tree after=src

Each measurement runs in a fresh Python process (``memory_knobs.spawn``: ``PYTHONPATH`` is
the tree's ``src``), one at a time, under an address-space limit (``--max-gib``, default 16:
an allocation past it fails in that process instead of pressing the machine):

* **peak memory**: the process builds the problem (``problems.PROBLEMS``, default
  ``gpt2-small``: 163 M parameters, N=4, T=128, vocab 50257), pays curvlib's lazy imports
  (``run.prewarm``), sets the method up (a peer's copy of the model: Opacus'), lets the
  problem go (only what the method holds stays), resets the high-water mark
  (``/proc/self/clear_refs``), calls the method once (tracing included) and reads ``VmHWM``:
  ``call_above_mib`` is that peak above ``VmRSS`` just before the call, the call's own peak
  with whatever model the method runs on already built. ``above_mib`` is the older measure,
  the process's peak (``ru_maxrss``, setup included) above a process that only builds the
  problem (once per tree and problem); the two agree for curvlib's methods, while a peer's
  setup (Opacus copies the model) shows in the second only. ``backward`` is a plain
  ``lossfn(model(X), y).backward()``.
* **time**: another process sets the method and a backward up, calls each once untimed
  (tracing, allocator warm-up), then alternates ``--rounds`` timed calls of each; the
  ratio is the method's median over the backward's median in that process.

Peers (``PEERS``): ``opacus:backward`` (a plain backward of Opacus' copy of the GPT),
``opacus:ghost-norms`` (ghost clipping's per-sample gradient norms alone, one backward),
``opacus:clipping-step`` (Opacus' whole ghost-clipping DP step up to the clipped summed
gradient, set up by ``PrivacyEngine.make_private(..., grad_sample_mode="ghost")``: norms,
clipping factors, the reweighted second backward; no ``optimizer.step()``; ``--check`` compares
its ``.grad`` with ``Σ_n min(1, C/‖g_n‖) g_n`` from curvlib's ``BatchGrad`` in float64),
``curvlinops:KFAC[mlp]`` and ``[mlp+head]`` (curvlinops' KFAC factors); see their functions.

A method refused by curvlib (``CurvatureError``, before any work) is reported with the
first line of its message and the seconds until it was raised; a peer's exception with its
first line. Writes ``llm-memory-<problem>.md`` (or ``--name``; ``llm-sweep`` for several
problems) and ``.json`` under ``--out``; ``llm_sweep_table.py`` prints the sweep's tables
(sizes as columns) from those JSON files.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from memory_knobs import spawn  # noqa: E402

#: Methods: ``backward`` or an extension, optionally with keyword options in brackets.
METHODS = ("backward", "BatchL2Grad", "SumGradSquared", "Variance", "DiagGGNMC", "BatchGrad", "KFAC",
           "KFAC[max_factor_dim=4096]")
#: The model-size sweep's methods (``--methods`` default with ``--problems sweep``).
SWEEP_METHODS = ("backward", "BatchL2Grad", "SumGradSquared", "Variance", "DiagGGNMC", "BatchGrad",
                 "KFAC[max_factor_dim=4096]", "KFAC[max_factor_dim=1024]")


#: Peers, on request: ``llm_memory.py --methods backward opacus:ghost-norms ...``.
PEERS = ("opacus:backward", "opacus:ghost-norms", "opacus:clipping-step", "curvlinops:KFAC[mlp]",
         "curvlinops:KFAC[mlp+head]")
#: ``opacus:clipping-step``'s clipping bound C (``max_grad_norm``).
MAX_GRAD_NORM = 1.0
#: ``--check``'s tolerance on the relative errors (float64).
CHECK_TOL = 1e-10


def _opacus(problem, norms: bool):
    """Opacus 1.6 on ``sequence_models.opacus_copy`` of the GPT (same values; ``DPMultiheadAttention``
    with q/k/v/out ``nn.Linear``, positions as an ``nn.Embedding``, sequence-first): with ``norms``,
    ghost clipping's per-sample gradient norms, ``GradSampleModuleFastGradientClipping(
    use_ghost_clipping=True)``: one backward of the per-sequence losses' mean (``CrossEntropyLoss``
    with ``reduction="none"`` averaged over the T positions, as ``DPLossFastGradientClipping`` does
    for generative models), then ``get_norm_sample()`` ``[N]`` (Linear and Embedding by ghost norms,
    LayerNorm through its instantiated per-sample gradient ``[N, d]``). Without ``norms``: a plain
    backward of the copy, for reference. The copy is built in setup, the original stays untouched."""
    import warnings

    import torch
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from sequence_models import opacus_copy

    warnings.filterwarnings("ignore", module="opacus")
    model, lossfn, X, y = problem
    copied = opacus_copy(model)
    if not norms:
        def plain():
            copied.zero_grad(set_to_none=True)
            lossfn(copied(X), y).backward()

        return plain
    gsm = GradSampleModuleFastGradientClipping(copied, batch_first=copied.batch_first, loss_reduction="mean",
                                               use_ghost_clipping=True)
    per_position = torch.nn.CrossEntropyLoss(reduction="none")

    def run():
        gsm.zero_grad(set_to_none=True)
        per_position(gsm(X), y).mean(dim=1).mean().backward()
        return gsm.get_norm_sample()  # [N]: norms of the per-sequence losses' gradients

    return run


class PerSequenceCrossEntropy:
    """``CrossEntropyLoss`` of logits ``[N, V, T]`` against ``[N, T]`` as Opacus' ghost-clipping loss
    wrapper needs it: ``reduction="none"`` gives the per-sequence losses ``ℓ_n`` ``[N]`` (the mean
    over the T positions: the privacy unit is the sequence), ``"mean"`` their mean (the problem's
    ``CrossEntropyLoss()``, every sequence has T positions), ``"sum"`` their sum.
    ``DPLossFastGradientClipping`` switches ``reduction`` to ``"none"`` for its call. Its own
    ``shape=`` route reaches the same ``[N]`` from logits flattened to ``[N·T, V]``, which for this
    model's ``[N, V, T]`` (a view of ``[T, N, V]``) would copy the 103 MB logits first."""

    def __init__(self, reduction: str = "mean"):
        self.reduction = reduction

    def __call__(self, logits, y):
        import torch

        per_sequence = torch.nn.functional.cross_entropy(logits, y, reduction="none").mean(dim=1)
        return {"none": per_sequence, "mean": per_sequence.mean(), "sum": per_sequence.sum()}[self.reduction]


def _make_private_ghost(problem, max_grad_norm: float = MAX_GRAD_NORM):
    """Opacus 1.6's ghost-clipping DP-SGD set up by its own entry point, ``PrivacyEngine().make_private(
    ..., grad_sample_mode="ghost")``, on ``sequence_models.opacus_copy`` of the GPT: returns the copy,
    the ``GradSampleModuleFastGradientClipping(use_ghost_clipping=True, max_grad_norm=C)``, the
    ``DPOptimizerFastGradientClipping`` (over ``SGD(lr=0)``, ``noise_multiplier=0``) and the
    ``DPLossFastGradientClipping`` around :class:`PerSequenceCrossEntropy` (``loss_reduction="mean"``).
    The data loader ``make_private`` requires holds the one batch ``(X, y)`` and is not used
    (``poisson_sampling=False``: left as given)."""
    import warnings

    import torch
    from opacus import PrivacyEngine
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
    from sequence_models import opacus_copy
    from torch.utils.data import DataLoader, TensorDataset

    warnings.filterwarnings("ignore", module="opacus")
    _model, _lossfn, X, y = problem
    copied = opacus_copy(_model)
    loader = DataLoader(TensorDataset(X, y), batch_size=X.shape[0])
    gsm, optimizer, criterion, _ = PrivacyEngine().make_private(
        module=copied, optimizer=torch.optim.SGD(copied.parameters(), lr=0.0),
        criterion=PerSequenceCrossEntropy(), data_loader=loader, noise_multiplier=0.0,
        max_grad_norm=max_grad_norm, batch_first=copied.batch_first, loss_reduction="mean",
        poisson_sampling=False, grad_sample_mode="ghost")
    assert isinstance(gsm, GradSampleModuleFastGradientClipping) and gsm.use_ghost_clipping
    assert isinstance(optimizer, DPOptimizerFastGradientClipping)
    assert isinstance(criterion, DPLossFastGradientClipping)
    return copied, gsm, optimizer, criterion


def _opacus_clipping_step(problem, max_grad_norm: float = MAX_GRAD_NORM):
    """Opacus 1.6's whole ghost-clipping DP step up to the clipped summed gradient (what
    ``loss.backward()`` does under ``make_private(..., grad_sample_mode="ghost")``, set up by
    :func:`_make_private_ghost`): ``optimizer.zero_grad(set_to_none=True)``, the forward of the
    copy, the per-sequence losses ``ℓ_n`` ``[N]``, then ``DPTensorFastGradientClipping.backward()``:
    (1) a backward of ``mean_n ℓ_n`` with the ghost-clipping hooks, which leaves the per-sample
    gradient norms ``‖g_n‖`` (``g_n = ∇ℓ_n``: Linear and Embedding by ghost norms, LayerNorm through
    its per-sample gradient ``[N, d]``) and retains the graph; ``optimizer.zero_grad()`` (the grads
    zeroed, kept allocated); (2) the clipping factors ``c_n = min(1, C / (‖g_n‖ + 1e-6))``;
    (3) a second backward, hooks off, of ``Σ_n c_n ℓ_n`` through the retained graph, which leaves
    the clipped summed gradient ``Σ_n c_n g_n`` in each ``.grad``. Returns the norms ``[N]``.

    No ``optimizer.step()``: what it adds (``summed_grad``, a copy of each ``.grad``; Gaussian noise
    of std ``σ C``; the division by the expected batch size N; the SGD update) is elementwise on
    parameter-sized tensors, the same for any way of getting the clipped sum, and not part of the
    gradient computation compared here; with ``noise_multiplier=0`` its noise would be a zeros
    tensor per parameter, not what a DP user's noise costs either. :func:`check_clipping_step`
    checks the ``.grad`` this leaves."""
    _model, _lossfn, X, y = problem
    copied, gsm, optimizer, criterion = _make_private_ghost(problem, max_grad_norm)

    def run():
        optimizer.zero_grad(set_to_none=True)
        loss = criterion(gsm(X), y)  # DPTensorFastGradientClipping over ℓ [N]
        loss.backward()  # the two backwards and the clipping factors between them
        return gsm.per_sample_gradient_norms

    run.copied = copied  # for check_clipping_step: its parameters' .grad after a call
    return run


def check_clipping_step(problem: str = "gpt-sweep-d128-l2", n: int = 2, dtype: str = "float64") -> dict:
    """``opacus:clipping-step`` computes what it should: on ``problem``'s first ``n`` sequences (in
    ``dtype``), the ``.grad`` its call leaves on the copy, mapped back to the original's parameters
    (``sequence_models.opacus_to_original``), equals ``Σ_n c_n g_n`` with ``g_n = n · BatchGrad[n]``
    (curvlib's rows carry the ``1/n`` of the mean: ``g_n = ∇ℓ_n`` of the per-sequence loss) and
    ``c_n = min(1, C / (‖g_n‖ + 1e-6))`` (Opacus' ``get_clipping_coef``), for three bounds C: 1.0
    (the one measured), the mean of the norms (clips some sequences, not others) and 1e6 (clips
    none: ``Σ_n g_n``). Returns, per C, the factors, Opacus' norms' largest relative error against
    curvlib's and the clipped sum's (largest over parameters of ``max|Δ| / max|reference|``), and how
    far the reference is from the unclipped sum ``Σ_n g_n`` by the same measure (the margin that an
    unclipped or wrongly clipped gradient would show). The copy is called twice per C and the
    second call's ``.grad`` is the one checked (the timed rounds call it repeatedly)."""
    import torch
    from curvlib import curvature
    from curvlib.extensions import BatchGrad
    from problems import PROBLEMS
    from sequence_models import opacus_to_original

    dtype = getattr(torch, dtype)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # Opacus' DPMultiheadAttention is built in the default dtype
    try:
        model, lossfn, X, y = PROBLEMS[problem](dtype=dtype)
        X, y = X[:n], y[:n]
        qs = curvature(model, lossfn, [BatchGrad()])(X, y)
        g = {name: n * gb for name, gb in qs["grad_batch"].items()}  # g_n = ∇ℓ_n, [n, *p]
        norms = sum(gn.flatten(1).pow(2).sum(1) for gn in g.values()).sqrt()
        out = {"problem": problem, "n": n, "dtype": str(dtype), "norms": norms.tolist(), "bounds": {}}
        for bound in (1.0, norms.mean().item(), 1e6):
            run = _opacus_clipping_step((model, lossfn, X, y), bound)
            run()
            opacus_norms = run()  # the second call's: nothing carries over between calls (timed rounds)
            factors = (bound / (norms + 1e-6)).clamp(max=1.0)
            # The copy's .grad as a batch of one, so opacus_to_original's q/k/v concatenation
            # (along dim 1 of per-sample gradients) stacks the rows of in_proj_weight/bias.
            grads = opacus_to_original(model, {k: p.grad[None] for k, p in run.copied.named_parameters()})
            grads = {k: v[0] for k, v in grads.items()}
            clipped = {k: torch.einsum("n,n...->...", factors, gk) for k, gk in g.items()}
            err = max(((grads[k] - c).abs().max() / c.abs().max()).item() for k, c in clipped.items())
            # The margin: how far the reference is from the unclipped sum Σ_n g_n (0 when C clips none).
            unclipped = max(((gk.sum(0) - c).abs().max() / c.abs().max()).item() for gk, c in
                            zip(g.values(), clipped.values()))
            out["bounds"][f"{bound:.6g}"] = {
                "factors": factors.tolist(),
                "norms_rel_err": ((opacus_norms - norms).abs() / norms).max().item(),
                "clipped_sum_rel_err": err, "unclipped_sum_rel_diff": unclipped, "parameters": len(grads)}
        return out
    finally:
        torch.set_default_dtype(default)


def _curvlinops(problem, head: bool):
    """curvlinops' ``KFACLinearOperator`` (MC Fisher, one sample), factors computed once per call
    (``compute_kronecker_factors()``) on the GPT itself (no copy). curvlinops refuses Embedding,
    LayerNorm, MultiheadAttention's ``in_proj_weight`` and bare parameters, and computes no
    factor for ``out_proj`` (used functionally by ``nn.MultiheadAttention``, its hooks never
    fire), so its parameters are the blocks' MLP ``linear1``/``linear2`` and, with ``head``,
    the LM head (whose output factor is ``[V, V]``: 10 GB at V = 50257)."""
    import torch
    from curvlinops import KFACLinearOperator

    model, lossfn, X, y = problem
    params = [p for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
              and (name.endswith(("linear1", "linear2")) or (head and name == "head")) for p in m.parameters()]
    op = KFACLinearOperator(model, lossfn, params, [(X, y)], check_deterministic=False, fisher_type="mc",
                            num_data=X.shape[0])

    def run():
        op.compute_kronecker_factors()
        return op

    return run


def _runner(problem, method: str):
    """A zero-argument callable doing ``method`` once on ``problem``."""
    from problems import backward

    if method == "backward":
        return backward(problem)
    if method == "opacus:clipping-step":
        return _opacus_clipping_step(problem)
    if method.startswith("opacus:"):
        return _opacus(problem, norms=method == "opacus:ghost-norms")
    if method.startswith("curvlinops:"):
        return _curvlinops(problem, head=method.endswith("+head]"))
    from curvlib import curvature, extensions

    name, _, options = re.fullmatch(r"(\w+)(\[(.*)\])?", method).group(1, 2, 3)
    kwargs = dict((k, int(v)) for k, v in (o.split("=") for o in options.split(","))) if options else {}
    ext = getattr(extensions, name)(**kwargs)
    model, lossfn, X, y = problem
    f = curvature(model, lossfn, [ext])
    return lambda: f(X, y)[ext.name]


def _status_mib(field: str) -> float:
    """``VmRSS`` / ``VmHWM`` of this process (``/proc/self/status``), in MiB."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) / 2**10


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:400]


def _child_memory(job: dict) -> dict:
    import ctypes
    import gc
    import resource

    import torch
    from problems import PROBLEMS
    from run import prewarm

    prewarm()
    problem = PROBLEMS[job["problem"]](seed=job["seed"])
    out = {}
    if job["method"] is not None:
        torch.manual_seed(job["seed"])
        start = time.perf_counter()
        try:
            run = _runner(problem, job["method"])  # a peer's setup (Opacus' copy) outside the call
            del problem  # only what the runner holds stays: the model, or the peer's copy
            gc.collect()
            # Hand freed heap pages back (the original model's small tensors after Opacus' copy):
            # else the call could reuse them without raising VmHWM, below the RSS before it.
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            out["build_peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
            out["rss_before_mib"] = _status_mib("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS: the call's own peak next
                f.write("5")
            start = time.perf_counter()
            result = run()
            del result
            out["call_peak_mib"] = _status_mib("VmHWM")
            out["call_above_mib"] = out["call_peak_mib"] - out["rss_before_mib"]
        except ValueError as err:  # CurvatureError: refused
            if job["method"].split(":")[0] in ("opacus", "curvlinops"):
                out["error"] = _first_line(err)
            else:
                out["refused"] = str(err).splitlines()[0][:400]
        except Exception as err:  # a peer's failure (or an allocation over --max-gib)
            out["error"] = _first_line(err)
        out["seconds"] = time.perf_counter() - start
    # The process's peak (ru_maxrss, or the setup's when the call's high-water mark was reset).
    out["peak_mib"] = max(out.get("build_peak_mib", 0), out.get("call_peak_mib", 0),
                          resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10)
    return out


def _child_time(job: dict) -> dict:
    import torch
    from problems import PROBLEMS
    from run import prewarm

    prewarm()
    problem = PROBLEMS[job["problem"]](seed=job["seed"])
    runs = {"backward": _runner(problem, "backward"), job["method"]: _runner(problem, job["method"])}
    torch.manual_seed(job["seed"])
    first = {}
    for label, run in runs.items():  # untimed: tracing and the allocator's first requests
        start = time.perf_counter()
        try:
            run()
        except Exception as err:
            return {"error": _first_line(err)}
        first[label] = time.perf_counter() - start
    times: dict = {label: [] for label in runs}
    for _ in range(job["rounds"]):
        for label, run in runs.items():
            start = time.perf_counter()
            run()
            times[label].append(time.perf_counter() - start)
    med = {label: statistics.median(t) for label, t in times.items()}
    return {"ms": {k: 1e3 * v for k, v in med.items()}, "first_ms": {k: 1e3 * v for k, v in first.items()},
            "ratio": med[job["method"]] / med["backward"]}


_BASES: dict = {}


def measure(src: str, problem: str, method: str, args) -> dict:
    """Memory (MiB) and time / backward of ``method`` on ``problem`` with the tree ``src``: the
    call's peak above the memory just before it (``call_above_mib``), and the process's peak
    above a process that only builds the problem (``above_mib``, once per tree and problem)."""
    job = {"problem": problem, "seed": args.seed, "mode": "memory", "method": None, "max_gib": args.max_gib}
    earlier = (args.memory_from or {}).get(problem, {}).get(method)
    if earlier is not None:  # --memory-from: this run only times
        row = {k: v for k, v in earlier.items() if k not in ("ratio", "ms", "first_ms")}
    else:
        if (src, problem) not in _BASES:
            _BASES[src, problem] = spawn(src, job, args.threads, script=__file__)
        base = _BASES[src, problem]
        mem = spawn(src, {**job, "method": method}, args.threads, script=__file__)
        print(f"{problem} {method}: {json.dumps(mem)[:300]}", file=sys.stderr, flush=True)
        row = {"problem": problem, "method": method, "base_mib": base.get("peak_mib"), **mem}
        if "peak_mib" in mem and "peak_mib" in base:
            row["above_mib"] = mem["peak_mib"] - base["peak_mib"]
    mem = row
    if "refused" not in mem and "error" not in mem and args.rounds > 0:
        tim = spawn(src, {**job, "mode": "time", "method": method, "rounds": args.rounds}, args.threads,
                    script=__file__)
        print(f"{problem} {method} time: {json.dumps(tim)[:300]}", file=sys.stderr, flush=True)
        row.update({k: tim[k] for k in ("ratio", "ms", "first_ms", "error") if k in tim})
    return row


def sweep_markdown(rows: dict) -> str:
    """One table over problems and methods (one tree): the call's peak above the memory before it,
    its ratio to the backward's, the process peak above the built model, time / backward."""
    from problems import PROBLEMS

    lines = ["| problem | parameters | method | call's peak above before (MiB) | / backward's "
             "| process peak above the model (MiB) | time / backward | backward (ms) |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for problem, by_method in rows.items():
        model = PROBLEMS[problem]().model
        params = f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M"
        del model
        ref = by_method.get("backward", {}).get("call_above_mib")
        for m, r in by_method.items():
            if "refused" in r or ("error" in r and r.get("call_above_mib") is None):
                why = r.get("refused") or r.get("error")
                lines.append(f"| {problem} | {params} | `{m}` | {'refused' if 'refused' in r else 'failed'} "
                             f"in {r.get('seconds', 0):.1f} s: {why[:160]} | | | | |")
                continue
            mib = r.get("call_above_mib")
            ms = r.get("ms", {}).get("backward")
            lines.append(f"| {problem} | {params} | `{m}` | {'' if mib is None else f'{mib:.0f}'} | "
                         f"{'' if mib is None or not ref else f'{mib / ref:.2f}'} | "
                         f"{'' if r.get('above_mib') is None else format(r['above_mib'], '.0f')} | "
                         f"{r['error'][:160] if 'error' in r else '' if r.get('ratio') is None else format(r['ratio'], '.2f')} | "
                         f"{'' if ms is None else format(ms, '.0f')} |")
    return "\n".join(lines)


def markdown(problem: str, rows: dict, trees: list) -> str:
    """One table: per tree, peak MiB above the model, its ratio to backward's, time / backward."""
    head = "| method | " + " | ".join(f"{t}: MiB above model | {t}: / backward's | {t}: time / backward"
                                      for t in trees) + " |"
    lines = [f"#### {problem}", "", head, "|---|" + "---:|---:|---:|" * len(trees)]
    methods = list(dict.fromkeys(m for t in trees for m in rows[t]))
    for m in methods:
        cells = []
        for t in trees:
            r = rows[t].get(m, {})
            ref = rows[t].get("backward", {}).get("above_mib")
            if "refused" in r:
                cells += [f"refused in {r['seconds']:.2f} s: {r['refused'][:150]}", "", ""]
                continue
            mib = r.get("above_mib")
            cells += ["" if mib is None else f"{mib:.0f}", "" if mib is None or not ref else f"{mib / ref:.2f}",
                      "" if r.get("ratio") is None else f"{r['ratio']:.2f}"]
        lines.append(f"| `{m}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--problems", "--problem", nargs="+", default=["gpt2-small"],
                        help="problems, or 'sweep' for problems.SWEEP_DIAGONAL")
    parser.add_argument("--methods", nargs="+", default=None,
                        help="default: METHODS, or SWEEP_METHODS with --problems sweep; peers: PEERS")
    parser.add_argument("--tree", action="append", default=None, metavar="LABEL=SRC")
    parser.add_argument("--rounds", type=int, default=3, help="timed calls of each (0: memory only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "cpu"))
    parser.add_argument("--name", default=None, help="output stem (default llm-memory-<problem>, or llm-sweep)")
    parser.add_argument("--max-gib", type=float, default=16.0,
                        help="address-space limit of each child (RLIMIT_AS): an allocation past it fails there")
    parser.add_argument("--check", nargs="?", const="gpt-sweep-d128-l2", default=None, metavar="PROBLEM",
                        help="only check opacus:clipping-step's clipped gradient against curvlib's BatchGrad "
                             "(check_clipping_step: first 2 sequences of PROBLEM, default gpt-sweep-d128-l2, "
                             "float64); fails past CHECK_TOL")
    parser.add_argument("--memory-from", default=None, metavar="JSON",
                        help="take the memory figures from an earlier run's JSON (one tree) and only time now "
                             "(memory does not suffer from a busy machine; time does: measure it idle)")
    args = parser.parse_args(argv)
    if args.memory_from is not None:
        with open(args.memory_from) as f:
            earlier_rows = json.load(f)["rows"]
        args.memory_from = next(iter(earlier_rows.values()))
    if args.check is not None:
        result = check_clipping_step(args.check)
        print(json.dumps(result, indent=1))
        worst = max(max(b["norms_rel_err"], b["clipped_sum_rel_err"]) for b in result["bounds"].values())
        ok = worst <= CHECK_TOL
        print(f"largest relative error {worst:.2e} (tolerance {CHECK_TOL:.0e}): {'ok' if ok else 'FAILED'}")
        return 0 if ok else 1
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    if args.child is not None:
        job = json.loads(args.child)
        if job.get("max_gib"):
            import resource

            limit = int(job["max_gib"] * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        print(json.dumps(_child_memory(job) if job["mode"] == "memory" else _child_time(job)))
        return 0
    trees = dict(t.split("=", 1) for t in (args.tree or [f"this={os.path.join(os.path.dirname(HERE), 'src')}"]))
    if args.problems == ["sweep"]:
        from problems import SWEEP_DIAGONAL

        args.problems = list(SWEEP_DIAGONAL)
        args.methods = args.methods or list(SWEEP_METHODS)
    args.methods = args.methods or list(METHODS)
    rows = {t: {p: {m: measure(src, p, m, args) for m in args.methods} for p in args.problems}
            for t, src in trees.items()}
    os.makedirs(args.out, exist_ok=True)
    name = args.name or (f"llm-memory-{args.problems[0]}" if len(args.problems) == 1 else "llm-sweep")
    stem = os.path.join(args.out, name)
    with open(stem + ".json", "w") as f:
        json.dump({"problems": args.problems, "trees": trees, "rounds": args.rounds, "rows": rows}, f, indent=1)
    text = "\n\n".join(markdown(p, {t: rows[t][p] for t in trees}, list(trees)) for p in args.problems)
    if len(trees) == 1:
        text = sweep_markdown(rows[next(iter(trees))]) + "\n\n" + text
    with open(stem + ".md", "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
