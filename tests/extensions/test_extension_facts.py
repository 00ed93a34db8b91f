"""Each extension class carries its facts, each layer family is one record, and
CONTRIBUTING.md's checklists name what the code reads.

A new extension is one class: a subclass that only renames an existing quantity runs through
every stage (batch slices, ranks' kinds, compiled calls) and equals the original.
"""

import dataclasses
import inspect
import pathlib
import re
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch import nn

from curvlib import curvature, extensions
from curvlib._core.family import Family
from curvlib.extensions import DiagGGNExact, Extension, SecondOrder
from curvlib.extensions.secondorder import MonteCarlo
from curvlib.rules import FAMILIES, FAMILY_OF
from oracles.on_device import seeded

CONTRIBUTING = pathlib.Path(__file__).resolve().parents[2] / "CONTRIBUTING.md"
PUBLIC = [getattr(extensions, n) for n in extensions.__all__ if n not in ("Extension", "SecondOrder")]
NEEDS = {"setup_context", "vmap", "jvp", "twice"}


@pytest.mark.parametrize("cls", PUBLIC, ids=lambda c: c.__name__)
def test_every_extension_states_its_facts(cls):
    assert cls.name and cls.quantity, cls
    assert cls.slices is not None or cls.slices_refused, f"{cls.__name__}: batch slices neither combined nor refused"
    assert cls.ranks is not None or cls.ranks_refused, f"{cls.__name__}: ranks neither combined nor refused"
    assert set(cls.function_needs) <= NEEDS
    assert cls.layer_kinds is None or set(cls.layer_kinds) <= set(FAMILY_OF), cls.layer_kinds
    if issubclass(cls, SecondOrder) and cls.monte_carlo:
        mc = getattr(extensions, cls.monte_carlo)
        assert issubclass(mc, MonteCarlo) and (mc.read_as or mc.quantity) == (cls.read_as or cls.quantity)


def test_every_family_is_one_complete_record():
    kinds = [f.kind for f in FAMILIES]
    assert len(set(kinds)) == len(kinds) and all(isinstance(f, Family) and f.types for f in FAMILIES)
    for f in FAMILIES:
        assert callable(f.forward)
        assert (f.kron_layout == "") == (f.kron is None), f.kind
        assert f.kron_layout != "split" or f.kron_input is not None, f.kind


@dataclass(frozen=True)
class _RenamedDiag(DiagGGNExact):
    """A new extension as one class: DiagGGNExact's quantity under another key."""

    name: ClassVar[str] = "renamed_diag"


def test_a_new_extension_is_one_class():
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    gen = seeded(0)
    X = torch.randn(7, 4, dtype=torch.float64, generator=gen)
    y = torch.randint(0, 3, (7,), generator=gen)
    ref = curvature(model, nn.CrossEntropyLoss(), [DiagGGNExact()])(X, y)["diag_ggn_exact"]
    for kw in ({}, {"batch_chunk_size": 3}):
        got = curvature(model, nn.CrossEntropyLoss(), [_RenamedDiag()], **kw)(X, y)["renamed_diag"]
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-12, atol=1e-14)


def test_contributing_names_what_the_code_reads():
    text = CONTRIBUTING.read_text(encoding="utf-8")
    facts = {n for c in (Extension, SecondOrder) for n, v in inspect.get_annotations(c).items() if "ClassVar" in str(v)}
    missing = sorted(f for f in facts - {"order"} if f"`{f}`" not in text)
    assert not missing, f"CONTRIBUTING.md's extension checklist does not name {missing}"
    fields = [f.name for f in dataclasses.fields(Family)]
    assert re.search(r"FAMILY = Family\(", text) and "FAMILIES" in text
    assert all(f in inspect.getsource(Family) for f in fields)
