"""Every curvlib extension on a GPT-style transformer and an LSTM, checked by brute force.

    python examples/architectures.py                  # ~20 s on one CPU core (HF GPT-2 with transformers)
    python examples/architectures.py --quick --out DIR  # tied-head GPT and LSTM; PNG into DIR

What it shows, on models built only from PyTorch's own modules:

* ``GPT``: token ``nn.Embedding`` + learned positions, an ``nn.TransformerEncoder``
  of two pre-LN ``nn.TransformerEncoderLayer`` with a causal mask, a final
  ``nn.LayerNorm`` and a linear head, with a language-model loss over every
  position (``nn.CrossEntropyLoss`` on ``[N, V, T]`` logits and ``[N, T]``
  targets); once with a separate head and once with the head tied to the
  token embedding (``head.weight = emb.weight``);
* ``LSTMClassifier``: ``nn.Embedding`` -> ``nn.LSTM`` -> the last hidden state
  -> ``nn.Linear``, with ``nn.CrossEntropyLoss``;
* Hugging Face's ``GPT2LMHeadModel`` (when ``transformers`` imports), built from a
  ``GPT2Config`` with random weights: its ``Conv1D`` layers (weights stored
  ``[in, out]``), the tied ``lm_head``, its own attention code and ``ModelOutput``,
  traced by curvlib's ATen front end (torch.fx cannot follow it).

For each model it runs every extension, one ``curvature(model, lossfn,
[ext])(X, y)`` each, in float64, and compares with a brute-force reference
built here from ``torch.func`` (nothing of curvlib):

* individual gradients ``g_n``: the Jacobian (``jacrev``) of the vector of the
  samples' shares of the loss (``vmap(grad)`` would do on the transformer, but
  ``nn.LSTM`` has no batching rule), and everything first order from them;
* the GGN ``G = Jᵀ (∇²_f L) J`` with ``J`` the Jacobian of the whole output
  (``jacrev``), per sample ``G_n`` from its rows; the Hessian ``H`` and the
  per-sample ``H_n`` by ``torch.func.hessian`` on the flattened parameters.

Deterministic quantities (diagonals, square roots through ``S Sᵀ``, the
block products on random vectors) must agree to a relative error of
``TOLERANCE`` (max |curvlib − reference| / max |reference| over the whole
result); ``PCHMP`` has no closed brute-force form and is checked for its
defining property ``PCH ⪰ G`` per block. Monte-Carlo estimates and Kronecker
factors are approximations by design: their relative distance to the exact
quantity is printed as information. A refused extension prints its message.
The exit code is 1 if anything checked disagrees or raises an unexpected
error.

The figure ``architectures.png`` (``--out``, default ``figures/``) has one
panel per model: per extension, the relative error against the brute force
(log scale; green checked, grey an approximation's distance, a red cross a
refusal) and the time of its call.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev
from torch.nn.attention import SDPBackend, sdpa_kernel

from curvlib import CurvatureError, curvature
from curvlib import extensions as E

TOLERANCE = 1e-7
MC_SAMPLES = 300
DT = torch.float64


# ----------------------------------------------------------------------------- the models


class GPT(nn.Module):
    """``idx [N, T]`` token ids -> logits ``[N, V, T]`` (class dim second, as ``CrossEntropyLoss`` wants)."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, T: int, tied: bool):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(0.5 * torch.randn(T, d))  # learned positions
        block = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)  # pre-LN
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(T))

    def forward(self, idx: Tensor) -> Tensor:
        h = self.emb(idx) + self.pos
        h = self.blocks(h, mask=self.causal, is_causal=True)
        return self.head(self.norm(h)).transpose(1, 2)


class LSTMClassifier(nn.Module):
    """``idx [N, T]`` token ids -> class logits ``[N, C]`` from the last hidden state."""

    def __init__(self, vocab: int, d: int, hidden: int, classes: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, idx: Tensor) -> Tensor:
        _, (h, _) = self.lstm(self.emb(idx))
        return self.head(h[-1])


