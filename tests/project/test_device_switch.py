"""The test-device switch ``CURVLIB_TEST_DEVICE`` (``tests/oracles/on_device.py``, ``conftest.py``).

Every random stream in the tests must come from ``oracles.on_device.seeded`` (or name its
device): a device-less ``torch.Generator()`` is a CPU generator, which torch
refuses for tensors on CUDA ("Expected a 'cuda' device type for generator").
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import torch

from oracles.on_device import CLEAN_ENVIRON, DEVICE, ON_CPU, SWITCH, seeded

TESTS = pathlib.Path(__file__).resolve().parents[1]


def _device_less_generators(source: str) -> list[int]:
    """Lines of ``Generator(...)`` calls without a device (no argument, no ``device=``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "attr", getattr(node.func, "id", None))
            if name == "Generator" and not node.args and not any(k.arg == "device" for k in node.keywords):
                lines.append(node.lineno)
    return sorted(lines)


def test_the_check_finds_device_less_generators():
    src = "import torch\ng = torch.Generator().manual_seed(0)\nh = torch.Generator(device='cpu')\nk = Generator()\n"
    assert _device_less_generators(src) == [2, 4]


def test_no_device_less_generator_in_the_tests():
    found = {
        str(p.relative_to(TESTS)): lines
        for p in sorted(TESTS.rglob("*.py"))
        if (lines := _device_less_generators(p.read_text()))
    }
    assert not found, f"use oracles.on_device.seeded(seed) instead of torch.Generator() (file: lines): {found}"


def test_seeded_follows_the_test_device():
    g = seeded(5)
    assert g.device.type == DEVICE.type
    assert torch.empty(0).device.type == DEVICE.type  # conftest made it the default device
    if ON_CPU:  # the same stream as the generators it replaced
        ref = torch.Generator(device="cpu").manual_seed(5)
        assert torch.equal(torch.randn(7, generator=g), torch.randn(7, generator=ref))


def test_switch_sets_the_default_device_in_a_fresh_process():
    """Set-up path for a non-CPU device, run here with ``meta`` (no accelerator needed)."""
    script = "import conftest, torch; print(torch.empty(0).device, torch.nn.Linear(2, 2).weight.device)"
    env = dict(CLEAN_ENVIRON, **{SWITCH: "meta"})
    out = subprocess.run([sys.executable, "-c", script], cwd=TESTS, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["meta", "meta"]
