"""The linear datamodeling score (LDS) of ``curvlib.influence``'s strategies, beside kronfluence's.

    python benchmarks/influence_lds.py                   # both problems, every method: 13 min (2 cores, load 2-6)
    python benchmarks/influence_lds.py --quick           # 6 subsets, one seed, fewer methods: under a minute
    python benchmarks/influence_lds.py --problems mlp --subsets 32 --seeds 2

The LDS (Park et al. 2023, TRAK) asks whether influence scores predict what retraining does. Draw
``--subsets`` random subsets ``S_k`` of the training set, each a fraction ``--alpha`` of it;
retrain the model on each from ``--seeds`` initialisations (the same ones for every subset) and
take each query's loss (its cross-entropy summed over its positions) averaged over the seeds:
the actual ``[K, Q]``. The scores ``[Q, N]`` are computed once, on the model trained on the whole
training set from the first seed; a positive ``score(q, n)`` means training on ``n`` lowered the
query's loss, so the predicted loss of ``q`` after training on ``S_k`` is ``-Σ_{n ∈ S_k}
score(q, n)`` up to a constant. The LDS of a query is the Spearman correlation over the ``K``
subsets of predicted and actual losses; the table gives its mean ± standard error over the
queries, and the time of fitting and scoring (kronfluence: ``fit_all_factors`` and
``compute_pairwise_scores``, its files written under a temporary directory).

Problems (trained in float32, scored in float64; nothing downloaded):

* ``mlp``: a 64-32-10 tanh MLP of bias-free ``nn.Linear`` layers on scikit-learn's digits,
  full-batch Adam on the mean cross-entropy plus an L2 penalty; queries are held-out digits.
  kronfluence tracks every layer, as curvlib does.
* ``lm``: ``tests/oracles/models.py``'s ``TinyCausalLM`` (embedding, positions, LayerNorms,
  single-head attention and an MLP of bias-free ``nn.Linear`` layers, an untied head) predicting
  the next character of windows of the standard library's docstrings (``inspect.getdoc``; bytes,
  vocabulary 128); queries are windows of a module not trained on. kronfluence tracks the
  ``nn.Linear`` layers only, so curvlib runs on those (``params=``, ``linear`` rows) and on every
  parameter (``all`` rows).

Methods: curvlib's ``identity``, ``diagonal``, ``kfac``, ``ekfac`` with the Monte-Carlo Fisher
(``fisher_type="mc"``, a seeded generator) and the empirical Fisher, kronfluence's heuristic
damping (``damping=None``: ``0.1 · mean`` of each block's spectrum) and a fixed ``--damping``;
with ``--exact`` also curvlib's exact GGN (``fisher_type="exact"``, which kronfluence does not
offer: a second per strategy on the MLP, 4 minutes for the LM's diagonal at load 3);
kronfluence 1.0 (optional; skipped with the reason when missing) with the same strategies,
``use_empirical_fisher`` False (its own Monte-Carlo labels) and True. ``--draws`` repeats
EK-FAC's Monte-Carlo fit with other label draws in both libraries. Writes
``influence-lds-<date>.md`` and ``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import inspect
import json
import math
import os
import platform
import sys
import tempfile
import time

import torch
from torch import Tensor, nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from curvlib import influence  # noqa: E402
from oracles.models import TinyCausalLM  # noqa: E402

DT = torch.float64  # influence: fitting and scoring, kronfluence's too
TRAIN_DT = torch.float32  # retraining: 3-4x faster than float64 here, and the models are many
STRATEGIES = ("identity", "diagonal", "kfac", "ekfac")
VOCAB = 128
LM_TRAIN_MODULES = ("argparse", "collections", "functools", "itertools", "pathlib", "subprocess", "typing")
LM_QUERY_MODULE = "json"


# ----------------------------------------------------------------------------- problems

class Logits(nn.Module):
    """``[N, T, V]`` -> ``[N, V, T]``, as ``nn.CrossEntropyLoss`` takes a sequence's logits."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, ids: Tensor) -> Tensor:
        return self.inner(ids).transpose(1, 2)


