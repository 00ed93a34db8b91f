"""Tiny timm, torchvision and PEFT models for the ecosystem sweep (random weights, no download).

* timm: one model per family (the module of ``timm.models`` that defines it): the variant with
  the fewest parameters among the smallest-named ones, built with ``pretrained=False``,
  ``num_classes=3``, ``img_size=32`` where accepted (the smallest of 32-256 px that runs), and shrinking keyword arguments of the
  model class (``embed_dim``, ``depth(s)``, ``dims``, ``num_heads``, ...) where they build;
  narrowed as torchvision's where it is still larger than ``SMALL_VISION_PARAMS`` (``MAX_VISION_PARAMS`` at most);
  where no such setting builds and runs small (a resolution fixed by the builder, size arguments
  that the builder fixes or that must agree, widths sliced by attributes narrowing does not
  see), shrunk generically (``timm_shrunk``): depths to 1 (or halved) and size arguments divided
  wherever the builder hands them to the model class (``build_model_with_cfg``: its keyword
  arguments, the class's defaults, config dataclasses, EfficientNet-style ``block_args``), at
  each image size the model may need (its pretrained config's ``input_size``, multiples of its
  patch), built for that size with ``img_size``; the model must give ``N x CLASSES`` logits;
* torchvision: every classification builder, ``num_classes=3``, every width divided by 16 (or
  8, 4, 32, 2: the first that builds, runs and stays under ``MAX_VISION_PARAMS``;
  ``narrowing.narrowed``), ``image_size=32`` where the class takes it, the smallest image size
  of 32, 64, 96, 224, 299 px that runs;
* PEFT: LoRA adapters (rank 2) on a tiny Llama and a tiny GPT-2, the base frozen; and a
  two-layer network whose last ``Linear`` is parametrized by ``weight_norm`` or
  ``spectral_norm`` (``torch.nn.utils.parametrizations``).

Each builder returns ``(model, X, notes)``; ``ecosystem.build`` finishes the problem.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import inspect
import re
from typing import Any, Dict, List, Tuple

import torch
from torch import nn

from curvlib.rules.generic import restored
from oracles.narrowing import narrowed, parameter_count
from oracles.zoo import CLASSES, N

MAX_VISION_PARAMS = 6_000_000  # float64 oracles and traces of larger CNNs take minutes on a shared 2-core CPU
SMALL_VISION_PARAMS = 1_000_000  # a timm model is narrowed below this where a divisor allows (coat: 5.3 M at width / 1)
WIDTH_DIVISORS = (16, 8, 4, 32, 2)  # narrowing.narrowed's k, tried in turn (2: widths that are split in halves)
_SIZE_WORDS = ["atto", "femto", "pico", "nano", "micro", "tiny", "xxs", "xs", "mini", "small", "s", "b0", "10t",
               "18", "lite0", "050", "100"]


class TooLarge(Exception):
    """The smallest buildable variant still has more than ``MAX_VISION_PARAMS`` parameters."""


def _images(g, px: int) -> torch.Tensor:
    return torch.randn(N, 3, px, px, generator=g, dtype=torch.float64)


def _size_rank(name: str) -> Tuple[int, int]:
    parts = re.split(r"[_.\-]", name)
    ranks = [i for i, w in enumerate(_SIZE_WORDS) if w in parts]
    return (min(ranks) if ranks else len(_SIZE_WORDS), len(name))


@functools.lru_cache(maxsize=None)
def timm_families() -> Dict[str, List[str]]:
    """``{module: [model names, smallest-named first]}`` over ``timm.list_models()``."""
    import timm  # optional dependency

    fams = {}
    for mod in timm.list_modules():
        names = timm.list_models(module=mod)
        if names:
            fams[mod] = sorted(names, key=_size_rank)
    return fams


def _meta_params(build) -> Tuple[int, type]:
    with torch.device("meta"):
        m = build()
    return sum(p.numel() for p in m.parameters()), type(m)


def _shrink_kwargs(cls) -> Dict[str, Any]:
    """Small values for the model class's size arguments, by name and default's length."""
    out = {}
    for name, p in inspect.signature(cls.__init__).parameters.items():
        d = p.default
        L = len(d) if isinstance(d, (tuple, list)) else 0
        if name in ("embed_dim", "hidden_dim") and isinstance(d, int):
            out[name] = 16
        elif name == "depth" and isinstance(d, int):
            out[name] = 1
        elif name == "num_heads":
            out[name] = (2,) * L if L else 2
        elif name in ("depths", "layers") and L:
            out[name] = (1,) * L
        elif name in ("dims", "embed_dims", "channels", "widths", "embed_dim") and L:
            out[name] = (16,) * L
        elif name in ("stem_width", "stem_chs") and isinstance(d, int):
            out[name] = 8
    return out


def _runs(model: nn.Module, px: int) -> bool:
    """Whether ``model`` runs on ``px`` px images and gives one row of ``CLASSES`` logits per
    image (an encoder variant's per-token output is no classification problem)."""
    try:
        with torch.no_grad():
            out = model.eval()(torch.randn(1, 3, px, px))
        return torch.is_tensor(out) and tuple(out.shape) == (1, CLASSES)
    except Exception:  # noqa: BLE001 - a size the model does not take
        return False


def timm_model(family: str, names: List[str], g) -> Tuple[nn.Module, torch.Tensor, str]:
    """One tiny model of a timm family (see the module docstring)."""
    import timm  # optional dependency

    try:
        return _timm_as_named(family, names, g)
    except Exception as e:  # noqa: BLE001 - the generic shrinking below, then the first reason
        first = e
    try:
        return timm_shrunk(family, names, g)
    except Exception as e:  # noqa: BLE001 - report the default setting's reason, and this one's
        raise type(first)(f"{first}; shrunk: {e}") from e


def _timm_as_named(family: str, names: List[str], g) -> Tuple[nn.Module, torch.Tensor, str]:
    """The smallest of the first named variants with the class's own shrinking arguments
    (``_shrink_kwargs``), then narrowed; the first setting tried for every family."""
    import timm  # optional dependency

    counted = []
    for name in names[:6]:
        try:
            counted.append((_meta_params(lambda: timm.create_model(name, num_classes=CLASSES))[0], name))
        except Exception:  # noqa: BLE001 - a variant that does not build is not the smallest
            continue
    if not counted:
        raise RuntimeError(f"no variant of {family} builds: {names[:3]}")
    _, name = min(counted)
    cls = _meta_params(lambda: timm.create_model(name, num_classes=CLASSES))[1]
    accepts = inspect.signature(cls.__init__).parameters
    base = dict(pretrained=False, num_classes=CLASSES)
    tries = [dict(base, img_size=32, **_shrink_kwargs(cls)), dict(base, **_shrink_kwargs(cls)),
             dict(base, img_size=32), base]
    for kw in tries:
        if "img_size" in kw and "img_size" not in accepts:
            continue
        shown = {k: v for k, v in kw.items() if k not in base}
        try:  # below SMALL_VISION_PARAMS where a divisor allows, else below MAX_VISION_PARAMS
            return _narrowest_that_runs(lambda: timm.create_model(name, **kw), name, shown, g, (32, 64, 96, 128, 256),
                                        divisors=(1,) + WIDTH_DIVISORS, max_params=SMALL_VISION_PARAMS)
        except Exception:  # noqa: BLE001 - too large or failing at every divisor: the larger budget
            pass
        try:
            return _narrowest_that_runs(lambda: timm.create_model(name, **kw), name, shown, g, (32, 64, 96, 128, 256),
                                        divisors=(1,) + WIDTH_DIVISORS)
        except TooLarge:
            raise
        except Exception:  # noqa: BLE001 - fall back to fewer overrides
            continue
    raise RuntimeError(f"{name}: no setting builds and runs at 32-256 px")


# The generic shrinking of a timm family whose named variants do not build small (fixed
# resolutions, builders that fix the size arguments, widths sliced by attributes that
# narrowing does not see): every size argument that reaches the model class is shrunk where
# the builder hands it over (``build_model_with_cfg``), the class's defaults, the builder's
# own values and the fields of a config dataclass (``cfg=MaxxVitCfg(...)``) alike.
_DEPTH_ARG = re.compile(r"^(depths?|layers|num_blocks|stage_blocks|depth_list|k_sec|transformer_depths|num_layers"
                        r"|block_layers)$")
_WIDTH_ARG = re.compile(r"^(embed_dims?|hidden_dims?|dims|channels|widths|width_list|stem_width|stem_chs"
                        r"|inner_dim|intermediate_size|mlp_dim|num_init_features|stem_size|num_features|head_hidden_size|inc_sec|k_r|partial_dim|qk_dim|head_widths)$")
_HEADS_ARG = re.compile(r"^(num_heads(_inner|_outer)?|heads|n_heads)$")
_HEAD_DIM_ARG = re.compile(r"^(dim_head|head_dim)$")
_MULTIPLIER_ARG = re.compile(r"^(width_factor|width_mult(iplier)?|channel_multiplier|channel_mult)$")
_POSITIONS_ARG = re.compile(r"^(position_embedding_size|max_position_embeddings|num_positions)$")  # table lengths
POSITIONS = 256  # a position table's length when shrunk: 16 x 16 patches
_FIELD_DEPTH, _FIELD_WIDTH = ("d",), ("c",)  # byobnet's ByoBlockCfg(d=depth, c=channels): dataclass fields only
#: the settings tried in turn: (depths: 1 each (1), halved (2: nextvit's stage of 5-block
#: units) or as named (0), the size arguments divided by)
SHRINK_LEVELS = ((1, 8), (1, 4), (1, 16), (1, 2), (1, 1), (2, 8), (2, 4), (2, 1), (0, 1))


def _shrunk_value(name: str, v, depth: int, k: int, field: bool = False):
    if k > 1 and isinstance(v, float) and _MULTIPLIER_ARG.match(name):
        return v / k  # a width multiplier (tresnet's width_factor)
    ints = isinstance(v, int) and not isinstance(v, bool)
    seq = isinstance(v, (tuple, list)) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
    if not (ints or seq):
        return v
    if depth and (_DEPTH_ARG.match(name) or field and name in _FIELD_DEPTH):
        f = (lambda x: min(x, 1)) if depth == 1 else (lambda x: max(min(x, 1), x // 2))  # noqa: E731 - 0 stays 0
    elif k > 1 and (_WIDTH_ARG.match(name) or field and name in _FIELD_WIDTH):
        f = lambda x: x // k if x % k == 0 and x // k >= 8 else x  # noqa: E731 - as narrowing's widths
    elif k > 1 and _HEADS_ARG.match(name):
        f = lambda x: min(x, 2)  # noqa: E731
    elif k > 1 and _HEAD_DIM_ARG.match(name):
        f = lambda x: min(x, 8)  # noqa: E731
    elif k > 1 and _POSITIONS_ARG.match(name):
        f = lambda x: min(x, POSITIONS)  # noqa: E731
    else:
        return v
    return f(v) if ints else type(v)(f(x) for x in v)


def _shrunk_config(v, depth: int, k: int):
    """A config dataclass (or a tuple of them) with its size fields shrunk, recursively."""
    import dataclasses

    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        changes = {}
        for f in dataclasses.fields(v):
            if not f.init:
                continue
            old = getattr(v, f.name)
            new = _shrunk_config(_shrunk_value(f.name, old, depth, k, field=True), depth, k)
            if new is not old:
                changes[f.name] = new
        return dataclasses.replace(v, **changes) if changes else v
    if isinstance(v, (tuple, list)) and any(dataclasses.is_dataclass(x) for x in v):
        return type(v)(_shrunk_config(x, depth, k) for x in v)
    return v


def _shrunk_block_args(stages, depth: int, k: int):
    """EfficientNet-style decoded architectures (``block_args``: a list of stages, each a list
    of block dicts, as ``_efficientnet_builder.decode_arch_def`` gives): each stage's first
    block only (it holds the stage's stride and channel change), the block dicts' sizes shrunk."""
    if not (isinstance(stages, list) and stages and all(isinstance(st, list) for st in stages)
            and all(isinstance(b, dict) for st in stages for b in st)):
        return stages
    block_size = {"out_chs": "channels", "num_heads": "num_heads", "key_dim": "head_dim", "value_dim": "head_dim"}

    def block(b):
        return {n: _shrunk_value(block_size.get(n, n), v, depth, k) for n, v in b.items()}

    return [[block(b) for b in (st[:1] if depth == 1 else st[:max(1, len(st) // 2)] if depth else st)] for st in stages]


def _shrunk_kwargs(model_cls, kwargs: Dict[str, Any], depth: int, k: int) -> Dict[str, Any]:
    values = {n: p.default for n, p in inspect.signature(model_cls.__init__).parameters.items()
              if p.default is not inspect.Parameter.empty}
    values.update(kwargs)
    out = dict(kwargs)
    for n, v in values.items():
        new = _shrunk_block_args(_shrunk_config(_shrunk_value(n, v, depth, k), depth, k), depth, k)
        if new is not v and new != v:
            out[n] = new
    return out


@contextlib.contextmanager
def _timm_shrinking(depth: int, k: int):
    """Within the block, timm models are built with their size arguments shrunk (above)."""
    import sys
    from timm.models import _builder

    original = _builder.build_model_with_cfg

    def build_model_with_cfg(model_cls, variant, pretrained, **kwargs):
        return original(model_cls, variant, pretrained, **_shrunk_kwargs(model_cls, kwargs, depth, k))

    holders = [m for name, m in list(sys.modules.items()) if name.startswith("timm.models")
               and getattr(m, "build_model_with_cfg", None) is original]
    try:
        for m in holders:
            m.build_model_with_cfg = build_model_with_cfg
        yield
    finally:
        for m in holders:
            m.build_model_with_cfg = original


def _accepts(cls, arg: str) -> bool:
    return any(arg in inspect.signature(c.__init__).parameters for c in cls.__mro__ if "__init__" in c.__dict__)


def _cfg_sizes(name: str) -> List[int]:
    """The image sizes a variant's pretrained config names (``input_size``, ``test_input_size``)."""
    import timm

    try:
        cfg = timm.models.get_pretrained_cfg(name)
        cfg = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
    except Exception:  # noqa: BLE001 - no config
        return []
    return [int(cfg[key][-1]) for key in ("input_size", "test_input_size") if cfg.get(key)]


def _patch_multiples(cls) -> Tuple[int, ...]:
    """Image sizes of a few patches where the class's default patch size is not a power of two
    (deepseek_vit's 14 px patches: 28-126 px rather than its named 546)."""
    p = inspect.signature(cls.__init__).parameters.get("patch_size")
    p = p.default if p is not None else None
    if not isinstance(p, int) or p < 2 or 32 % p == 0 or p % 32 == 0:
        return ()
    return tuple(p * m for m in (2, 3, 4, 6, 8, 9) if p * m <= 128)


def timm_shrunk(family: str, names: List[str], g) -> Tuple[nn.Module, torch.Tensor, str]:
    """A tiny model of a timm family, generically: for each of the first named variants
    (fewest parameters first), each of ``SHRINK_LEVELS`` (``_timm_shrinking``), each image
    size of 32, 64, 96, 128 px, a few patches (``_patch_multiples``) and those its pretrained
    config names (built for it with ``img_size`` where the class takes one) and each width
    divisor of ``narrowing``: the
    first that builds, gives ``CLASSES`` logits and has at most ``SMALL_VISION_PARAMS``
    parameters, else the first with at most ``MAX_VISION_PARAMS``."""
    import timm  # optional dependency

    counted = []
    for name in names[:6]:
        try:
            counted.append((*_meta_params(lambda: timm.create_model(name, num_classes=CLASSES)), name))
        except Exception:  # noqa: BLE001 - a variant that does not build
            continue
    fallback, why = None, f"no variant of {family} builds: {names[:3]}"
    for _, cls, name in sorted(counted, key=lambda t: t[0]):
        sizes = sorted(set((32, 64, 96, 128) + tuple(_cfg_sizes(name)) + _patch_multiples(cls)))
        sized = _accepts(cls, "img_size")
        for depth, k_arg in SHRINK_LEVELS:
            for px in sizes if sized else (None,):
                kw = dict(pretrained=False, num_classes=CLASSES, **({"img_size": px} if sized else {}))
                # the model class narrowed by its arguments last: a class whose width argument
                # must match a part built before it (vitamin's convolutional stem)
                for k, by_args in [(k, ()) for k in (1,) + WIDTH_DIVISORS] + [(k, (cls,)) for k in WIDTH_DIVISORS]:
                    def build():
                        with _timm_shrinking(depth, k_arg), narrowed(k, by_args):
                            return timm.create_model(name, **kw)
                    try:
                        n = _meta_params(build)[0]
                    except Exception as e:  # noqa: BLE001 - another setting may build
                        why = f"{name} depth {depth} width/{k_arg}: {type(e).__name__}: {e}"
                        if k == 1:
                            break  # the setting itself does not build
                        continue
                    if n > MAX_VISION_PARAMS or fallback is not None and n > SMALL_VISION_PARAMS:
                        why = f"{name}: {n} parameters (> {MAX_VISION_PARAMS})"
                        continue
                    try:
                        model = build()
                    except Exception as e:  # noqa: BLE001
                        why = f"{name} width/{k}: {type(e).__name__}: {e}"
                        continue
                    by = " by arguments" if by_args else ""
                    for run_px in (px,) if sized else sizes:
                        if _runs(model, run_px):
                            note = (f"{name} shrunk (depths {('as named', '1', 'halved')[depth]}, size arguments / {k_arg}, "
                                    f"img_size {px}) width / {k}{by}, {run_px} px, {n} params")
                            found = (model, _images(g, run_px), note)
                            if n <= SMALL_VISION_PARAMS:
                                return found
                            fallback = fallback or found
                            break
                    else:
                        why = f"{name}: runs at none of {sizes} px"
                        if n <= SMALL_VISION_PARAMS:
                            break  # narrower still changes no resolution: the next size or setting
    if fallback is not None:
        return fallback
    if "parameters" in why:
        raise TooLarge(why)
    raise RuntimeError(why)


@contextlib.contextmanager
def _class_depths_shrunk(cls):
    """Within the block, ``cls`` is built with every depth argument at 1 per stage, as its
    builder passes them (MaxVit's ``block_layers``) or in an object's ``depths`` list
    (RegNet's ``BlockParams``), and heads of at most 8 channels: for builders that fix depths
    and widths alike."""
    import copy

    own = cls.__dict__.get("__init__")
    init = cls.__init__
    sig = inspect.signature(init)

    def __init__(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        for n, v in list(bound.arguments.items()):
            if isinstance(getattr(v, "depths", None), list):
                v = copy.copy(v)
                v.depths = [min(d, 1) for d in v.depths]
                bound.arguments[n] = v
            elif _HEAD_DIM_ARG.match(n) and isinstance(v, int):
                bound.arguments[n] = min(v, 8)  # heads of 8 channels: narrowed widths keep whole heads
            else:
                bound.arguments[n] = _shrunk_value(n, v, 1, 1)
        init(*bound.args, **bound.kwargs)

    cls.__init__ = __init__
    try:
        yield
    finally:
        if own is None:
            del cls.__init__
        else:
            cls.__init__ = own


def tv_model(builder: str, g) -> Tuple[nn.Module, torch.Tensor, str]:
    """One torchvision classification builder at reduced width (module docstring); where every
    width is too large, at depth 1 per stage as well (``_class_depths_shrunk``)."""
    try:
        return _tv_model(builder, g, shallow=False)
    except TooLarge:
        return _tv_model(builder, g, shallow=True)


def _tv_model(builder: str, g, shallow: bool) -> Tuple[nn.Module, torch.Tensor, str]:
    import torchvision.models as tv  # optional dependency

    build_as_named = tv.get_model_builder(builder)
    kw = dict(weights=None, num_classes=CLASSES)
    cls = type(_build_on_meta(lambda: build_as_named(**kw)))

    def build(**kw):
        with _class_depths_shrunk(cls) if shallow else contextlib.nullcontext():
            return build_as_named(**kw)

    by_args = (cls,)
    accepts = inspect.signature(cls.__init__).parameters
    if "aux_logits" in accepts:
        kw.update(aux_logits=False, init_weights=False)
    kw.update({k: v for k, v in (("dropout", 0.0),) if k in accepts})
    if "image_size" not in accepts:
        shown = {k: v for k, v in kw.items() if k not in ("weights", "num_classes")}
        shown.update({"depths": 1} if shallow else {})
        return _narrowest_that_runs(lambda: build(**kw), builder, shown, g, (32, 64, 96, 224, 299), models=by_args)
    for px in (32, 28, 64):  # a transformer built for the image size; 28: patches of 14 px
        sized = dict(kw, image_size=px)
        shown = {k: v for k, v in sized.items() if k not in ("weights", "num_classes")}
        shown.update({"depths": 1} if shallow else {})
        try:
            return _narrowest_that_runs(lambda: build(**sized), builder, shown, g, (px,), models=by_args)
        except TooLarge:
            raise
        except RuntimeError:
            continue
    raise RuntimeError(f"{builder}: builds and runs at no image_size of 32, 28, 64 px")


def _build_on_meta(build) -> nn.Module:
    try:
        with torch.device("meta"):
            return build()
    except Exception:  # noqa: BLE001 - initialisers that copy tensors do not run on meta
        return build()


def _narrowest_that_runs(build, name: str, shown: Dict[str, Any], g, sizes, divisors=WIDTH_DIVISORS, models=(),
                         max_params: int = MAX_VISION_PARAMS) -> Tuple[nn.Module, torch.Tensor, str]:
    """The model ``build()`` makes at the first width divisor of ``divisors`` that builds, runs
    at one of ``sizes`` px and has at most ``max_params`` parameters; at each divisor
    the classes ``models`` are first narrowed by their arguments, then every layer is
    (``narrowing.narrowed``)."""
    why = "no width divisor builds"
    for k, by_arguments in itertools.product(divisors, (() if not models else (models,)) + ((),)):
        try:
            with narrowed(k, by_arguments):
                model = build()
        except Exception as e:  # noqa: BLE001 - another divisor may build
            why = f"width / {k}: {type(e).__name__}: {e}"
            continue
        n = parameter_count(model)
        if n > max_params:
            why = f"{name}: {n} parameters at width / {k} (> {max_params})"
            continue
        for px in sizes:
            if _runs(model, px):
                return model, _images(g, px), f"{name} {shown} width / {k}, {px} px, {n} params"
        why = f"{name}: runs at none of {sizes} px at width / {k}"
    if "parameters" in why:
        raise TooLarge(why)
    raise RuntimeError(why)


def peft_model(base: str, g) -> Tuple[nn.Module, torch.Tensor, str]:
    """A LoRA adapter (rank 2) on a tiny ``llama`` or ``gpt2`` causal LM; ``X`` token ids."""
    import peft  # optional dependency
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if base == "llama":
        cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, pad_token_id=0)
        model, targets = LlamaForCausalLM._from_config(cfg, attn_implementation="eager"), ["q_proj", "v_proj"]
    else:
        cfg = GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
        model, targets = GPT2LMHeadModel._from_config(cfg, attn_implementation="eager"), ["c_attn"]
    lora = peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=targets,
                           fan_in_fan_out=base == "gpt2")
    model = peft.get_peft_model(model, lora)
    ids = torch.randint(3, 64, (N, 5), generator=g)
    return model, ids, f"peft LoRA r=2 on {targets} of a tiny {base}, base frozen"


def parametrized_model(kind: str, g) -> Tuple[nn.Module, torch.Tensor, str]:
    """``Linear(6, 8) - tanh - Linear(8, 3)``, the last ``Linear`` parametrized by ``kind``."""
    from torch.nn.utils import parametrizations

    last = getattr(parametrizations, kind)(nn.Linear(8, CLASSES))
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), last)
    return model, torch.randn(N, 6, generator=g, dtype=torch.float64), f"{kind}-parametrized Linear(8, 3)"


LOGIT_SCALE = 4.0  # logits kept within ±4: softmax unsaturated (p_max < 1 - 1e-4 for 3 classes)


def calibrated(model: nn.Module, X: torch.Tensor) -> nn.Module:
    """``model`` (float64, eval mode) with logits in softmax's sensitive range, as a trained
    network has them: its batch norms' running statistics set to those of ``X`` (one
    train-mode pass, as calibrating a trained network's statistics does), then its last
    layer with ``CLASSES`` outputs scaled so that the largest logit is ``LOGIT_SCALE``.
    A deep narrowed network with arbitrary statistics has logits of ±60: its softmax
    saturates (``p = 1 - 1e-11``), and the loss Hessian ``diag(p) - p pᵀ`` then holds
    differences of numbers near 1, so any two float64 computations of the GGN differ by
    ~1e-7 relative: a problem that cannot tell right from wrong at the 1e-8 tolerance."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
             and m.running_mean is not None]
    momenta = [m.momentum for m in norms]
    try:
        with torch.no_grad():
            for m in norms:
                m.reset_running_stats()
                m.momentum = None  # a cumulative average: after one pass, the batch's statistics
            if norms:
                model.train()(X)
    finally:
        for m, momentum in zip(norms, momenta):
            m.momentum = momentum
        model.eval()
    heads = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))
             and m.weight.requires_grad and m.weight.shape[0] == CLASSES]
    with torch.no_grad(), restored(model):  # (an eval-mode cache it fills, timm's attention biases, emptied again:
        largest = float(model(X).abs().max())  # a cached table would hide its parameter from the oracles)
        if heads and largest > LOGIT_SCALE:
            heads[-1].weight.mul_(LOGIT_SCALE / largest)
            if heads[-1].bias is not None:
                heads[-1].bias.mul_(LOGIT_SCALE / largest)
    return model
