"""``curvlib.influence`` on every parameter of tiny transformers language models, beside the
layers kronfluence can track.

    python benchmarks/influence_coverage.py [--models gpt2 llama ...] [--no-kronfluence]
        [--out benchmarks/results/cpu] [--name influence-coverage] [--report-from <json>]

Each model is the ecosystem sweep's ``transformers/causal_lm/<type>`` problem
(``tests/oracles/ecosystem.py``: the class built from its shrunk config, random weights, float64,
eval mode, ``N = 3`` sequences of 5 tokens, vocabulary 64; a model whose experts run only in
float32 is taken on its float64 experts path). Per model:

* **parameters**: in total; in the leaf modules kronfluence wraps (``nn.Linear``, ``nn.Conv2d``:
  weights and biases) as a count and a share; the tensors it cannot track, by kind: embeddings
  (``nn.Embedding``), norms (modules named ``*Norm*``), ``Conv1D`` (transformers' GPT-2 layer),
  experts (parameters of modules named ``*Expert*``/``*MoE*``/``*Moe*``, stacked per expert and
  used functionally) and other (parameters of other modules, used functionally: routers named
  ``*Router*``/``*Gate*``, state-space parameters, ``nn.Conv1d``). A weight tied between an embedding and a
  ``Linear`` head counts as tracked (kronfluence sees its head use only).
* **EK-FAC on every parameter**: ``influence.fit(strategy="ekfac", fisher_type="empirical",
  max_factor_dim=48)`` (the vocabulary side, 64, kept diagonal) and ``influence.scores`` of 2
  query sequences against the 3 training sequences; seconds of each, or the step that failed and
  its exception's first line (a refused fit is retried without ``max_factor_dim``).
* **check**: ``influence.fit(strategy="identity")`` + ``scores`` against the dot products of
  per-example gradients from plain autograd (each sequence alone, ``CrossEntropyLoss(reduction=
  "sum")``: its loss summed over its positions), every parameter; the largest error relative to
  the largest reference entry, passing at 1e-8, or at 1e-6 (†) where the float64 model computes
  in float32 inside (RMSNorm, softmax, routers cast their input: both sides hold its rounding).
* **kronfluence** (``--no-kronfluence`` skips it): kronfluence 1.0 EK-FAC with the empirical
  Fisher on the same model (``tests/oracles/kronfluence_peer.py``), float64; runs or the
  exception's first line, and the modules it wrapped.

Writes ``<name>.md`` and ``<name>.json`` under ``--out``; one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torchvision_shim  # noqa: E402  (before transformers imports it)

torchvision_shim.install()

import torch  # noqa: E402
from torch import nn  # noqa: E402

MODELS = ["gpt2", "gpt_bigcode", "llama", "mistral", "qwen2", "gemma", "phi", "gpt_neox", "opt", "falcon",
          "bloom", "mamba", "mixtral", "qwen2_moe", "jamba"]
MAX_FACTOR_DIM = 48
QUERIES = 2
RTOL = 1e-8
#: a model that computes in float32 inside (RMSNorm, softmax): both sides hold float32 rounding
LOWER_RTOL = 1e-6
KINDS = ("embeddings", "norms", "Conv1D", "experts", "other")


def first_line(e: BaseException, limit: int = 160) -> str:
    lines = [s for s in str(e).strip().splitlines() if s.strip()]
    return f"{type(e).__name__}: {(lines[0] if lines else '')[:limit]}"


def _kind(module: nn.Module) -> str:
    name = type(module).__name__
    if isinstance(module, nn.Embedding):
        return "embeddings"
    if "Norm" in name:
        return "norms"
    if name == "Conv1D":
        return "Conv1D"
    if "Router" in name or "Gate" in name:
        return "other"
    if any(s in name for s in ("Expert", "MoE", "Moe", "SparseMoe")):
        return "experts"
    return "other"


def coverage(model: nn.Module) -> dict:
    """Parameters in total, in kronfluence's modules, and the others by kind."""
    tracked, owner = set(), {}
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            owner.setdefault(id(p), (mname, module))
        if not list(module.children()) and isinstance(module, (nn.Linear, nn.Conv2d)):
            tracked.update(id(p) for p in module.parameters(recurse=False))
    kinds = {k: {"tensors": 0, "params": 0, "names": []} for k in KINDS}
    total = tracked_params = 0
    tied = []
    for name, p in model.named_parameters():
        total += p.numel()
        if id(p) in tracked:
            tracked_params += p.numel()
            if isinstance(owner[id(p)][1], nn.Embedding):
                tied.append(name)
            continue
        k = _kind(owner[id(p)][1])
        kinds[k]["tensors"] += 1
        kinds[k]["params"] += p.numel()
        kinds[k]["names"].append(name)
    return {"total": total, "tracked": tracked_params, "tied": tied, "untracked": kinds}


