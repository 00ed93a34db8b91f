"""Every ```python block of ``docs/*.md`` runs, and migration pairs agree.

Protocol (the first line of a block says its role):

* ``# setup``: the seeded model and data of the blocks that follow; it is run
  afresh for each side of a pair, so both sides start from identical objects.
* ``# BackPACK`` followed by ``# curvlib``: a pair. Each side ends by binding
  ``result`` (tensors, lists of factors, dicts of those, numbers); the test runs
  both (the BackPACK side only when BackPACK is installed) and asserts the two
  ``result`` values agree, to float64 precision or, when the curvlib line says
  ``~P%`` (Monte Carlo), to ``P`` percent of the result's norm.
* ``# BackPACK (differs)`` followed by ``# curvlib (differs)``: both run; they
  assert what differs themselves. The curvlib side also sees the BackPACK
  side's names that start with ``backpack_`` (when BackPACK is installed).
* any other block: run in the file's running namespace (after its setups), in
  order, like a notebook; it asserts its own claims.
* a block right after an ``<!-- not run ... -->`` comment is not run (it needs a
  process group or data loaders; the comment names what runs that path instead).
  The comment is invisible once rendered, so the block must also follow a visible
  line saying so (``*Fragment, not runnable alone: ...*``): checked below, for the
  docs pages and the README alike.

Every page of the documentation site is a ``docs/*.md`` file, so every code block
of the site is covered here (the example pages include the example scripts, which
tests/project/test_examples_smoke.py runs).

A wrong doc fails: a renamed key raises, a changed layout or scaling makes the
``result`` values differ, a wrong claim fails the block's own ``assert``.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

DOCS = Path(__file__).resolve().parents[2] / "docs"
FENCE = re.compile(r"^(<!-- not run[^>]*-->\n)?```python\n(.*?)^```", re.S | re.M)
VISIBLE_NOTE = "*Fragment, not runnable alone"


def _blocks(path: Path):
    """The python blocks that run, in order (not-run fragments left out)."""
    return [m.group(2) for m in FENCE.finditer(path.read_text()) if m.group(1) is None]


def not_run_without_visible_note(text: str) -> list:
    """Lines of the ``not run`` comments with no visible note in the 4 lines above them."""
    bad = []
    for m in FENCE.finditer(text):
        if m.group(1) is None:
            continue
        line = text[: m.start()].count("\n")
        above = text.split("\n")[max(0, line - 4): line]
        if not any(VISIBLE_NOTE in a for a in above):
            bad.append(line + 1)
    return bad


def _role(block: str) -> str:
    first = block.lstrip().splitlines()[0].strip().lower() if block.strip() else ""
    if first.startswith("# setup"):
        return "setup"
    if first.startswith("# backpack"):
        return "backpack-differs" if "(differs)" in first else "backpack"
    if first.startswith("# curvlib"):
        return "curvlib-differs" if "(differs)" in first else "curvlib"
    return "plain"


def _tolerance(block: str) -> float:
    match = re.search(r"~(\d+(?:\.\d+)?)%", block.lstrip().splitlines()[0])
    return float(match.group(1)) / 100 if match else 1e-7


def _cases():
    """(file, index, kind, setup source, blocks) for every pair, lone block and notebook."""
    cases = []
    for path in sorted(DOCS.glob("*.md")):
        blocks = _blocks(path)
        setup, i = "", 0
        notebook = []
        while i < len(blocks):
            role = _role(blocks[i])
            if role == "setup":
                setup = blocks[i]
                notebook.append(blocks[i])
            elif role in ("backpack", "backpack-differs"):
                partner = blocks[i + 1] if i + 1 < len(blocks) else ""
                expected = "curvlib" if role == "backpack" else "curvlib-differs"
                assert _role(partner) == expected, (
                    f"{path.name} block {i}: a {role} block must be followed by a {expected} block"
                )
                cases.append(pytest.param(path.name, role, setup, blocks[i], partner, id=f"{path.stem}-{i}"))
                i += 1
            elif role.startswith("curvlib"):
                cases.append(pytest.param(path.name, "curvlib-alone", setup, "", blocks[i], id=f"{path.stem}-{i}"))
            else:
                notebook.append(blocks[i])
            i += 1
        cases.append(pytest.param(path.name, "notebook", "", "", "\n".join(notebook), id=f"{path.stem}-notebook"))
    return cases


def _run(setup: str, block: str, name: str, seen: dict = ()) -> dict:
    ns: dict = {"__name__": f"docs_{name}"}
    ns.update(seen)
    # the docs are CPU code (CPU generators): run them there under any CURVLIB_TEST_DEVICE
    with warnings.catch_warnings(), torch.device("cpu"):
        warnings.simplefilter("ignore")  # BackPACK's hook warnings, dropout notices
        torch.manual_seed(0)
        exec(compile(setup, f"<{name} setup>", "exec"), ns)
        ns.update(seen)
        exec(compile(block, f"<{name}>", "exec"), ns)
    return ns


def _flatten(value, where="result"):
    if isinstance(value, torch.Tensor):
        return [(where, value.detach())]
    if isinstance(value, (int, float)):
        return [(where, torch.tensor(float(value), dtype=torch.float64))]
    if isinstance(value, dict):
        return [item for k in sorted(value) for item in _flatten(value[k], f"{where}[{k!r}]")]
    if isinstance(value, (list, tuple)):
        return [item for i, v in enumerate(value) for item in _flatten(v, f"{where}[{i}]")]
    raise TypeError(f"{where}: cannot compare a {type(value).__name__}")


def assert_agree(actual, expected, rtol: float) -> None:
    """Same structure, shapes and values (relative to the whole result's norm)."""
    got, want = _flatten(actual), _flatten(expected)
    assert [w for w, _ in got] == [w for w, _ in want], "different structure (keys, factor counts)"
    scale = torch.sqrt(sum(e.double().pow(2).sum() for _, e in want)).item()
    for (where, a), (_, e) in zip(got, want):
        assert a.shape == e.shape, f"{where}: shape {tuple(a.shape)} != BackPACK's {tuple(e.shape)}"
        err = (a.double() - e.double()).norm().item()
        assert err <= rtol * max(scale, 1e-30), f"{where}: |difference| {err:.3g} vs |result| {scale:.3g}"


@pytest.mark.parametrize("doc, kind, setup, theirs, ours", _cases())
def test_doc_block(doc, kind, setup, theirs, ours):
    if kind == "notebook":
        _run("", ours, doc)
        return
    try:
        import backpack  # noqa: F401
    except ImportError:
        backpack = None
    if kind == "backpack-differs" and backpack is not None:
        other = _run(setup, theirs, doc)
        _run(setup, ours, doc, {k: v for k, v in other.items() if k.startswith("backpack_")})
        return
    mine = _run(setup, ours, doc)
    if kind in ("curvlib", "backpack"):
        assert "result" in mine, f"{doc}: the curvlib side binds no `result`"
    if kind == "curvlib-alone" or kind == "backpack-differs":
        return
    if backpack is None:
        pytest.skip("BackPACK is not installed: only the curvlib side ran")
    other = _run(setup, theirs, doc)
    assert "result" in other, f"{doc}: the BackPACK side binds no `result`"
    assert_agree(mine["result"], other["result"], _tolerance(ours))


@pytest.mark.parametrize("path", sorted(DOCS.glob("*.md")) + [DOCS.parent / "README.md"], ids=lambda p: p.name)
def test_not_run_blocks_say_so_visibly(path):
    assert not_run_without_visible_note(path.read_text()) == [], (
        f"{path.name}: a block marked <!-- not run --> needs a visible '{VISIBLE_NOTE} ...' line above it")


def test_not_run_check_can_fail():
    hidden = "text\n\n<!-- not run: needs a group -->\n```python\nddp\n```\n"
    assert not_run_without_visible_note(hidden) == [3]  # the comment's line
    shown = f"{VISIBLE_NOTE}: `ddp` comes from your script.*\n\n" + hidden
    assert not_run_without_visible_note(shown) == []


# ------------------------------------------------------------------ coverage of the migration guide

BACKPACK_NAMES = [
    "BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance", "DiagGGNExact", "DiagGGNMC",
    "BatchDiagGGNExact", "BatchDiagGGNMC", "DiagHessian", "BatchDiagHessian", "KFAC", "KFLR",
    "KFRA", "SqrtGGNExact", "SqrtGGNMC", "GGNMP", "HMP", "PCHMP",
    "extend(", "backpack(", "disable(", "extension_hook", "retain_graph", "use_converter=True",
]


def test_migration_guide_covers_every_extension():
    blocks = _blocks(DOCS / "migrating-from-backpack.md")
    paired = [(a, b) for a, b in zip(blocks, blocks[1:])
              if _role(a).startswith("backpack") and _role(b).startswith("curvlib")]
    for name in BACKPACK_NAMES:
        word = re.compile(rf"\b{re.escape(name)}" + (r"\b" if name[-1].isalnum() else ""))
        assert any(word.search(a) for a, _ in paired), f"no BackPACK block uses {name}"
    for name in BACKPACK_NAMES[:18]:
        word = re.compile(rf"\b{name}\(")
        assert any(word.search(b) for _, b in paired), f"no curvlib block uses {name}(...)"


def test_comparison_can_fail():
    """The comparison is strict enough to catch a wrong scaling or layout."""
    a = {"w": [torch.eye(2), torch.ones(3)]}
    assert_agree(a, {"w": [torch.eye(2), torch.ones(3)]}, 1e-7)
    with pytest.raises(AssertionError):
        assert_agree(a, {"w": [torch.eye(2), 2 * torch.ones(3)]}, 1e-7)
    with pytest.raises(AssertionError):
        assert_agree(a, {"w": [torch.ones(3), torch.eye(2)]}, 1e-7)
    with pytest.raises(AssertionError):
        assert_agree({"v": torch.ones(2)}, {"w": torch.ones(2)}, 1e-7)
