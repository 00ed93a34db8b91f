"""README's Python blocks run, top to bottom in one namespace, as a reader would paste them.

A block preceded by an ``<!-- not run ... -->`` comment (it needs a process group or
data loaders; another test runs that path) is skipped; tests/project/test_docs.py checks that
such a block also says so visibly. The blocks' own comments claim shapes; those claims
are checked here, so a README that drifts fails. The README is the front page: the
longer material, and its code blocks, live in docs/*.md (run by tests/project/test_docs.py).
"""

import os
import re

import pytest
import torch

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "README.md")
_BLOCK = re.compile(r"(<!-- not run[^>]*-->\n)?```python\n(.*?)```", re.S)


def readme_blocks():
    """``(line, code, skipped)`` for every python block of README.md."""
    text = open(README, encoding="utf-8").read()
    return [(text[: m.start()].count("\n") + 1, m.group(2), m.group(1) is not None) for m in _BLOCK.finditer(text)]


def test_readme_blocks_run_in_order():
    blocks = readme_blocks()
    assert len(blocks) >= 1
    namespace: dict = {"__name__": "readme"}
    ran = 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for line, code, skipped in blocks:
            if skipped:
                continue
            try:
                exec(compile(code, f"README.md:{line}", "exec"), namespace)
            except Exception as err:  # the block and its line in the failure message
                pytest.fail(f"README.md block at line {line} raised {type(err).__name__}: {err}\n{code}")
            ran += 1
    assert ran >= 1
    qs = namespace["qs"]
    assert isinstance(qs, dict) and "loss" in qs


def test_readme_shape_claims():
    """The first block's commented shapes are what curvlib returns."""
    namespace: dict = {"__name__": "readme"}
    line, code, _ = readme_blocks()[0]
    exec(compile(code, f"README.md:{line}", "exec"), namespace)
    qs = namespace["qs"]
    assert qs["grad_batch"]["0.weight"].shape == (32, 64, 784)
    assert qs["batch_l2"]["0.weight"].shape == (32,)


def test_readme_is_a_front_page():
    """At most ~200 lines; the rest is on the documentation site's pages."""
    text = open(README, encoding="utf-8").read()
    assert text.count("\n") <= 200
    for page in ("docs/get-started.md", "docs/transform.md", "docs/large-models.md", "docs/model-zoos.md",
                 "docs/install.md"):
        assert f"]({page}" in text, f"the README links no {page}"


def test_ci_runs_the_readme_test_command():
    """.ci/run runs the README's test command verbatim (so CI installs what the README says)."""
    text = open(README, encoding="utf-8").read()
    (command,) = [line for line in text.splitlines() if line.startswith("pip install") and "pytest" in line]
    ci = open(os.path.join(os.path.dirname(README), ".ci", "run"), encoding="utf-8").read()
    assert command in ci.splitlines(), f".ci/run does not run the README's test command:\n{command}"
    assert '".[test,examples,docs]"' in command, "the test command must install the docs extra (tests/project/test_docs_site.py)"
