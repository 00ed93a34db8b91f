"""The documentation site builds warning-free with the README's command, and its inputs exist.

The build (Sphinx + MyST, ``docs/conf.py``) imports curvlib for the API reference and writes
the example pages; it does not run the examples (their figures are committed). It runs in
a subprocess with the command the README gives, so the README's command is the one checked.
The ``docs`` extra installs Sphinx, MyST and the Furo theme; without them the build test skips,
except in CI (``CI=true``, .ci/run), where it fails: the test command installs them. The build
test then checks what a reader sees on the built pages (``check_built_pages``).
"""

import importlib.util
import os
import re
import shlex
import subprocess
import sys

import pytest

from oracles.on_device import CLEAN_ENVIRON

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
CODE = re.compile(r"^```.*?^```|`[^`\n]*`", re.S | re.M)  # code is not prose: its brackets are no links


def readme_docs_command():
    """The README's docs build command: the ``python -m sphinx ...`` part of its bash line."""
    text = open(README, encoding="utf-8").read()
    (line,) = [ln for ln in text.splitlines() if "-m sphinx" in ln and not ln.startswith("#")]
    return line.split("&&")[-1].strip()


def _need_sphinx():
    missing = [m for m in ("sphinx", "myst_parser", "furo") if importlib.util.find_spec(m) is None]
    if missing and os.environ.get("CI"):
        pytest.fail(f"{missing} not installed in CI: the README's test command installs the docs extra")
    if missing:
        pytest.skip(f"{missing} not installed: pip install -e \".[docs]\"")


def test_readme_names_a_warning_free_build():
    command = readme_docs_command()
    assert command.startswith("python -m sphinx ") and " -W " in command and "--keep-going" in command, command


def test_docs_build_is_warning_free():
    _need_sphinx()
    argv = shlex.split(readme_docs_command())
    argv[0] = sys.executable  # the interpreter running the tests, as `python` would be in CI
    env = dict(CLEAN_ENVIRON, PYTHONPATH=os.path.join(ROOT, "src"))
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout[-4000:] + proc.stderr[-6000:]
    assert proc.returncode == 0, f"the docs build failed or warned:\n{log}"
    assert "WARNING" not in proc.stderr, log
    html = os.path.join(ROOT, argv[-1])
    for page in ("index", "get-started", "api", "transform", "large-models", "model-zoos", "examples/index"):
        assert os.path.exists(os.path.join(html, f"{page}.html")), f"no {page}.html in {html}"
    check_built_pages(html)
    from test_api_reference import check_api_pages  # this folder is on sys.path (pytest's rootdir-less import)

    check_api_pages(html)  # the API reference: nothing private, real signatures, links to PyTorch and Python


def _read(html, page):
    return open(os.path.join(html, f"{page}.html"), encoding="utf-8").read()


def check_built_pages(html):
    """What a reader sees: math as MathJax, previous/next links, the version, the repository, the gallery."""
    conventions = _read(html, "conventions")
    # MyST's dollarmath writes MathJax's delimiters into these nodes, and the page loads MathJax
    assert conventions.count('<span class="math notranslate nohighlight">') >= 20, "no inline math on conventions"
    assert '<div class="math notranslate nohighlight">' in conventions, "no display math on conventions"
    assert "mathjax" in conventions.lower()
    assert 'class="next-page"' in conventions and 'class="prev-page"' in conventions, "no previous/next links"
    release = re.search(r'^version = "([^"]+)"', open(os.path.join(ROOT, "pyproject.toml")).read(), re.M).group(1)
    assert f"Version {release}" in conventions and f"curvlib {release}" in conventions, "the version is not shown"
    assert "Repository (source code)" in conventions
    gallery = _read(html, "examples/index")
    names = sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".py"))
    for name in names:
        assert f'<img src="../_static/examples/{name}.png"' in gallery, f"no thumbnail for {name}"
        assert os.path.exists(os.path.join(html, "_static", "examples", f"{name}.png"))
    assert "``" not in re.sub(r'<div class="highlight.*?</pre></div>', "", _read(html, "examples/dp_sgd"), flags=re.S), \
        "the example's docstring is shown as raw reStructuredText"


def test_every_example_has_a_committed_figure():
    """Each examples/X.py has docs/_static/examples/X.png (its page shows it), tracked by git."""
    names = sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".py"))
    assert names
    missing = [n for n in names if not os.path.exists(os.path.join(DOCS, "_static", "examples", f"{n}.png"))]
    assert missing == [], f"run python examples/X.py --quick --out docs/_static/examples for {missing}"
    tracked = subprocess.run(["git", "ls-files", "docs/_static/examples"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout: cannot check that the figures are committed")
    untracked = [n for n in names if f"docs/_static/examples/{n}.png" not in tracked.stdout.split()]
    assert untracked == [], f"figures not committed: {untracked}"


@pytest.mark.parametrize("page", ["README.md"] + sorted(f"docs/{f}" for f in os.listdir(DOCS) if f.endswith(".md")))
def test_relative_links_resolve(page):
    """Links between the README and the pages point at files that exist (GitHub renders them too)."""
    text = CODE.sub("", open(os.path.join(ROOT, page), encoding="utf-8").read())
    where = os.path.dirname(os.path.join(ROOT, page))
    broken = [target for target in LINK.findall(text)
              if "://" not in target and not os.path.exists(os.path.join(where, target))]
    assert broken == [], f"{page}: broken links {broken}"