def problems() -> List[Tuple[str, nn.Module, nn.Module, Tensor, Tensor]]:
    """``(title, model, lossfn, X, y)``: tiny, seeded, float64, in eval mode (no dropout)."""
    torch.manual_seed(0)
    N, T, V = 3, 4, 7
    X, y = torch.randint(0, V, (N, T)), torch.randint(0, V, (N, T))  # y: the next tokens, say
    out = []
    for tied in (False, True):
        model = GPT(V, d=8, heads=2, layers=2, T=T, tied=tied).to(DT).eval()
        out.append((f"GPT ({'tied' if tied else 'separate'} head)", model, nn.CrossEntropyLoss(), X, y))
    lstm = LSTMClassifier(V, d=3, hidden=4, classes=3).to(DT).eval()
    out.append(("LSTMClassifier", lstm, nn.CrossEntropyLoss(), X, torch.randint(0, 3, (N,))))
    gpt2 = hugging_face_gpt2(V, T)
    if gpt2 is not None:
        out.append(("GPT2LMHeadModel (Hugging Face)", gpt2, nn.CrossEntropyLoss(), X, y))
    return out


class LogitsOf(nn.Module):
    """A Hugging Face language model's logits as ``[N, V, T]`` (the brute force below calls
    ``model(X)``; curvlib itself would take ``curvature(..., output=...)`` as well)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(input_ids=idx).logits.transpose(1, 2)


def hugging_face_gpt2(vocab: int, T: int):
    """A one-block GPT-2 from a config (random weights, nothing downloaded), or ``None`` when
    ``transformers`` is missing or does not import here."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel, logging

        logging.set_verbosity_error()
    except Exception as exc:  # noqa: BLE001 - optional dependency (or a broken torchvision it imports)
        print(f"Hugging Face GPT-2 skipped: transformers does not import ({type(exc).__name__})")
        return None
    config = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=vocab, n_positions=T, attn_implementation="eager")
    return LogitsOf(GPT2LMHeadModel(config)).to(DT).eval()


# ----------------------------------------------------------------------------- brute force


