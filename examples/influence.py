"""``curvlib.influence`` on a small language model: which training sequences explain a query.

What it shows. Influence functions (Koh & Liang 2017; Grosse et al. 2023 on language
models, as kronfluence implements them) score how much training sequence ``n`` helped the
model on a query ``q``: with ``ℓ_n`` a sequence's summed token loss and ``g_n = ∇ℓ_n``,

    score(q, n) = g_qᵀ (G + λ I)⁻¹ g_n,        self(n) = g_nᵀ (G + λ I)⁻¹ g_n,
    G = (1/N) Σ_n F_n,

``F_n`` sequence ``n``'s Fisher (labels sampled from the model; in expectation its GGN) and
``λ`` a damping. A positive score: up-weighting ``n`` lowers the query's loss. ``G`` is too
large to invert for a real model, so ``curvlib.influence`` replaces it per parameter by one
of four strategies, compared side by side here:

    identity   G ≈ I                       (gradient dot products, no λ)
    diagonal   G ≈ diag(G)
    kfac       G ≈ B ⊗ A                   (KFAC's factors, kfac_approx="expand")
    ekfac      G ≈ (Q_B ⊗ Q_A) diag(s) (Q_B ⊗ Q_A)ᵀ,   s = (1/N) Σ_n (Q_Bᵀ R_n Q_A)²

(EK-FAC, George et al. 2018: KFAC's eigenbasis, eigenvalues refitted to the columns ``R_n``
of each sequence's Fisher root). Each is three calls: ``influence.fit(model, loss, loader,
strategy=...)`` once over the training loader, ``influence.scores(model, loss, factors,
queries, loader)`` streaming the training set one batch's per-sequence gradients at a time
(never an ``[N, P]`` for the whole set), and ``influence.self_influence`` for ``self(n)``.
``damping=None`` is ``λ_p = 0.1 · mean(s_p)`` per parameter (kronfluence's heuristic).
``max_factor_dim=127`` keeps every Kronecker factor side larger than 127 diagonal: here only
the vocabulary's (128 byte values: the head's outputs, the embedding's inputs), the choice
that makes a 50k vocabulary fit (a dense 50257² factor is 10 GB, its eigendecomposition out
of reach; diagonal, it is 50257 numbers), while every other side (at most 120) stays dense.

The model: a causal transformer from PyTorch's own layers (pre-LN
``nn.TransformerEncoderLayer``; 2 blocks of d = 32 with ``--quick``, 3 of d = 40 otherwise),
trained with Adam for a few hundred steps on 32-character windows of the standard
library's own docstrings (``inspect.getdoc``; nothing downloaded). The queries are windows
of ``difflib``'s docstrings, which are held out, except that each query is *planted* in
the training set twice: once verbatim and once with 3 of its characters changed. Two
checks make the scores meaningful:

* **planted copies rank top**, per strategy: for how many queries the two planted copies
  get the two highest scores of all training sequences, and by how much the edited copy
  beats the best unplanted sequence (its score over that sequence's, the smallest over
  queries). Measured, full run (8 queries, 1216 sequences): identity 7 of 8 (a copy at
  rank 3; ×0.88), diagonal 8 of 8 (×1.04), kfac 8 of 8 (×1.33), ekfac 8 of 8 (×1.37);
  ``--quick`` (4 queries, 328 sequences): 4 of 4 for every strategy. The training
  sequences with the largest EK-FAC self-influence are the ones unlike the rest (full
  run: an enumeration of letter pairs, URLs), up to 5 times the median;
* **strategies vs exact**, on a tiny configuration (1 block of d = 16, 200 sequences of 16
  characters, 6.7 k parameters): every strategy's scores at one damping
  ``λ = 0.1 · tr(G)/P`` (the mean of EK-FAC's spectrum), against the exact damped GGN
  ``(G + λ I)⁻¹`` of the whole model (not block-diagonal; ``curvlib.operators.cg`` on
  ``curvlib.operators.GGN`` products, preconditioned by ``EKFAC(...).inverse``, float64),
  by Spearman rank correlation over all training sequences, per query. Measured (150 CG
  iterations, relative residual 1.3e-3): identity 0.06 to 0.39, diagonal 0.15 to 0.40,
  kfac 0.36 to 0.50, ekfac 0.40 to 0.53. ``--quick`` stops CG at 30 iterations (residual
  5e-2), which moves these by at most 0.02. Curvature orders the bulk of small scores
  better than none, and EK-FAC's refitted eigenvalues better than KFAC's; none is exact.

Run (needs matplotlib)::

    python examples/influence.py              # larger model, more data: about 2.5 minutes
    python examples/influence.py --quick      # under a minute on 2 CPU cores
    python examples/influence.py --out DIR    # where influence.png goes (default figures/)

The figure ``influence.png``: left, every training sequence's EK-FAC score per query
(divided by its largest magnitude), the planted copies marked; right, per strategy, the
Spearman correlation with exact influence on the tiny model (one dot per query, the bar
their mean), labelled with the planted-copies check of the left run.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import inspect
import os
import re
import time
from dataclasses import dataclass, replace
from typing import Dict, List, Tuple

import torch
from torch import Tensor, nn

from curvlib import curvature, influence
from curvlib.extensions import BatchGrad
from curvlib.operators import EKFAC, GGN, cg

VOCAB = 128  # byte values of ASCII text; the head's output side, kept diagonal
# ``max_factor_dim``: a Kronecker factor side larger than this is kept diagonal. Only the
# vocabulary sides exceed it (the head's output, the embedding's one-hot input); every other
# side is at most 120. For GPT-2's 50257-token vocabulary a dense factor is 50257² floats
# (10 GB) and its eigendecomposition out of reach; diagonal, it is 50257 numbers.
MAX_FACTOR_DIM = VOCAB - 1
STRATEGIES = ("identity", "diagonal", "kfac", "ekfac")
TRAIN_MODULES = ("textwrap", "string", "json", "argparse", "collections", "functools", "itertools",
                 "heapq", "random", "statistics", "fractions", "pathlib", "shutil", "csv", "calendar",
                 "fnmatch", "glob", "base64")
QUERY_MODULE = "difflib"  # held out: queries come from here, planted in training only as copies


@dataclass
class Config:
    """Sizes of one run: ``QUICK`` (``--quick``) or ``FULL`` for the planted-copies run,
    ``TINY`` for the comparison with exact influence (``cg_iters``: its CG iterations)."""
    d: int = 32
    layers: int = 2
    hidden: int = 64
    length: int = 32       # tokens per sequence (windows hold length + 1 characters)
    n_train: int = 320     # sampled training windows, before the planted copies
    n_queries: int = 4
    steps: int = 200
    batch: int = 32
    cg_iters: int = 200
    seed: int = 0


QUICK = Config()
FULL = Config(d=40, layers=3, hidden=120, n_train=1200, n_queries=8, steps=800)
TINY = Config(d=16, layers=1, hidden=32, length=16, n_train=192, n_queries=4, steps=200, cg_iters=150)
TINY_QUICK = replace(TINY, cg_iters=30)  # the Spearman correlations move by <= 0.02 from 30 to 150


# ----------------------------------------------------------------------------- data

def docstring_text(module: str) -> str:
    """A module's docstring and its public functions' and classes' docstrings, whitespace
    collapsed to single spaces, non-ASCII characters replaced by ``?``."""
    mod = importlib.import_module(module)
    docs = [inspect.getdoc(mod) or ""]
    for key, value in sorted(vars(mod).items()):
        if not key.startswith("_") and (inspect.isfunction(value) or inspect.isclass(value)) \
                and getattr(value, "__module__", None) == module:
            docs.append(inspect.getdoc(value) or "")
    text = re.sub(r"\s+", " ", " ".join(docs))
    return "".join(c if ord(c) < VOCAB else "?" for c in text)


def windows(text: str, size: int) -> Tensor:
    """Non-overlapping windows of ``size`` characters as byte codes, ``[K, size]`` int64."""
    codes = torch.tensor(list(text.encode("ascii")), dtype=torch.long)
    k = len(codes) // size
    return codes[: k * size].reshape(k, size)


def near_duplicate(seq: Tensor, changes: int, gen: torch.Generator) -> Tensor:
    """``seq`` with ``changes`` positions set to random lowercase letters."""
    out = seq.clone()
    pos = torch.randperm(len(seq), generator=gen)[:changes]
    out[pos] = torch.randint(ord("a"), ord("z") + 1, (changes,), generator=gen)
    return out


def make_data(cfg: Config) -> Tuple[Tensor, Tensor, Tensor]:
    """``(train [N, T+1], queries [Q, T+1], planted [Q, 2])``: sampled windows of the
    training modules with, per query, a verbatim and a 3-character near-duplicate copy at
    the random rows ``planted[q]``."""
    gen = torch.Generator().manual_seed(cfg.seed)
    pool = torch.cat([windows(docstring_text(m), cfg.length + 1) for m in TRAIN_MODULES])
    train = pool[torch.randperm(len(pool), generator=gen)[: cfg.n_train]]
    held = windows(docstring_text(QUERY_MODULE), cfg.length + 1)
    queries = held[torch.randperm(len(held), generator=gen)[: cfg.n_queries]]
    copies = torch.stack([c for q in queries for c in (q, near_duplicate(q, 3, gen))])
    train = torch.cat([train, copies])
    order = torch.randperm(len(train), generator=gen)
    # where each copy went: copies are rows n_train + 2q (+1) before shuffling
    where = torch.empty(len(train), dtype=torch.long)
    where[order] = torch.arange(len(train))
    planted = where[cfg.n_train:].reshape(cfg.n_queries, 2)
    return train[order], queries, planted


def text_of(seq: Tensor) -> str:
    return bytes(seq.tolist()).decode("ascii")


# ----------------------------------------------------------------------------- model

class GPT(nn.Module):
    """Decoder-only transformer from PyTorch's blocks; ``forward(tokens [N, T]) -> logits [N, V, T]``."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, cfg.d)
        self.pos = nn.Parameter(0.02 * torch.randn(cfg.length, cfg.d))
        block = nn.TransformerEncoderLayer(cfg.d, 2, cfg.hidden, dropout=0.0, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.blocks = nn.TransformerEncoder(block, cfg.layers, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(cfg.d)
        self.head = nn.Linear(cfg.d, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(cfg.length),
                             persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.blocks(self.embed(tokens) + self.pos, mask=self.mask, is_causal=True)
        return self.head(self.ln_f(h)).transpose(1, 2)  # CrossEntropyLoss wants classes in dim 1


def split(seqs: Tensor) -> Tuple[Tensor, Tensor]:
    """Next-character prediction: inputs ``seqs[:, :-1]``, targets ``seqs[:, 1:]``."""
    return seqs[:, :-1], seqs[:, 1:]


def train(cfg: Config, seqs: Tensor) -> GPT:
    """Adam on the mean token loss, ``cfg.steps`` mini-batches of ``cfg.batch`` sequences."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    for _ in range(cfg.steps):
        X, y = split(seqs[torch.randint(0, len(seqs), (cfg.batch,), generator=gen)])
        opt.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        opt.step()
    return model.eval()


# ----------------------------------------------------------------------------- influence, four ways

# The training loss (the mean over every token). ``curvlib.influence`` reads each example's loss
# off it as the sequence's summed token loss, whatever the reduction.
LOSS = nn.CrossEntropyLoss()


def loader(seqs: Tensor, batch: int = 64) -> List[Tuple[Tensor, Tensor]]:
    """The sequences as a re-iterable loader of ``(inputs, targets)`` batches, in order."""
    return [split(seqs[start:start + batch]) for start in range(0, len(seqs), batch)]


def fit(model: nn.Module, seqs: Tensor, strategy: str, seed: int) -> dict:
    """``influence.fit`` over the training sequences, the Fisher's labels sampled from the model
    (``fisher_type="mc"``, kronfluence's choice), the vocabulary sides kept diagonal."""
    return influence.fit(model, LOSS, loader(seqs), strategy=strategy, fisher_type="mc",
                         generator=torch.Generator().manual_seed(seed), max_factor_dim=MAX_FACTOR_DIM)


def score(model: nn.Module, factors: dict, seqs: Tensor, queries: Tensor, damping=None) -> Tensor:
    """``[Q, N]``: every query against every training sequence, streamed one batch at a time
    (``damping=None``: ``0.1 · mean`` of each block's spectrum)."""
    return influence.scores(model, LOSS, factors, split(queries), loader(seqs), damping=damping)


def global_damping(factors: dict, factor: float = 0.1) -> float:
    """``λ = factor · mean(s)`` over every parameter's fitted spectrum: ``0.1 · tr(G) / P`` for
    EK-FAC (a rotation keeps each block's trace), one ``λ`` for every strategy and the exact GGN."""
    spectra = [b["spectrum"] for b in factors["blocks"].values()]
    return factor * float(sum(s.sum() for s in spectra) / sum(s.numel() for s in spectra))


# ----------------------------------------------------------------------------- exact reference

SUM_CE = nn.CrossEntropyLoss(reduction="sum")  # Σ over sequences of their summed token losses


def per_example_gradients(model: nn.Module, seqs: Tensor) -> Dict[str, Tensor]:
    """``∇ℓ_n`` per sequence at its true next characters, ``name -> [N, *p]``."""
    f = curvature(model, SUM_CE, [BatchGrad()])
    parts = [f(X, y)["grad_batch"] for X, y in loader(seqs)]
    return {n: torch.cat([p[n] for p in parts]) for n in parts[0]}


def exact_influence(model: nn.Module, seqs: Tensor, queries: Tensor, damping: float, iters: int,
                    seed: int) -> Tuple[Tensor, float]:
    """``[Q, N]`` scores with the exact damped GGN of the whole model (not block-diagonal):
    ``x_q = (G + λ I)⁻¹ g_q`` by conjugate gradients on GGN-vector products, float64, and the
    largest relative CG residual. ``GGN`` of the summed loss is ``Σ_n F_n = N G``, so
    ``(N G + N λ) x = N g_q`` is solved; CG is preconditioned by ``EKFAC(...).inverse``."""
    twin = copy.deepcopy(model).double()  # CG to a small residual needs more than float32
    data, n = loader(seqs), len(seqs)
    G = GGN(twin, SUM_CE, data, chunk_size=len(queries))
    P = EKFAC(twin, SUM_CE, data, generator=torch.Generator().manual_seed(seed), kfac_approx="expand",
              max_factor_dim=MAX_FACTOR_DIM).inverse(n * damping)
    b = G.domain.flatten(per_example_gradients(twin, queries))            # [P, Q]
    solution = cg(G, n * b, damping=n * damping, tol=1e-6, max_iterations=iters, preconditioner=P)
    residual = float((solution.residual_norm / (n * b).norm(dim=0)).max())
    train_grads = G.domain.flatten(per_example_gradients(twin, seqs))    # [P, N]
    return (solution.x.T @ train_grads).float(), residual


# ----------------------------------------------------------------------------- checks, figure, main

def spearman(a: Tensor, b: Tensor) -> float:
    """Spearman rank correlation of two 1-D tensors (Pearson's of their ranks; no ties in
    continuous scores)."""
    ra, rb = (t.argsort().argsort().double() for t in (a, b))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def planted_ranks(scores: Tensor, planted: Tensor) -> Tensor:
    """``[Q, 2]``: 1-based rank of each planted copy among all training sequences, by score."""
    order = scores.argsort(1, descending=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(1, scores.shape[1] + 1).expand_as(order))
    return rank.gather(1, planted)


def copy_margin(scores: Tensor, planted: Tensor) -> float:
    """The smallest, over queries, of the near-duplicate copy's score over the best score of a
    sequence that is not planted: above 1, the edited copy still stands out."""
    others = scores.clone()
    others.scatter_(1, planted, float("-inf"))
    near = scores.gather(1, planted[:, 1:]).squeeze(1)
    return float((near / others.max(1).values).min())


def planted_run(cfg: Config) -> dict:
    """Train on the data with planted copies; every strategy's scores and the copies' ranks;
    EK-FAC's top sequences per query and the largest self-influences."""
    train_seqs, queries, planted = make_data(cfg)
    model = train(cfg, train_seqs)
    print(f"{sum(p.numel() for p in model.parameters())} parameters, {len(train_seqs)} training sequences, "
          f"{len(queries)} queries; damping: 0.1 · mean of each block's spectrum")
    scores, ranks, margins, fitted = {}, {}, {}, {}
    for strategy in STRATEGIES:
        t = time.perf_counter()
        fitted[strategy] = fit(model, train_seqs, strategy, cfg.seed)
        scores[strategy] = score(model, fitted[strategy], train_seqs, queries)
        ranks[strategy] = planted_ranks(scores[strategy], planted)
        margins[strategy] = copy_margin(scores[strategy], planted)
        top = sum(sorted(r) == [1, 2] for r in ranks[strategy].tolist())
        print(f"  {strategy:9s} planted copies are the top two for {top} of {len(queries)} queries, "
              f"worst copy's rank {int(ranks[strategy].max())}; near-copy / best other sequence >= "
              f"{margins[strategy]:.2f} ({time.perf_counter() - t:.1f} s)")
    ekfac = scores["ekfac"]
    for q in range(len(queries)):
        print(f"query {q}: {text_of(queries[q])!r}  EK-FAC ranks its planted copies {ranks['ekfac'][q].tolist()}")
        for i in ekfac[q].argsort(descending=True)[:3].tolist():
            print(f"   {float(ekfac[q, i]):9.3g}  {text_of(train_seqs[i])!r}")
    selfs = influence.self_influence(model, LOSS, fitted["ekfac"], loader(train_seqs))
    print("largest EK-FAC self-influence (sequences the model fits least by the others):")
    for i in selfs.argsort(descending=True)[:4].tolist():
        print(f"   {float(selfs[i]):9.3g}  {text_of(train_seqs[i])!r}")
    print(f"   median {float(selfs.median()):.3g}")
    return {"scores": scores, "planted": planted, "ranks": ranks, "margins": margins, "self": selfs}


def exact_run(cfg: Config) -> dict:
    """On a tiny configuration: every strategy's scores at one damping against the exact
    damped-GGN influence, by Spearman rank correlation per query."""
    train_seqs, queries, _ = make_data(cfg)
    model = train(cfg, train_seqs)
    fitted = {strategy: fit(model, train_seqs, strategy, cfg.seed) for strategy in STRATEGIES}
    damping = global_damping(fitted["ekfac"])
    scores = {strategy: score(model, fitted[strategy], train_seqs, queries, damping=damping)
              for strategy in STRATEGIES}
    rho = {}
    t = time.perf_counter()
    exact, residual = exact_influence(model, train_seqs, queries, damping, cfg.cg_iters, cfg.seed)
    print(f"tiny model ({sum(p.numel() for p in model.parameters())} parameters, {len(train_seqs)} sequences), "
          f"λ = {damping:.3g} for all: exact influence by CG, relative residual {residual:.1e} "
          f"({time.perf_counter() - t:.1f} s); Spearman vs exact per query:")
    for strategy in STRATEGIES:
        rho[strategy] = [spearman(scores[strategy][q], exact[q]) for q in range(len(queries))]
        print(f"  {strategy:9s} {', '.join(f'{r:.2f}' for r in rho[strategy])}")
    return {"scores": scores, "exact": exact, "rho": rho, "residual": residual, "damping": damping}


def plot(planted: dict, exact: dict, path: str) -> None:
    """Left: EK-FAC scores per query, planted copies marked; right: Spearman vs exact per strategy."""
    import matplotlib.pyplot as plt

    with plt.rc_context({"font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "xtick.labelsize": 10,
                         "ytick.labelsize": 10, "legend.fontsize": 10}):
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2), layout="constrained",
                                          gridspec_kw={"width_ratios": [1.15, 1]})
        scores, marks = planted["scores"]["ekfac"], planted["planted"]
        for q in range(len(scores)):
            s = scores[q] / scores[q].abs().max()
            jitter = q + 0.3 * (torch.rand(len(s), generator=torch.Generator().manual_seed(q)) - 0.5)
            left.scatter(jitter, s, s=6, color="0.6", label="other training sequences" if q == 0 else None)
            left.scatter(jitter[marks[q]], s[marks[q]], s=70, color="C3", marker="*",
                         label="planted copies of the query" if q == 0 else None)
        left.set_xticks(range(len(scores)))
        left.set_xlabel("query")
        left.set_ylabel("EK-FAC score / largest |score|")
        left.set_title(f"EK-FAC scores: planted copies rank {int(planted['ranks']['ekfac'].max())} "
                       f"or better of {scores.shape[1]}")
        left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.17), ncol=2, frameon=False)
        names = list(STRATEGIES)
        for k, strategy in enumerate(names):
            rho = exact["rho"][strategy]
            right.scatter(rho, [k] * len(rho), s=30, color="0.45", label="one query" if k == 0 else None, zorder=3)
            mean = sum(rho) / len(rho)
            right.barh(k, mean, height=0.55, color="C0", alpha=0.5, label="mean over queries" if k == 0 else None)
        ranks = planted["ranks"]
        right.set_yticks(range(len(names)), [f"{s}\nplanted top-2: {sum(sorted(r) == [1, 2] for r in ranks[s].tolist())}"
                                             f"/{len(ranks[s])}\nnear-copy ×{planted['margins'][s]:.2f}" for s in names])
        right.invert_yaxis()
        right.set_xlim(min(0.0, min(min(r) for r in exact["rho"].values()) - 0.05), 1)
        right.set_xlabel("Spearman ρ with exact damped-GGN influence")
        right.set_title("Tiny model: rank agreement with exact influence")
        right.grid(axis="x", alpha=0.3)
        right.legend(loc="upper center", bbox_to_anchor=(0.5, -0.17), ncol=2, frameon=False)
        fig.savefig(path, dpi=100)
        plt.close(fig)


def main(argv=None) -> dict:
    """Both checks, printed; the figure saved to ``<out>/influence.png``; returns the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small configuration (under a minute)")
    parser.add_argument("--out", default="figures", help="folder for influence.png (default: figures/)")
    args = parser.parse_args(argv)
    try:
        import matplotlib
    except ImportError as err:
        raise SystemExit("examples/influence.py needs matplotlib: pip install matplotlib") from err
    matplotlib.use("Agg")
    if args.quick:
        torch.set_num_threads(1)  # small matrices: threads only contend on a shared 2-core runner
    start = time.perf_counter()
    planted = planted_run(QUICK if args.quick else FULL)
    exact = exact_run(TINY_QUICK if args.quick else TINY)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "influence.png")
    plot(planted, exact, path)
    print(f"saved {path} ({time.perf_counter() - start:.1f} s)")
    return {"planted": planted, "exact": exact}


if __name__ == "__main__":
    main()
