"""The ecosystem sweep (tests/oracles/ecosystem.py) against float64 brute force.

A fast slice across libraries runs by default: a decoder sequence classifier, an encoder
masked LM, a timm family, a torchvision builder, a PEFT LoRA adapter and a weight_norm
layer, direct (the library's model, dict ``X``) or wrapped (a one-line module). Cases that
fail today are ``xfail(strict=True)`` with the failure, so that a fix shows as XPASS. The
whole sweep per library, and the enumeration and shrinker, are slow-marked; the command
``python benchmarks/ecosystem_sweep.py`` writes the report of every class.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("timm")
pytest.importorskip("peft")

from oracles import ecosystem, ecosystem_checks  # noqa: E402


FAST = [
    pytest.param("transformers/seq_cls/llama", "direct", "first_order"),
    pytest.param("transformers/masked_lm/bert", "direct", "ggn"),
    pytest.param("timm/convit", "wrapped", "first_order"),
    pytest.param("torchvision/mobilenet_v3_small", "direct", "ggn"),
    pytest.param("peft/lora_gpt2", "direct", "first_order"),
    pytest.param("peft/lora_gpt2", "wrapped", "ggn"),
    pytest.param("peft/weight_norm", "direct", "kflr"),
]


def _check(name: str, variant: str, group: str, limit: int = 120):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reason, prob = ecosystem.eligible_problem(name, variant)
        assert reason is None, f"{name} is not eligible: {reason}"
        return ecosystem_checks.check_group(prob, group, limit)


@pytest.mark.parametrize("name,variant,group", FAST)
def test_fast_slice(name, variant, group):
    res = _check(name, variant, group)
    assert res["outcome"] == "exact", f"{name} ({variant}) {group}: {res['outcome']}: {res['detail']}"


@pytest.mark.slow
@pytest.mark.xfail(strict=False, reason="the baseline: benchmarks/results/cpu/ecosystem-sweep-baseline.md")
@pytest.mark.parametrize("variant", ecosystem.VARIANTS)
@pytest.mark.parametrize("library", ecosystem.LIBRARIES)
def test_sweep(library, variant):
    """Every eligible class of ``library`` exact or refused for first order, GGN and KFLR."""
    bad = []
    for name in ecosystem.names(library):
        if ecosystem.eligibility(name, variant) is not None:
            continue
        for group in ("first_order", "ggn", "kflr"):
            res = _check(name, variant, group)
            if res["outcome"] not in ("exact", "refused"):
                bad.append(f"{name} {group}: {res['outcome']}: {res['detail'][:120]}")
    assert not bad, f"{len(bad)} failing (class, group) pairs:\n" + "\n".join(bad)


def test_float32_only_experts_get_float64_references():
    """Mixtral's default experts (``grouped_mm``) run only in float32: the problem is the float64
    model on transformers' ``batched_mm`` experts (the references), curvlib's the float32
    original, compared at ``F32_RTOL``; with ``TWIN = "float64"`` curvlib runs on the float64
    ``batched_mm`` experts itself and is exact there (each token row's chosen expert weights)."""
    reason, prob = ecosystem.eligible_problem("transformers/seq_cls/mixtral", "direct")
    assert reason is None and prob.rtol == ecosystem.F32_RTOL
    assert prob.model.config._experts_implementation == "batched_mm"
    assert prob.computed.model.config._experts_implementation == "grouped_mm"
    assert {p.dtype for p in prob.computed.model.parameters()} == {torch.float32}
    ecosystem.TWIN[0] = "float64"
    try:
        res = _check("transformers/seq_cls/mixtral", "direct", "first_order")
    finally:
        ecosystem.TWIN[0] = "float32"
    assert res["outcome"] == "exact", res


def test_names():
    """Every class of the four transformers mappings is enumerated."""
    assert len(ecosystem.names("transformers")) >= 400
    assert len(ecosystem.names("peft")) == len(ecosystem.PEFT)


@pytest.mark.slow
def test_shrinker_builds():
    """The generic shrinker builds at least 200 transformers classes."""
    from oracles import ecosystem_hf

    built = 0
    for name in ecosystem.names("transformers"):
        _, mapping, model_type = name.split("/", 2)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ecosystem_hf.build_model(mapping, model_type)
            built += 1
        except Exception:  # noqa: BLE001 - counted, not raised
            continue
    assert built >= 200, built


def test_shrunk_config_is_tiny():
    """The shrinker's rules on a known config: Llama at hidden 16, 1 layer, 2 heads, vocab 64."""
    from transformers import LlamaConfig

    from oracles.ecosystem_hf import shrink

    cfg = shrink(LlamaConfig)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.vocab_size) == (16, 1, 2, 64)
    assert cfg.num_key_value_heads == 1 and cfg.head_dim == 8 and cfg.intermediate_size == 32
    assert cfg.num_labels == 3 and cfg.pad_token_id == 0
    assert torch.get_num_threads() == 1


