"""The package shows the pipeline: README's "How it works" tree lists every folder of
``src/curvlib`` in import order, every folder says what it owns, and every import points down
that order (a folder imports only folders listed above it)."""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "curvlib"


def _readme_order():
    """Folders and root modules in the order README's tree lists them."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## How it works"):]
    tree = section[section.index("```text") + len("```text"):]
    tree = tree[:tree.index("```")]
    order = []
    for line in tree.splitlines():
        for name in re.findall(r"(?:^|\s)([_a-z]+)(/|\.py)(?=\s|$)", line):
            order.append(name[0])
    return order


def _units():
    """Top-level folders and modules of the package (``__init__``/``__main__`` aside)."""
    return sorted({p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
                  | {p.stem for p in SRC.glob("*.py") if not p.stem.startswith("__")})


def test_readme_tree_lists_every_folder():
    assert sorted(_readme_order()) == _units()


@pytest.mark.parametrize("folder", [p for p in SRC.iterdir() if (p / "__init__.py").exists()], ids=lambda p: p.name)
def test_every_folder_says_what_it_owns(folder):
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text(encoding="utf-8")))
    assert doc and len(doc) > 40, f"{folder.name}/__init__.py has no docstring saying what it owns"


def _imports(path: pathlib.Path):
    """The package-relative targets of ``path``'s relative imports (dotted, under curvlib)."""
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
            target = base + (node.module.split(".") if node.module else [])
            names = [target + [a.name] for a in node.names] if not node.module else [target]
            yield from (t for t in names if t)


def test_imports_point_down_the_pipeline():
    order = _readme_order()
    rank = {name: i for i, name in enumerate(order)}
    upward = []
    for path in SRC.rglob("*.py"):
        unit = path.relative_to(SRC).parts[0].removesuffix(".py")
        if unit not in rank:
            continue
        for target in _imports(path):
            if target[0] in rank and rank[target[0]] > rank[unit]:
                upward.append(f"{path.relative_to(SRC)} -> {'.'.join(target)}")
    assert not upward, "imports pointing up README's order:\n" + "\n".join(sorted(set(upward)))
