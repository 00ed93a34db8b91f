"""Run laplace-torch's own test suite with curvlib's backends added.

laplace-torch's tests are not part of this repository: they are extracted from
a git checkout of https://github.com/aleximmer/Laplace into a scratch folder,
patched there, and run with ``PYTHONPATH`` pointing at this repository's
``src``. Nothing here is collected by curvlib's own ``pytest``.

    python tests/laplace/suite/run_suite.py \
        --laplace-git /path/to/Laplace/.git [--rev 44ea62ac] [--out /tmp/laplace-tests] \
        [--src path/to/curvlib/src] [--all] [--bypass-whitelist] [-- extra pytest args]

Which tests: laplace-torch 0.3 (the installed release; it has ``ELLA``/``VaLLA``)
is newer than every commit of the repository snapshot used here, and the
repository has no ``0.3`` tag; the default ``--rev`` is the newest ``main``
(44ea62a, April 2025), whose tests run against the installed 0.3 (all of its
non-curvlib cases pass except 6 ``torch.load`` cases broken by torch >= 2.6).

Patching (in the scratch copy only):

* every list literal of laplace backends (``[BackPackGGN, CurvlinopsEF, ...]``,
  in ``parametrize`` or module-level lists such as ``backends = [...]``) gets
  ``CurvlibGGN`` (if it holds a GGN backend or an interface class) and
  ``CurvlibEF`` (if it holds an EF backend) appended;
* each backend's own test file (``test_curv_backends_<name>.py``) gets a copy
  ``test_curv_backends_<name>__curvlib.py`` in which that backend's names are
  re-bound to curvlib's (``BackPackGGN, BackPackEF = CurvlibGGN, CurvlibEF``)
  while the reference backends stay; the copy keeps only the tests that use a
  re-bound name.

By default only curvlib's cases run (``-k curvlib``); ``--all`` runs the whole
suite. ``--bypass-whitelist`` lets curvlib through FunctionalLaplace's backend
whitelist (see ``suite_conftest.py``). The summary (counts, every curvlib case
that did not pass with its message and a first classification) is printed and
written to ``<out>/summary.txt``; the JUnit report is ``<out>/report.xml``.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
DEFAULT_REV = "44ea62ac1f8cfd6f797f31c75e2cf34414fdddae"  # main, April 2025 (newest public)

GGN_LIKE = {"BackPackGGN", "CurvlinopsGGN", "AsdlGGN", "AsdfghjklGGN", "GGNInterface",
            "BackPackInterface", "AsdlInterface"}
EF_LIKE = {"BackPackEF", "CurvlinopsEF", "AsdlEF", "AsdfghjklEF", "EFInterface"}
IMPORT = "from curvlib.laplace import CurvlibEF, CurvlibGGN  # added by curvlib's run_suite.py\n"

# backend test file -> names re-bound to curvlib's backends in its copy
COPIES = {
    "test_curv_backends_backpack.py": {"BackPackGGN": "CurvlibGGN", "BackPackEF": "CurvlibEF"},
    "test_curv_backends_curvlinops.py": {"CurvlinopsGGN": "CurvlibGGN", "CurvlinopsEF": "CurvlibEF"},
    "test_curv_backends_asdl.py": {"AsdlGGN": "CurvlibGGN", "AsdlEF": "CurvlibEF"},
    "test_curv_backends_asdfghjkl.py": {"AsdfghjklGGN": "CurvlibGGN", "AsdfghjklEF": "CurvlibEF"},
    "test_curv_backends_interface.py": {
        "GGNInterface": "CurvlibGGN", "EFInterface": "CurvlibEF", "CurvatureInterface": "CurvlibGGN",
    },
}

# first-pass classification of a failure message (checked in order)
CLASSES = [
    ("environment", r"torchvision|No module named|fixture 'mocker' not found"),
    ("laplace whitelist", r"assert backend in \[BackPackGGN, AsdlGGN, CurvlinopsGGN\]"),
    ("core: KFACEmpirical", r"KFACEmpirical|Kronecker factors of the empirical Fisher"),
    ("core: dict inputs", r"dict-like|[Mm]apping|dict_key_x"),
    ("core: soft labels", r"class-index targets|class probabilities"),
    ("core: hooks", r"layer family 'generic'"),
    ("not curvlib: torch.load weights_only (torch >= 2.6)", r"Weights only load failed"),
]


def extract(git_dir: str, rev: str, out: Path) -> None:
    """``git archive <rev> tests`` of laplace-torch into ``out`` (replacing it)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tar = subprocess.run(["git", "--git-dir", git_dir, "archive", rev, "tests"],
                         check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(out)


def add_to_lists(text: str) -> tuple[str, int]:
    """Append curvlib's backends to every list literal of laplace backends."""
    count = 0

    def repl(match: re.Match) -> str:
        nonlocal count
        items = [t.strip() for t in match.group(1).split(",") if t.strip()]
        if not items or not all(re.fullmatch(r"\w+", t) for t in items):
            return match.group(0)
        extra = []
        if GGN_LIKE & set(items):
            extra.append("CurvlibGGN")
        if EF_LIKE & set(items):
            extra.append("CurvlibEF")
        extra = [e for e in extra if e not in items]
        if not extra:
            return match.group(0)
        count += 1
        return "[" + ", ".join(items + extra) + "]"

    return re.sub(r"\[([^\[\]]*)\]", repl, text), count


def _uses(node: ast.AST, names: set) -> bool:
    return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(node))