def test_narrowing_divides_widths_and_restores_the_layers():
    """``narrowing.narrowed(k)`` builds a hard-coded-width network at 1/k of its widths (its
    forward runs, fewer parameters) and leaves every layer class as it was."""
    from torch import nn

    from oracles.narrowing import LAYERS, narrowed, parameter_count

    class Fixed(nn.Module):  # widths written into the class, as torchvision's builders do
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 64, 3, padding=1)
            self.dw = nn.Conv2d(64, 64, 3, padding=1, groups=64)
            self.norm = nn.BatchNorm2d(64)
            self.scale = nn.Parameter(torch.ones(64, 1, 1))
            self.head = nn.Linear(64 * 2 * 2, 3)

        def forward(self, x):
            h = self.norm(self.dw(self.conv(x))) * self.scale
            return self.head(torch.nn.functional.adaptive_avg_pool2d(h, 2).flatten(1))

    inits = {cls: cls.__dict__.get("__init__") for cls in LAYERS}
    new = nn.Parameter.__dict__["__new__"]
    wide = Fixed()
    with narrowed(4):
        narrow = Fixed()
    assert narrow.conv.out_channels == 16 and narrow.dw.groups == 16 and narrow.scale.shape == (16, 1, 1)
    assert narrow.head.in_features == 64 and narrow.head.out_features == 3
    assert parameter_count(narrow) * 3 < parameter_count(wide)
    assert narrow(torch.randn(2, 3, 8, 8)).shape == (2, 3)
    assert {cls: cls.__dict__.get("__init__") for cls in LAYERS} == inits
    assert nn.Parameter.__dict__["__new__"] is new and Fixed().conv.out_channels == 64


def test_timm_shrinking_rules():
    """The generic timm shrinking: depths to 1 (a stage of none stays none), widths divided where
    divisible, heads at most 2, head dims at most 8, position tables at most 256 long, width
    multipliers divided, and the fields of a config dataclass (and tuples of them) alike;
    restored after the block."""
    import dataclasses
    from typing import Tuple

    from timm.models import _builder, byobnet

    from oracles import ecosystem_vision as ev

    @dataclasses.dataclass
    class Block:
        d: int = 3
        c: int = 64
        type: str = "attn"

    @dataclasses.dataclass
    class Cfg:
        depths: Tuple[int, ...] = (2, 0, 5)
        embed_dim: Tuple[int, ...] = (96, 192, 100)
        blocks: Tuple[Block, ...] = (Block(), Block(d=1, c=12))

    class Model:
        def __init__(self, cfg=None, depth=12, embed_dim=768, num_heads=12, head_dim=64, layers=(3, 4),
                     position_embedding_size=10240, width_factor=1.0, mlp_ratio=4.0, patch_size=16):
            pass

    out = ev._shrunk_kwargs(Model, {"cfg": Cfg(), "num_heads": 6}, True, 8)
    assert out["cfg"] == Cfg(depths=(1, 0, 1), embed_dim=(12, 24, 100), blocks=(Block(d=1, c=8), Block(d=1, c=12)))
    assert (out["depth"], out["embed_dim"], out["num_heads"], out["head_dim"], out["layers"]) == (1, 96, 2, 8, (1, 1))
    assert out["position_embedding_size"] == 256 and out["width_factor"] == 1 / 8
    assert "mlp_ratio" not in out and "patch_size" not in out
    assert ev._shrunk_kwargs(Model, {}, True, 1) == {"depth": 1, "layers": (1, 1)}
    assert ev._shrunk_kwargs(Model, {}, False, 1) == {}
    original = _builder.build_model_with_cfg
    with ev._timm_shrinking(True, 8):
        assert byobnet.build_model_with_cfg is not original
    assert byobnet.build_model_with_cfg is original