@contextlib.contextmanager
def reference_mode():
    """Let ``torch.func`` differentiate attention: SDPA's composite kernel (the fused CPU one
    has no forward-mode derivative) and no MHA fast path. curvlib needs neither."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


class BruteForce:
    """Dense reference quantities over the flattened parameters ``θ`` (``P`` entries)."""

    def __init__(self, model: nn.Module, lossfn: nn.Module, X: Tensor, y: Tensor):
        self.params = {k: p.detach() for k, p in model.named_parameters()}
        self.names, self.shapes = list(self.params), [p.shape for p in self.params.values()]
        self.sizes = [p.numel() for p in self.params.values()]
        theta = torch.cat([p.flatten() for p in self.params.values()])
        output = lambda t: functional_call(model, self._unflatten(t), (X,))  # noqa: E731
        with reference_mode():
            out0 = output(theta).detach()
            N = out0.shape[0]
            rows = torch.eye(N, dtype=torch.bool).view(N, N, *[1] * (out0.dim() - 1))

            def shares(t):  # [N]: sample n's share of the loss (the other samples' outputs held fixed)
                out = output(t)
                return torch.stack([lossfn(torch.where(rows[n], out, out0), y) for n in range(N)])

            self.g = jacrev(shares)(theta)  # [N, P] individual gradients
            J = jacrev(output)(theta).reshape(N, -1, theta.numel())  # [N, K, P]
            HL = hessian(lambda o: lossfn(o, y))(out0).reshape(N, J.shape[1], N, J.shape[1])
            self.G_n = torch.einsum("nkp,nkl,nlq->npq", J, HL.diagonal(dim1=0, dim2=2).permute(2, 0, 1), J)
            self.H = hessian(lambda t: lossfn(output(t), y))(theta)
            self.H_n = torch.stack([hessian(lambda t, n=n: shares(t)[n])(theta) for n in range(N)])
        self.G = self.G_n.sum(0)

    def _unflatten(self, theta: Tensor) -> Dict[str, Tensor]:
        return {k: t.view(s) for k, t, s in zip(self.names, theta.split(self.sizes), self.shapes)}

    def per_param(self, flat: Tensor) -> Dict[str, Tensor]:
        """``[..., P] -> {name: [..., *p.shape]}``."""
        return {k: t.reshape(*flat.shape[:-1], *s) for k, t, s in zip(self.names, flat.split(self.sizes, -1), self.shapes)}

    def blocks(self, mat: Tensor) -> Dict[str, Tensor]:
        """Diagonal blocks ``{name: [..., P_p, P_p]}`` of ``[..., P, P]``."""
        out, start = {}, 0
        for k, size in zip(self.names, self.sizes):
            out[k] = mat[..., start:start + size, start:start + size]
            start += size
        return out

    def diag(self, mat: Tensor) -> Dict[str, Tensor]:
        return self.per_param(torch.diagonal(mat, dim1=-2, dim2=-1))


# ----------------------------------------------------------------------------- comparisons
# Each check maps (curvlib's result {name: value}, the reference) to (passed or None, cell text);
# None marks information (approximations by design), not a pass/fail.


def rel_error(got: Dict[str, Tensor], want: Dict[str, Tensor]) -> float:
    """max |got − want| over every parameter / max |want| (the scale of the whole result)."""
    err = max(float((got[k] - w).abs().max()) for k, w in want.items())
    return err / max(max(float(w.abs().max()) for w in want.values()), 1e-300)


def exact(reference: Callable[[BruteForce], Dict[str, Tensor]]):
    def check(result, ref):
        e = rel_error(result, reference(ref))
        return e <= TOLERANCE, f"max rel. error vs brute force {e:.1e}"
    return check


def grams(result, ref):
    """A square root ``S [V, N, *p.shape]`` is known up to rotation: compare ``Σ_v S Sᵀ`` with ``G_n``."""
    got = {k: torch.einsum("vnp,vnq->npq", S.flatten(2), S.flatten(2)) for k, S in result.items()}
    e = rel_error(got, ref.blocks(ref.G_n))
    return e <= TOLERANCE, f"max rel. error of S Sᵀ vs brute force {e:.1e}"


def _probes(ref) -> Dict[str, Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {k: torch.randn(3, *s, generator=gen, dtype=DT) for k, s in zip(ref.names, ref.shapes)}


def product(matrix: Callable[[BruteForce], Tensor]):
    """A block product ``V ↦ V·M_pp`` on random ``V [3, *p.shape]``."""
    def check(result, ref):
        V, blocks = _probes(ref), ref.blocks(matrix(ref))
        got = {k: result[k](v).flatten(1) for k, v in V.items()}
        e = rel_error(got, {k: v.flatten(1) @ blocks[k] for k, v in V.items()})
        return e <= TOLERANCE, f"max rel. error vs brute force {e:.1e}"
    return check


def positive_curvature(result, ref):
    """PCHMP = G + Σ Jᵀ mod(R) J with every mod(R) ⪰ 0, so vᵀ(PCH − G)v ≥ 0 per block."""
    V, blocks = _probes(ref), ref.blocks(ref.G)
    margin = min(float(((result[k](v) - (v.flatten(1) @ blocks[k]).view_as(v)) * v).flatten(1).sum(1).min()
                       / (v.flatten(1) @ blocks[k] * v.flatten(1)).sum(1).abs().max().clamp_min(1e-300))
                 for k, v in V.items())
    return margin >= -TOLERANCE, f"vᵀ(PCH − G)v ≥ 0 on random v (min rel. {margin:.1e})"


def monte_carlo(reference: Callable[[BruteForce], Dict[str, Tensor]], gram: bool = False):
    def check(result, ref):
        got = {k: torch.einsum("vnp,vnq->pq", S.flatten(2), S.flatten(2)) for k, S in result.items()} if gram else result
        e = rel_error(got, reference(ref))
        return None, f"rel. error of the mean of {MC_SAMPLES} MC samples {e:.2f} (approximation)"
    return check


def _kron(factors: List[Tensor]) -> Tensor:
    """Kronecker product in order; a 1-D factor stands for a diagonal matrix (curvlib's convention)."""
    mats = [torch.diag(f) if f.dim() == 1 else f for f in factors]
    out = mats[0]
    for m in mats[1:]:
        out = torch.kron(out, m)
    return out


def kronecker(matrix: Callable[[BruteForce], Tensor], what: str):
    def check(result, ref):
        blocks, got = ref.blocks(matrix(ref)), {k: _kron(f) for k, f in result.items()}
        if any(got[k].shape != b.shape for k, b in blocks.items()):  # a layout this example does not know
            return None, "factors " + ", ".join(f"{k}: {[list(f.shape) for f in v]}" for k, v in result.items())
        e = rel_error(got, blocks)
        return None, f"⊗ of the factors vs the exact {what} block: rel. distance {e:.2f} (approximation)"
    return check


def empirical_fisher(ref) -> Tensor:
    return ref.g.T @ ref.g


def _gen():
    return torch.Generator().manual_seed(0)


# (extension, check): every extension curvlib exports
EXTENSIONS = [
    (E.BatchGrad(), exact(lambda r: r.per_param(r.g))),
    (E.BatchL2Grad(), exact(lambda r: {k: (g**2).flatten(1).sum(1) for k, g in r.per_param(r.g).items()})),
    (E.SumGradSquared(), exact(lambda r: r.per_param((r.g**2).sum(0)))),
    (E.Variance(), exact(lambda r: r.per_param((r.g**2).mean(0) - r.g.mean(0) ** 2))),
    (E.DiagGGNExact(), exact(lambda r: r.diag(r.G))),
    (E.DiagGGNMC(mc_samples=MC_SAMPLES, generator=_gen()), monte_carlo(lambda r: r.diag(r.G))),
    (E.BatchDiagGGNExact(), exact(lambda r: r.diag(r.G_n))),
    (E.BatchDiagGGNMC(mc_samples=MC_SAMPLES, generator=_gen()), monte_carlo(lambda r: r.diag(r.G_n))),
    (E.DiagHessian(), exact(lambda r: r.diag(r.H))),
    (E.BatchDiagHessian(), exact(lambda r: r.diag(r.H_n))),
    (E.KFAC(generator=_gen()), kronecker(lambda r: r.G, "GGN")),
    (E.KFLR(), kronecker(lambda r: r.G, "GGN")),
    (E.KFRA(), kronecker(lambda r: r.G, "GGN")),
    (E.KFACEmpirical(), kronecker(empirical_fisher, "empirical Fisher")),
    (E.SqrtGGNExact(), grams),
    (E.SqrtGGNMC(mc_samples=MC_SAMPLES, generator=_gen()), monte_carlo(lambda r: r.blocks(r.G), gram=True)),
    (E.GGNMP(), product(lambda r: r.G)),
    (E.HMP(), product(lambda r: r.H)),
    (E.PCHMP(), positive_curvature),
]


# ----------------------------------------------------------------------------- main


def run_extension(ext, check, model, lossfn, X, y, ref) -> Tuple[str, bool]:
    """One table row's status cell, and whether it failed."""
    try:
        t0 = time.perf_counter()
        result = curvature(model, lossfn, [ext])(X, y)[ext.name]
        ms = 1e3 * (time.perf_counter() - t0)
    except CurvatureError as err:
        return f"refused: {' '.join(str(err).split())[:150]}", False
    except Exception as err:  # noqa: BLE001 - a bug: reported, and the example fails
        return f"ERROR {type(err).__name__}: {' '.join(str(err).split())[:150]}", True
    try:
        passed, text = check(result, ref)
    except Exception as err:  # noqa: BLE001 - a result of the wrong layout: reported, and the example fails
        return f"FAILED (comparison raised {type(err).__name__}: {err})", True
    status = "ok" if passed else "FAILED" if passed is False else "ran"
    return f"{status} ({text}; {ms:.0f} ms)", passed is False


def check_problem(title: str, model: nn.Module, lossfn: nn.Module, X: Tensor, y: Tensor,
                  rows: List[Tuple[str, str, str]] = None) -> int:
    """Print one model's table (every extension alone vs brute force); return the number of failures.
    ``rows``, if given, receives ``(title, extension, cell)`` per row (for the figure)."""
    P = sum(p.numel() for p in model.parameters())
    print(f"\n{title}: {P} parameters, X {list(X.shape)}, output {list(model(X).shape)}, "
          f"{type(lossfn).__name__}, float64")
    ref = BruteForce(model, lossfn, X, y)
    failures = 0
    for ext, check in EXTENSIONS:
        cell, failed = run_extension(ext, check, model, lossfn, X, y, ref)
        failures += failed
        print(f"  {type(ext).__name__:<18} {ext.name:<22} {cell}")
        if rows is not None:
            rows.append((title, type(ext).__name__, cell))
    return failures


def _parse(cell: str) -> Tuple[str, float, float]:
    """``(status, relative error or nan, ms or nan)`` read back from a table cell."""
    err = re.search(r"(?:vs brute force|samples|rel\. distance) ([0-9.]+(?:e[+-]?[0-9]+)?)", cell)
    if err is None and "≥ 0" in cell:  # PCHMP: a property holds, no error to show
        err = re.match(r"(0)", "0")
    ms = re.search(r"; ([0-9]+) ms\)$", cell)
    return (cell.split(" ")[0].rstrip(":"), float(err.group(1)) if err else float("nan"),
            float(ms.group(1)) if ms else float("nan"))


def plot(rows: List[Tuple[str, str, str]], path: str) -> None:
    """Save :func:`figure` of ``rows`` to ``path``."""
    import matplotlib.pyplot as plt

    fig = figure(rows)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figure(rows: List[Tuple[str, str, str]]):
    """One panel per model: relative error per extension (log), coloured by status; the call's time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = list(dict.fromkeys(r[0] for r in rows))
    # (at least 7.5 in wide: one panel (--quick) must hold the title and the axis label)
    fig, axes = plt.subplots(1, len(titles), figsize=(max(5.2 * len(titles), 7.5), 6), sharey=True, squeeze=False)
    colours = {"ok": "tab:green", "ran": "tab:gray", "refused": "tab:red"}
    for ax, title in zip(axes[0], titles):
        mine = [r for r in rows if r[0] == title]
        for i, (_, ext, cell) in enumerate(mine):
            status, err, ms = _parse(cell)
            if status == "refused" or err != err:
                ax.plot([1e-16], [i], "x", color="tab:red", ms=9)
            else:
                ax.barh(i, max(err, 1e-17), left=1e-17, color=colours.get(status, "black"))
            if ms == ms:
                ax.text(3e-16 if status == "refused" else max(err, 1e-17) * 2, i, f"{ms:.0f} ms",
                        va="center", fontsize=7)
        ax.set_yticks(range(len(mine)), [r[1] for r in mine], fontsize=8)
        ax.set_xscale("log")
        ax.set_xlim(1e-17, 1e3)
        ax.axvline(TOLERANCE, color="k", ls=":", lw=1)
        ax.set_xlabel("rel. error vs brute force\n(green: checked, grey: approximation)")
        ax.set_title(title)
    axes[0][0].invert_yaxis()
    fig.suptitle(f"every extension vs torch.func brute force\n(float64; dotted: tolerance {TOLERANCE:g}; x: refused)")
    fig.tight_layout()
    return fig


#: What ``--quick`` runs (and the docs' figure shows): one transformer, one recurrent network.
QUICK = ("GPT (tied head)", "LSTMClassifier")


def main(argv=None) -> int:
    """Every problem's table and the figure; 0 if every checked quantity agrees, else 1."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tied-head GPT and the LSTM only")
    parser.add_argument("--out", default="figures", help="folder for the PNG (created if missing)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # tiny float64 problems: one thread is fastest
    chosen = [p for p in problems() if not args.quick or p[0] in QUICK]
    rows: List[Tuple[str, str, str]] = []
    failures = sum(check_problem(*problem, rows=rows) for problem in chosen)
    print(f"\n{'FAILED: ' + str(failures) + ' disagreement(s)' if failures else 'every checked quantity agrees'}")
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib not installed: no figure")
    else:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "architectures.png")
        plot(rows, path)
        print(f"figure saved to {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
