"""Tiny Hugging Face transformers models for the ecosystem sweep, built from config objects.

``shrink(config_class)`` builds a config from keyword arguments derived from the class's
default config by a generic rule per attribute name (hidden sizes 16, one layer, 2 heads,
head_dim 8, feed-forward 32, vocabulary 64, 4 experts with 2 per token, images 32 px in
8-px patches, dropout 0), recursively over sub-configs (``text_config``, ``vision_config``,
...). ``hf_problem(mapping, model_type, seed)`` builds the mapping's class from it (random
weights, float64, eval mode, offset parameters: ``zoo._finish``) with ``N = 3`` samples.
Nothing is downloaded.
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Dict, Tuple

import torch
from torch import nn

from oracles.zoo import CLASSES, N, Problem, _finish, _lm_output

T, VOCAB, PX = 5, 64, 32
# RMSNorm / layer norm / softmax of many classes compute in float32 inside a float64 model
# (zoo.py's Llama, Qwen2, T5: 1e-6); the report gives each check's error
RTOL = 1e-6

MAPPINGS = {
    "causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "seq_cls": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "image_cls": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "masked_lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
}

# (pattern on the attribute name, value for an int, value for each entry of a list)
_INT_RULES = [
    (r"^num_channels$", 3),
    (r"^(depths|num_layers_per_stage)$", 1),
    (r"(hidden_sizes|embed_dims|^dims$|widths|^channels$|bottleneck_size|^embedding_size$)", 16),
    (r"^window_size$", 2),
    (r"^rotary_dim$", 4),
    (r"^(num_key_value_heads|num_kv_heads|n_kv_heads|multi_query_group_num|num_query_groups)$", 1),
    (r"(^|_)(heads|n_head|num_heads|attention_heads)$|^n_heads?$|_num_heads$", 2),
    (r"head_dim$|^d_head$|_lora_rank$|^kv_channels$|^attention_head_size$", 8),
    (r"(intermediate_size|ffn_dim|^d_ff$|^n_inner$|^d_inner$|^d_kv$|inner_dim|mlp_dim)", 32),
    (r"(^|_)(hidden_size|d_model|n_embd|n_embed|embed_dim|hidden_dim|embedding_size|d_embed|emb_dim"
     r"|model_dim|word_embed_proj_dim|projection_dim|dim|embedding_dim|proj_dim)$", 16),
    (r"(^|_)(num_hidden_layers|n_layers?|num_layers|encoder_layers|decoder_layers|num_encoder_layers"
     r"|num_decoder_layers|depth|num_blocks)$|^num_.*layers$", 1),
    (r"^(num_experts|num_local_experts|n_routed_experts|moe_num_experts|num_routed_experts)$", 4),
    (r"^(num_experts_per_tok|num_experts_per_token|moe_topk|top_k|moe_k|n_group|topk_group)$", 2),
    (r"^(n_shared_experts|num_shared_experts)$", 1),
    (r"vocab_size$", VOCAB),
    (r"^image_size$", PX),
    (r"^patch_size$", 8),
]
_POSITIONS = re.compile(r"^(max_position_embeddings|n_positions|n_ctx|max_seq_len|seq_length)$")
_DROPOUT = re.compile(r"(dropout|_pdrop$|drop_path|layerdrop|_prob$|drop_rate)")
_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0}

# Where the generic rule cannot work (each with its reason)
# (every model type: "*"; else the model_type), each with its reason
OVERRIDES: Dict[str, Dict[str, Any]] = {
    # token type vocabularies are tiny by design (BERT's 2); keep them so
    "*": {"type_vocab_size": 2},
}


def _int_rule(key: str):
    for pattern, small in _INT_RULES:
        if re.search(pattern, key):
            return small
    return None


def _shrink_value(key: str, value: Any, old_layers: int, new_layers: int) -> Any:
    """The small value of one config attribute, or ``value`` unchanged."""
    if key in _TOKENS:
        if isinstance(value, int):
            return _TOKENS[key]
        if isinstance(value, (list, tuple)):
            return [_TOKENS[key]]
        return _TOKENS[key] if key == "pad_token_id" else value
    if key == "use_cache":
        return False
    if isinstance(value, bool) or value is None:
        return value
    if key.endswith("_token_id") and isinstance(value, int) and value >= VOCAB:
        return 3
    if isinstance(value, float) and _DROPOUT.search(key):
        return 0.0
    if isinstance(value, int) and _POSITIONS.match(key):
        return 64
    small = _int_rule(key)
    if small is not None and isinstance(value, int) and not isinstance(value, bool):
        return min(value, small) if key.endswith("vocab_size") else small
    if small is not None and isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value):
        return [small] * len(value)
    if isinstance(value, (list, tuple)) and old_layers > 1 and len(value) == old_layers and "layer" in key:
        return list(value[:new_layers])
    return value


def _layers(d: Dict[str, Any]) -> int:
    for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        if isinstance(d.get(k), int):
            return d[k]
    return 0


def shrink_kwargs(config) -> Dict[str, Any]:
    """Keyword arguments for ``type(config)`` that make it tiny (sub-configs as dicts)."""
    from transformers import PretrainedConfig  # optional dependency: the sweep's tests skip without it

    d = config.to_dict()
    old_layers = _layers(d)
    out = {}
    for key, value in d.items():
        if key in ("transformers_version", "architectures", "_name_or_path", "id2label", "label2id",
                   "model_type", "dtype", "torch_dtype"):
            continue
        sub = getattr(config, key, None)
        if isinstance(sub, PretrainedConfig):
            out[key] = dict(shrink_kwargs(sub), model_type=sub.model_type) if sub.model_type else shrink_kwargs(sub)
            continue
        out[key] = _shrink_value(key, value, old_layers, 1)
    out.update({k: v for k, v in OVERRIDES["*"].items() if k in d})
    out.update(OVERRIDES.get(getattr(config, "model_type", ""), {}))
    return out


def shrink(config_class):
    """A tiny instance of ``config_class`` (see the module docstring), 3 labels, eager attention."""
    kwargs = shrink_kwargs(config_class())
    cfg = config_class(**kwargs)
    cfg.num_labels = CLASSES
    for key, value in (("pad_token_id", 0), ("use_cache", False)):
        if getattr(cfg, key, None) is None or key == "use_cache":
            try:
                setattr(cfg, key, value)
            except Exception:  # noqa: BLE001 - a config that forbids the attribute keeps its own
                pass
    return cfg


def model_class(mapping: str, model_type: str):
    import transformers
    from transformers.models.auto import modeling_auto

    name = getattr(modeling_auto, MAPPINGS[mapping])[model_type]
    name = name[0] if isinstance(name, (list, tuple)) else name
    return getattr(transformers, name)


class TooLarge(Exception):
    """The shrunk model still has more than ``MAX_PARAMS`` parameters."""


MAX_PARAMS = 200_000
MAX_IMAGE_PARAMS = 1_000_000  # convolutional stems and stage widths the generic rule leaves alone


def build_model(mapping: str, model_type: str, max_params: int = MAX_PARAMS) -> nn.Module:
    """The mapping's class for ``model_type`` from its shrunk config, eager attention; raises
    :class:`TooLarge` (counted on the meta device first) past ``max_params``."""
    from transformers import CONFIG_MAPPING

    cls = model_class(mapping, model_type)
    cfg = shrink(CONFIG_MAPPING[model_type])
    try:
        with torch.device("meta"):
            n = sum(p.numel() for p in cls(cfg).parameters())
    except Exception:  # noqa: BLE001 - the real build below says why
        n = 0
    if n > max_params:
        raise TooLarge(f"{n} parameters after shrinking (> {max_params})")
    try:
        return cls._from_config(cfg, attn_implementation="eager")
    except (ValueError, TypeError):
        return cls(cfg)


def _accepts(model: nn.Module, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


def _encoder_decoder(model: nn.Module) -> bool:
    return bool(getattr(model.config, "is_encoder_decoder", False)) and _accepts(model, "decoder_input_ids")


def inputs(mapping: str, model: nn.Module, g) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
    """``(X, y)``: keyword inputs of ``N`` samples and their targets."""
    if mapping == "image_cls":
        key = "pixel_values" if _accepts(model, "pixel_values") else "input_values"
        return {key: torch.randn(N, 3, PX, PX, generator=g, dtype=torch.float64)}, \
            torch.randint(0, CLASSES, (N,), generator=g)
    ids = torch.randint(3, VOCAB, (N, T), generator=g)  # no pad/bos/eos ids: no pooling ambiguity
    if mapping == "seq_cls":
        ids[:, -1] = _TOKENS["eos_token_id"]  # end-of-sequence pooling (BART-like) finds one per sample
    X = {"input_ids": ids}
    if _encoder_decoder(model):
        X["decoder_input_ids"] = torch.randint(3, VOCAB, (N, T), generator=g)
    if mapping == "seq_cls":
        return X, torch.randint(0, CLASSES, (N,), generator=g)
    return X, torch.randint(0, VOCAB, (N, T), generator=g)


class Wrapped(nn.Module):
    """A user's one-line wrapper: one tensor in, the loss's input out."""

    def __init__(self, hf: nn.Module, key: str, lm: bool, extra: Dict[str, torch.Tensor] = None):
        super().__init__()
        self.hf, self.key, self.lm = hf, key, lm
        self.decoder = extra is not None

    def forward(self, x):
        out = self.hf(**{self.key: x, "decoder_input_ids": x}) if self.decoder else self.hf(**{self.key: x})
        return out.logits.transpose(1, 2) if self.lm else out.logits


def hf_problem(mapping: str, model_type: str, variant: str = "direct", seed: int = 0) -> Problem:
    """The sweep's problem for one class: ``variant`` "direct" (dict ``X``, ``output=``) or
    "wrapped" (:class:`Wrapped`, tensor ``X``)."""
    from oracles.on_device import seeded

    torch.manual_seed(seed)
    g = seeded(seed)
    limit = MAX_IMAGE_PARAMS if mapping == "image_cls" else MAX_PARAMS
    model = _finish(build_model(mapping, model_type, limit), seed)
    X, y = inputs(mapping, model, g)
    lm = mapping in ("causal_lm", "masked_lm")
    notes = f"{type(model).__name__} ({model_type})"
    if variant == "wrapped":
        key = next(iter(X))
        dec = {"decoder_input_ids": X["decoder_input_ids"]} if "decoder_input_ids" in X else None
        if dec is not None:
            X["decoder_input_ids"] = X[key]  # the wrapper feeds the same ids to both sides
        return Problem(Wrapped(model, key, lm, dec), X[key], y, nn.CrossEntropyLoss(), None, notes, RTOL)
    return Problem(model, X, y, nn.CrossEntropyLoss(), _lm_output if lm else "logits", notes, RTOL)