def digits(n_train: int, n_query: int):
    """``((X, y), (Xq, yq))``: the first ``n_train`` digits for training, the next ``n_query`` as queries."""
    from sklearn.datasets import load_digits

    data = load_digits()
    gen = torch.Generator(device="cpu").manual_seed(0)
    order = torch.randperm(len(data.target), generator=gen)
    X, y = torch.tensor(data.data / 16.0, dtype=DT)[order], torch.tensor(data.target)[order]
    return (X[:n_train], y[:n_train]), (X[n_train:n_train + n_query], y[n_train:n_train + n_query])


def _example():
    """examples/influence.py, whose data this benchmark shares (stdlib docstrings as byte windows)."""
    spec = importlib.util.spec_from_file_location("influence_example", os.path.join(HERE, "..", "examples", "influence.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


_EXAMPLE = _example()
docstring_text, windows = _EXAMPLE.docstring_text, _EXAMPLE.windows


def docstrings(n_train: int, n_query: int, length: int):
    """``((X, y), (Xq, yq))``: next-character windows (inputs ``[:, :-1]``, targets ``[:, 1:]``) of
    the training modules' docstrings and, as queries, of a module not trained on."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    pool = torch.cat([windows(docstring_text(m), length + 1) for m in LM_TRAIN_MODULES])
    train = pool[torch.randperm(len(pool), generator=gen)[:n_train]]
    held = windows(docstring_text(LM_QUERY_MODULE), length + 1)
    queries = held[torch.randperm(len(held), generator=gen)[:n_query]]
    if len(train) < n_train or len(queries) < n_query:
        raise ValueError(f"{len(train)} training and {len(queries)} query windows available")
    return (train[:, :-1], train[:, 1:]), (queries[:, :-1], queries[:, 1:])


def problem(name: str, quick: bool) -> dict:
    """The data, a model builder (``make(seed)``), training settings and the kronfluence-tracked layers."""
    if name == "mlp":
        train, queries = digits(500, 40 if quick else 100)

        def make(seed):
            torch.manual_seed(seed)
            return nn.Sequential(nn.Linear(64, 32, bias=False), nn.Tanh(), nn.Linear(32, 10, bias=False))

        return dict(train=train, queries=queries, make=make, wrap=lambda m: m, unwrap=lambda m: m,
                    steps=300, lr=0.01, l2=1e-3, tracked=None, subsets_of_params=None,
                    description="64-32-10 tanh MLP (bias-free Linear), digits: 500 train, "
                                f"{len(queries[1])} held-out queries")
    if name == "lm":
        T = 16
        train, queries = docstrings(400, 25 if quick else 50, T)

        def make(seed):
            torch.manual_seed(seed)
            return TinyCausalLM(vocab=VOCAB, d=16, length=T)

        tracked = ["q", "k", "v", "o", "up", "down", "head"]
        return dict(train=train, queries=queries, make=make, wrap=Logits, unwrap=lambda m: m.inner,
                    steps=100, lr=0.02, l2=1e-3, tracked=tracked,
                    description=f"TinyCausalLM (vocab {VOCAB}, d 16, T {T}), stdlib docstrings: "
                                f"400 train windows, {len(queries[1])} held-out windows ({LM_QUERY_MODULE})")
    raise ValueError(name)


# ----------------------------------------------------------------------------- training and losses

def example_losses(model: nn.Module, X: Tensor, y: Tensor) -> Tensor:
    """Each example's cross-entropy summed over its positions, ``[N]``."""
    logits = model(X)
    if logits.dim() == 3:  # [N, T, V]
        return nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none").sum(1)
    return nn.functional.cross_entropy(logits, y, reduction="none")


def as_train_dtype(X: Tensor) -> Tensor:
    return X.to(TRAIN_DT) if X.is_floating_point() else X


def train(prob: dict, seed: int, keep: Tensor) -> nn.Module:
    """The model from initialisation ``seed`` trained on the examples ``keep`` (bool ``[N]``):
    full-batch Adam on the mean example loss plus ``l2/2 · ‖θ‖²``, a fixed number of steps, in
    ``TRAIN_DT``."""
    model = prob["make"](seed).to(TRAIN_DT)
    X, y = as_train_dtype(prob["train"][0][keep]), prob["train"][1][keep]
    opt = torch.optim.Adam(model.parameters(), lr=prob["lr"])
    for _ in range(prob["steps"]):
        opt.zero_grad()
        loss = example_losses(model, X, y).mean() + prob["l2"] / 2 * sum(p.pow(2).sum() for p in model.parameters())
        loss.backward()
        opt.step()
    for p in model.parameters():
        p.grad = None
    return model.eval()


def actual_losses(prob: dict, masks: Tensor, seeds: int) -> Tensor:
    """``[K, Q]``: each query's loss after training on each subset, averaged over the seeds, and
    ``[seeds, K, Q]`` unaveraged."""
    Xq, yq = as_train_dtype(prob["queries"][0]), prob["queries"][1]
    out = torch.empty(seeds, len(masks), len(yq), dtype=DT)
    for s in range(seeds):
        for k, keep in enumerate(masks):
            model = train(prob, s, keep)
            with torch.no_grad():
                out[s, k] = example_losses(model, Xq, yq)
    return out


# ----------------------------------------------------------------------------- the score

def ranks(x: Tensor) -> Tensor:
    """Ranks along the last dimension (no ties among continuous values)."""
    return x.argsort(-1).argsort(-1).to(DT)


def spearman(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise Spearman correlation of ``a`` and ``b`` ``[Q, K]``."""
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    return (ra * rb).sum(-1) / (ra.norm(dim=-1) * rb.norm(dim=-1))


def lds(scores: Tensor, masks: Tensor, actual: Tensor) -> Tensor:
    """Per query ``[Q]``: Spearman over subsets of ``-Σ_{n ∈ S_k} score(q, n)`` and the actual loss."""
    predicted = -scores.to(DT) @ masks.to(DT).T  # [Q, K]
    return spearman(predicted, actual.T)


def mean_se(x: Tensor):
    """``(mean, standard error)`` of the finite entries."""
    x = x[torch.isfinite(x)]
    return float(x.mean()), float(x.std() / math.sqrt(len(x))) if len(x) > 1 else float("nan")


# ----------------------------------------------------------------------------- methods

def methods(prob_name: str, quick: bool, damping: float, exact: bool = False) -> list:
    """``(library, strategy, fisher, damping, params)`` rows; ``params`` ``"all"`` or ``"linear"``."""
    params = ("all", "linear") if prob_name == "lm" else ("all",)
    rows = []
    for subset in params:
        for strategy in STRATEGIES:
            rows.append(("curvlib", strategy, "mc", None, subset))
        if quick:
            continue
        for strategy in STRATEGIES[1:]:
            rows.append(("curvlib", strategy, "empirical", None, subset))
        for strategy in STRATEGIES[1:] if exact else ():
            rows.append(("curvlib", strategy, "exact", None, subset))
        for strategy in STRATEGIES[1:]:
            rows.append(("curvlib", strategy, "mc", damping, subset))
    kron_subset = "linear" if prob_name == "lm" else "all"
    for strategy in ("identity", "ekfac") if quick else STRATEGIES:
        rows.append(("kronfluence", strategy, "mc", None, kron_subset))
    if not quick:
        for strategy in STRATEGIES[1:]:
            rows.append(("kronfluence", strategy, "empirical", None, kron_subset))
        for strategy in STRATEGIES[1:]:
            rows.append(("kronfluence", strategy, "mc", damping, kron_subset))
    return rows


def curvlib_scores(prob: dict, model: nn.Module, strategy: str, fisher: str, damping, subset: str, batch: int,
                   draw: int = 0) -> Tensor:
    """curvlib's ``[Q, N]`` scores: ``fit`` and ``scores`` over a loader of ``batch`` examples;
    ``subset`` ``"linear"``: the LM's Linear weights only (``params=``)."""
    wrapped, lossfn = prob["wrap"](model), nn.CrossEntropyLoss()
    params = None
    if subset == "linear":
        params = {f"inner.{n}.weight": model.get_submodule(n).weight for n in prob["tracked"]}
    X, y = prob["train"]
    loader = [(X[i:i + batch], y[i:i + batch]) for i in range(0, len(y), batch)]
    factors = influence.fit(wrapped, lossfn, loader, strategy=strategy, fisher_type=fisher, params=params,
                            generator=torch.Generator(device="cpu").manual_seed(draw))
    return influence.scores(wrapped, lossfn, factors, prob["queries"], loader, damping=damping, params=params)


def kronfluence_scores(prob: dict, model: nn.Module, strategy: str, fisher: str, damping, batch: int,
                       draw: int = 0) -> Tensor:
    """kronfluence's ``[Q, N]`` pairwise scores on the same model and data (its tracked layers)."""
    from oracles.kronfluence_peer import kronfluence_scores as peer

    torch.manual_seed(draw)  # kronfluence draws its Monte-Carlo labels from the global generator
    with tempfile.TemporaryDirectory() as tmp:
        return peer(model, prob["train"], prob["queries"], tmp, strategy=strategy, empirical=fisher == "empirical",
                    damping=damping, tracked=prob["tracked"], batch_size=batch, self_scores=False)["pairwise"]


# ----------------------------------------------------------------------------- driver

def run_problem(name: str, args) -> dict:
    """One problem's retraining, every method's LDS and time, and EK-FAC over label draws."""
    prob = problem(name, args.quick)
    N = len(prob["train"][1])
    gen = torch.Generator(device="cpu").manual_seed(1)
    size = int(round(args.alpha * N))
    masks = torch.zeros(args.subsets, N, dtype=torch.bool)
    for k in range(args.subsets):
        masks[k, torch.randperm(N, generator=gen)[:size]] = True

    t0 = time.perf_counter()
    full = train(prob, 0, torch.ones(N, dtype=torch.bool)).to(DT)
    with torch.no_grad():
        train_loss = float(example_losses(full, *prob["train"]).mean())
        query_loss = float(example_losses(full, *prob["queries"]).mean())
    per_seed = actual_losses(prob, masks, args.seeds)
    retrain_s = time.perf_counter() - t0
    actual = per_seed.mean(0)
    out = dict(description=prob["description"], N=N, Q=len(prob["queries"][1]), subsets=args.subsets,
               seeds=args.seeds, alpha=args.alpha, retrain_s=retrain_s, train_loss=train_loss,
               query_loss=query_loss, subset_query_loss=float(actual.mean()), rows=[])
    if args.seeds >= 2:
        # the same subsets from two initialisations: how far retraining itself predicts retraining
        out["seed_agreement"] = mean_se(spearman(per_seed[0].T, per_seed[1].T))
    print(f"[{name}] {prob['description']}; retraining {retrain_s:.1f} s, full-data losses: "
          f"train {train_loss:.3f}, queries {query_loss:.3f}", flush=True)

    rows = methods(name, args.quick, args.damping, args.exact)
    # untimed: the first call of each library pays for imports and curvlib's tracing
    for library in {r[0] for r in rows}:
        try:
            if library == "curvlib":
                curvlib_scores(prob, full, "identity", "mc", None, rows[0][4], args.batch)
            else:
                kronfluence_scores(prob, full, "identity", "mc", None, args.batch)
        except ImportError:
            pass
    for library, strategy, fisher, damping, subset in rows:
        row = dict(library=library, strategy=strategy, fisher=fisher if strategy != "identity" else "-",
                   damping="heuristic" if damping is None else damping, params=subset)
        if strategy == "identity" and fisher != "mc":
            continue
        try:
            t = time.perf_counter()
            if library == "curvlib":
                scores = curvlib_scores(prob, full, strategy, fisher, damping, subset, args.batch)
            else:
                scores = kronfluence_scores(prob, full, strategy, fisher, damping, args.batch)
            row["seconds"] = time.perf_counter() - t
            row["lds"] = mean_se(lds(scores, masks, actual))
        except ImportError as e:
            row["error"] = f"{type(e).__name__}: {e}"
        print(f"[{name}] {json.dumps(row)}", flush=True)
        out["rows"].append(row)

    # the Monte-Carlo labels' share of a difference between the libraries: EK-FAC's LDS over draws
    subset = "linear" if name == "lm" else "all"
    out["draws"] = {}
    for library in ("curvlib", "kronfluence") if args.draws else ():
        try:
            found = []
            for draw in range(args.draws):
                if library == "curvlib":
                    scores = curvlib_scores(prob, full, "ekfac", "mc", None, subset, args.batch, draw)
                else:
                    scores = kronfluence_scores(prob, full, "ekfac", "mc", None, args.batch, draw)
                found.append(mean_se(lds(scores, masks, actual))[0])
            out["draws"][library] = found
            print(f"[{name}] EK-FAC over label draws, {library}: {found}", flush=True)
        except ImportError:
            pass
    return out


def fmt_lds(row) -> str:
    """A row's LDS as ``mean ± s.e.``, or why it was skipped."""
    if "error" in row:
        return "skipped: " + row["error"]
    return f"{row['lds'][0]:.3f} ± {row['lds'][1]:.3f}"


def report(results: dict, args, command: str) -> str:
    """The result file's Markdown: machine and load, then per problem its settings and table."""
    lines = ["# Influence: linear datamodeling score", "",
             f"`{command}`", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, 1 thread, "
             f"torch {torch.__version__}; load average at the start {args.load_start}, at the end "
             f"{os.getloadavg()[0]:.1f} (shared machine). Time: fit + pairwise scores, one run after an "
             "untimed warm-up call per library.", ""]
    for name, res in results.items():
        lines += [f"## {name}: {res['description']}", "",
                  f"{res['subsets']} subsets of {res['alpha']:.0%} of the {res['N']} training examples, "
                  f"{res['seeds']} seed(s) each; retraining {res['retrain_s']:.0f} s. Mean loss of the full-data "
                  f"model: train {res['train_loss']:.3f}, queries {res['query_loss']:.3f} "
                  f"(after training on a subset: {res['subset_query_loss']:.3f})."]
        if "seed_agreement" in res:
            m, se = res["seed_agreement"]
            lines[-1] += (f" Spearman of seed 0's and seed 1's query losses over the subsets: {m:.3f} ± {se:.3f} "
                          f"(retraining's own noise).")
        lines += ["", "| library | params | strategy | Fisher | damping | LDS (mean ± s.e.) | fit + score (s) |",
                  "|---|---|---|---|---|---|---|"]
        for r in res["rows"]:
            secs = f"{r['seconds']:.2f}" if "seconds" in r else "—"
            lines.append(f"| {r['library']} | {r['params']} | {r['strategy']} | {r['fisher']} | {r['damping']} | "
                         f"{fmt_lds(r)} | {secs} |")
        lines.append("")
        for library, found in res.get("draws", {}).items():
            params = "Linear layers" if name == "lm" else "every layer"
            lines.append(f"{library} EK-FAC (MC Fisher, heuristic damping, {params}) over {len(found)} label draws "
                         f"(generator seeds 0-{len(found) - 1}): mean LDS {min(found):.3f} to {max(found):.3f}, "
                         f"average {sum(found) / len(found):.3f}.")
            lines.append("")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", nargs="+", default=["mlp", "lm"], choices=["mlp", "lm"])
    parser.add_argument("--subsets", type=int, default=None, help="K (default 64; --quick 6)")
    parser.add_argument("--seeds", type=int, default=None, help="initialisations per subset (default 2; --quick 1)")
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--damping", type=float, default=1e-3, help="the fixed damping's value")
    parser.add_argument("--batch", type=int, default=100, help="loader batch for fitting and scoring")
    parser.add_argument("--draws", type=int, default=None,
                        help="EK-FAC's Monte-Carlo label draws, each library (default 5; --quick 0)")
    parser.add_argument("--exact", action="store_true",
                        help="also curvlib's exact GGN (fisher_type='exact'; minutes per strategy on the LM)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "cpu"))
    parser.add_argument("--name", default=None, help="file stem (default influence-lds-<date>)")
    args = parser.parse_args(argv)
    args.subsets = args.subsets or (6 if args.quick else 64)
    args.seeds = args.seeds or (1 if args.quick else 2)
    args.draws = args.draws if args.draws is not None else (0 if args.quick else 5)
    args.load_start = f"{os.getloadavg()[0]:.1f}"
    torch.set_num_threads(1)
    command = "python benchmarks/influence_lds.py " + " ".join(argv if argv is not None else sys.argv[1:])
    results = {name: run_problem(name, args) for name in args.problems}
    stem = args.name or f"influence-lds-{datetime.date.today().isoformat()}"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, stem + ".json"), "w") as f:
        json.dump(dict(command=command, results=results), f, indent=1)
    text = report(results, args, command.strip())
    with open(os.path.join(args.out, stem + ".md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