def rebound_copy(text: str, mapping: dict) -> str:
    """``text`` with ``mapping``'s names re-bound after the imports, and only the tests using them."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    drop = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            if not _uses(node, set(mapping)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                drop.append((start, node.end_lineno))
    for start, end in sorted(drop, reverse=True):
        del lines[start - 1:end]
    targets = ", ".join(mapping)
    values = ", ".join(mapping.values())
    rebind = IMPORT + f"{targets} = {values}  # curvlib's backends in their place\n"
    return _after_imports("".join(lines), rebind)


def _after_imports(text: str, insert: str) -> str:
    """``text`` with ``insert`` placed after its last top-level import."""
    tree = ast.parse(text)
    last = max(n.end_lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)))
    lines = text.splitlines(keepends=True)
    return "".join(lines[:last]) + insert + "".join(lines[last:])


def without_torchvision(text: str) -> str:
    """torchvision is an optional test dependency: its models skip the test when it is missing."""
    stub = ("import pytest as _pytest\n\n\nclass _NoTorchvision:  # added by curvlib's run_suite.py\n"
            "    def __getattr__(self, name):\n"
            "        return lambda *a, **k: _pytest.skip('environment: torchvision is not installed')\n")
    if "torchvision" not in text or importlib.util.find_spec("torchvision") is not None:
        return text
    text = re.sub(r"^import torchvision\.models as (\w+)$",
                  lambda m: stub + f"{m.group(1)} = _NoTorchvision()", text, flags=re.M)
    return re.sub(r"^from torchvision\.models import (\w+)$",
                  lambda m: stub + f"{m.group(1)} = _NoTorchvision().{m.group(1)}", text, flags=re.M)


def patch(tests: Path) -> list:
    notes = []
    for path in sorted(tests.glob("test_*.py")):
        text = without_torchvision(path.read_text())
        path.write_text(text)
        if path.name in COPIES:
            copy = path.with_name(path.stem + "__curvlib.py")
            copy.write_text(rebound_copy(text, COPIES[path.name]))
            notes.append(f"{copy.name}: copy with {', '.join(COPIES[path.name])} re-bound")
            continue
        new, count = add_to_lists(text)
        if count:
            path.write_text(_after_imports(new, IMPORT))
            notes.append(f"{path.name}: curvlib added to {count} backend list(s)")
    return notes


def classify(message: str) -> str:
    for label, pattern in CLASSES:
        if re.search(pattern, message):
            return label
    return "unclassified"


def summarize(report: Path, only_curvlib: bool) -> str:
    import xml.etree.ElementTree as ET

    rows = []
    for case in ET.parse(report).getroot().iter("testcase"):
        nodeid = f"{case.get('classname')}::{case.get('name')}"
        if only_curvlib and "curvlib" not in nodeid.lower():
            continue
        outcome, message, detail = "passed", "", ""
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (child.get("message") or child.text or "").strip()
                detail = message + "\n" + (child.text or "")
                break
        rows.append((nodeid, outcome, message, detail))
    counts = {}
    for _, outcome, _, _ in rows:
        counts[outcome] = counts.get(outcome, 0) + 1
    out = [f"{'curvlib' if only_curvlib else 'all'} cases: {len(rows)} " + str(dict(sorted(counts.items())))]
    by_class = {}
    for nodeid, outcome, message, detail in rows:
        if outcome in ("failed", "error"):
            by_class.setdefault(classify(detail), []).append((nodeid, message))
    for label, items in sorted(by_class.items()):
        out.append(f"\n== {label}: {len(items)}")
        for nodeid, message in items:
            first = message.splitlines()[0] if message else ""
            out.append(f"  {nodeid}\n      {first[:200]}")
    skipped = [(n, m) for n, o, m, _ in rows if o == "skipped"]
    if skipped:
        out.append(f"\n== skipped: {len(skipped)}")
        out += [f"  {n}: {m.splitlines()[0][:120] if m else ''}" for n, m in skipped]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--laplace-git", default=os.environ.get("LAPLACE_GIT", "/work/.mirror/aleximmer+Laplace/repo"))
    ap.add_argument("--rev", default=DEFAULT_REV)
    ap.add_argument("--out", type=Path, default=Path("/tmp/laplace-tests"))
    ap.add_argument("--src", type=Path, default=REPO / "src", help="curvlib's source folder to test")
    ap.add_argument("--all", action="store_true", help="run the whole suite, not only curvlib's cases")
    ap.add_argument("--bypass-whitelist", action="store_true")
    ap.add_argument("pytest_args", nargs="*")
    args = ap.parse_args(argv)

    extract(args.laplace_git, args.rev, args.out)
    for note in patch(args.out / "tests"):
        print(note)
    shutil.copy(HERE / "suite_conftest.py", args.out / "conftest.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(args.src.resolve()), os.environ.get("PYTHONPATH", "")]))
    if args.bypass_whitelist:
        env["CURVLIB_SUITE_BYPASS_WHITELIST"] = "1"
    report = args.out / "report.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(args.out),
           f"--junitxml={report}", "-W", "ignore::DeprecationWarning", "tests"]
    if not args.all:
        cmd += ["-k", "curvlib"]
    subprocess.run(cmd + args.pytest_args, cwd=args.out, env=env)
    summary = summarize(report, only_curvlib=not args.all)
    (args.out / "summary.txt").write_text(summary + "\n")
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