def _one(X, i):
    return {k: v[i:i + 1] for k, v in X.items()} if isinstance(X, dict) else X[i:i + 1]


def _call(model, X, output):
    out = model(**X) if isinstance(X, dict) else model(X)
    return output(out) if callable(output) else (out if output is None else getattr(out, output))


def autograd_gradients(prob, X, y) -> torch.Tensor:
    """``[N, P]``: each sequence's gradient alone, loss summed over its positions."""
    params = [p for _, p in prob.model.named_parameters() if p.requires_grad]
    lossfn = nn.CrossEntropyLoss(reduction="sum")
    rows = []
    for i in range(y.shape[0]):
        loss = lossfn(_call(prob.model, _one(X, i), prob.output), y[i:i + 1])
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        rows.append(torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1)
                               for g, p in zip(grads, params)]))
    return torch.stack(rows)


def queries_of(prob, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (QUERIES, prob.y.shape[1]), generator=g)
    y = torch.randint(0, 64, (QUERIES, prob.y.shape[1]), generator=g)
    X = {k: ids for k in prob.X} if isinstance(prob.X, dict) else ids
    return X, y


class _Logits(nn.Module):
    """``[N, T, V]`` logits from input ids: the model as kronfluence's task takes it."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, ids):
        return self.hf(input_ids=ids).logits


def run_kronfluence(prob, queries) -> dict:
    from oracles.kronfluence_peer import kronfluence_scores

    wrapped = _Logits(prob.model)
    modules = [n for n, m in wrapped.named_modules()
               if not list(m.children()) and isinstance(m, (nn.Linear, nn.Conv2d))]
    out = {"modules": len(modules)}
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            s = kronfluence_scores(wrapped, (prob.X["input_ids"], prob.y), (queries[0]["input_ids"], queries[1]), d,
                                   strategy="ekfac", empirical=True)
        out.update(ok=bool(torch.isfinite(s["pairwise"]).all()), shape=list(s["pairwise"].shape))
    except Exception as e:  # noqa: BLE001 - the report's
        out.update(ok=False, error=first_line(e))
    out["seconds"] = time.perf_counter() - start
    return out


def run_ekfac(prob, train, queries, max_factor_dim) -> dict:
    from curvlib import influence

    out = {"ok": False, "max_factor_dim": max_factor_dim, "step": "fit"}
    start = time.perf_counter()
    try:
        factors = influence.fit(prob.model, prob.lossfn, train, strategy="ekfac", fisher_type="empirical",
                                output=prob.output, max_factor_dim=max_factor_dim)
        out.update(blocks=len(factors["blocks"]), fit_seconds=time.perf_counter() - start, step="scores")
        start = time.perf_counter()
        s = influence.scores(prob.model, prob.lossfn, factors, queries, train, output=prob.output)
        out.update(ok=bool(torch.isfinite(s).all()), shape=list(s.shape), scores_seconds=time.perf_counter() - start)
    except Exception as e:  # noqa: BLE001 - the report's
        out.update(error=first_line(e), trace=traceback.format_exc(limit=-3))
    return out


def computes_in_float32(prob) -> bool:
    """Whether the float64 model's forward computes in a lower floating precision anywhere."""
    from oracles.ecosystem import _FloatDtypes

    with torch.no_grad(), _FloatDtypes() as mode:
        _call(prob.model, prob.X, prob.output)
    return any(d != torch.float64 for d in mode.seen)


def run_model(model_type: str, kron: bool) -> dict:
    from curvlib import influence
    from oracles.ecosystem import eligible_problem

    row = {"model": model_type}
    why, prob = eligible_problem(f"transformers/causal_lm/{model_type}")
    if prob is None:
        row["not_eligible"] = why
        return row
    row["class"] = type(prob.model).__name__
    row["notes"] = prob.notes
    row.update(coverage(prob.model))
    row["float32_inside"] = computes_in_float32(prob)
    train = (prob.X, prob.y)
    queries = queries_of(prob)
    lossfn = prob.lossfn
    row["ekfac"] = run_ekfac(prob, train, queries, MAX_FACTOR_DIM)
    if not row["ekfac"]["ok"] and row["ekfac"]["step"] == "fit":
        row["ekfac_dense"] = run_ekfac(prob, train, queries, None)
    start = time.perf_counter()
    try:
        factors = influence.fit(prob.model, lossfn, train, strategy="identity", output=prob.output)
        s = influence.scores(prob.model, lossfn, factors, queries, train, output=prob.output)
        ref = autograd_gradients(prob, *queries) @ autograd_gradients(prob, *train).T
        err = ((s - ref).abs().max() / ref.abs().max()).item()
        tol = LOWER_RTOL if row["float32_inside"] else RTOL
        row["identity"] = {"error": err, "tol": tol, "ok": err <= tol, "seconds": time.perf_counter() - start}
    except Exception as e:  # noqa: BLE001 - the report's
        row["identity"] = {"ok": False, "error_text": first_line(e), "seconds": time.perf_counter() - start,
                           "trace": traceback.format_exc(limit=-3)}
    if kron:
        row["kronfluence"] = run_kronfluence(prob, queries)
    return row


