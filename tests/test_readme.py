"""README's Python blocks run, top to bottom in one namespace, as a reader would paste them.

A block preceded by an ``<!-- not run ... -->`` comment (it needs a process group or
data loaders; another test runs that path) is skipped. The blocks' own comments claim
shapes; a few of those claims are checked here, so a README that drifts fails.
"""

import os
import re

import pytest
import torch

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")
_BLOCK = re.compile(r"(<!-- not run[^>]*-->\n)?```python\n(.*?)```", re.S)


def readme_blocks():
    """``(line, code, skipped)`` for every python block of README.md."""
    text = open(README, encoding="utf-8").read()
    return [(text[: m.start()].count("\n") + 1, m.group(2), m.group(1) is not None) for m in _BLOCK.finditer(text)]


def test_readme_blocks_run_in_order():
    blocks = readme_blocks()
    assert len(blocks) >= 4
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
    assert ran >= 4
    qs = namespace["qs"]
    assert isinstance(qs, dict) and "loss" in qs


def test_readme_shape_claims():
    """The first two blocks' commented shapes are what curvlib returns."""
    namespace: dict = {"__name__": "readme"}
    for line, code, skipped in readme_blocks()[:2]:
        exec(compile(code, f"README.md:{line}", "exec"), namespace)
        if "grad_batch" in namespace["qs"] and "kfac" not in namespace["qs"]:
            first = namespace["qs"]
            assert first["grad_batch"]["0.weight"].shape == (32, 64, 784)
            assert first["batch_l2"]["0.weight"].shape == (32,)
    qs = namespace["qs"]
    assert qs["grad_batch"]["embed.weight"].shape == (8, 50, 32)
    assert [tuple(t.shape) for t in qs["kfac"]["head.weight"]] == [(50, 50), (32, 32)]