def _kinds_cell(row) -> str:
    parts = [f"{k} {v['tensors']} ({v['params']})" for k, v in row["untracked"].items() if v["tensors"]]
    return ", ".join(parts) or "none"


def _ekfac_cell(e) -> str:
    if e["ok"]:
        return f"✓ {e['blocks']} blocks; fit {e['fit_seconds']:.1f} s, scores {e['scores_seconds']:.1f} s"
    return f"✗ {e['step']}: {e.get('error', 'non-finite scores')}"


def header(command: str) -> str:
    import platform

    import transformers

    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    try:
        import kronfluence
        versions += f", kronfluence {kronfluence.__version__}"
    except (ImportError, AttributeError):
        pass
    return (f"# Influence on every parameter of tiny causal language models\n\n`{command}`; {platform.machine()}, "
            f"one torch thread, {versions}. EK-FAC: `influence.fit(strategy=\"ekfac\", fisher_type=\"empirical\", "
            f"max_factor_dim={MAX_FACTOR_DIM})` + `influence.scores`, {QUERIES} queries against 3 training sequences "
            "of 5 tokens; identity: `strategy=\"identity\"` scores against autograd's per-sequence gradient dot "
            f"products (relative to the largest entry; passing at {RTOL:g}, † at {LOWER_RTOL:g}: the float64 model "
            "computes in float32 inside).\n\n")


def markdown(rows) -> str:
    lines = ["| model | class | parameters | in `nn.Linear`/`nn.Conv2d` (kronfluence) "
             "| not trackable: tensors (parameters) "
             "by kind | curvlib EK-FAC, every parameter | identity vs autograd (rel. error) | kronfluence EK-FAC |",
             "|---|---|---:|---:|---|---|---|---|"]
    for r in rows:
        if "not_eligible" in r:
            lines.append(f"| {r['model']} | | | | | not built: {r['not_eligible']} | | |")
            continue
        pct = 100 * r["tracked"] / r["total"]
        ek = _ekfac_cell(r["ekfac"])
        if "ekfac_dense" in r:
            ek += f"; without `max_factor_dim`: {_ekfac_cell(r['ekfac_dense'])}"
        i = r["identity"]
        ident = (f"{'✓' if i['ok'] else '✗'} {i['error']:.1e}{'' if i['tol'] == RTOL else ' †'}"
                 if "error" in i else f"✗ {i['error_text']}")
        k = r.get("kronfluence")
        if k is None:
            kr = "-"
        elif k["ok"]:
            kr = f"✓ {k['modules']} module{'s' if k['modules'] != 1 else ''}, {k['seconds']:.1f} s"
        else:
            kr = f"✗ ({k['modules']} modules) {k.get('error', 'non-finite')}"
        tied = " (incl. the tied embedding)" if r["tied"] else ""
        lines.append(f"| {r['model']} | {r['class']} | {r['total']} | {r['tracked']} ({pct:.0f}%){tied} "
                     f"| {_kinds_cell(r)} | "
                     f"{ek} | {ident} | {kr} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--no-kronfluence", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu"))
    ap.add_argument("--name", default="influence-coverage")
    ap.add_argument("--report-from", default=None, help="rewrite the report from this JSON (no run)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    command = "python benchmarks/influence_coverage.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.report_from is not None:
        with open(args.report_from) as f:
            rows = json.load(f)
        command = rows[0].get("command", command) if rows else command
    else:
        rows = run_all(args, command)
    text = header(command) + markdown(rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, args.name + ".md"), "w") as f:
        f.write(text)
    if args.report_from is None:
        with open(os.path.join(args.out, args.name + ".json"), "w") as f:
            json.dump(rows, f, indent=1, default=str)
    print(text)
    return 0


def run_all(args, command: str) -> list:
    rows = []
    for m in args.models:
        start = time.perf_counter()
        try:
            row = run_model(m, not args.no_kronfluence)
        except Exception as e:  # noqa: BLE001 - the report's
            row = {"model": m, "not_eligible": f"harness: {first_line(e)}"}
        row["wall_seconds"] = time.perf_counter() - start
        row["command"] = command
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "untracked"}, default=str), file=sys.stderr, flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
