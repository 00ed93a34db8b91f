"""Tiny real-library models for the model zoo (Hugging Face transformers, timm, torchvision).

``build(name, seed=0) -> Problem(model, X, y, lossfn, output, notes, rtol)``: a model built
from a config object / constructor with random weights (nothing is downloaded), in eval
mode and float64, a batch of ``N = 3`` samples (sequences of length 5, images of 16-32 px),
targets, a loss and the ``output=`` selector to pass to ``curvature``.

Every parameter gets a small random offset after construction (and BatchNorm statistics
are randomised), so that no parameter sits at a special point of its initialiser (zero
biases, unit norm weights, timm's zero-initialised last BatchNorm of a residual block,
ConvNeXt's 1e-6 layer scale), which would hide wrong curvature terms.

Import this module only after ``tests/conftest.py`` ran (it installs the torchvision shim).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import torch
from torch import nn

from oracles.on_device import seeded

N, T, VOCAB, CLASSES = 3, 5, 32, 3


class Problem(NamedTuple):
    model: nn.Module
    X: Any                      # a tensor or a dict of keyword inputs (``model(**X)``)
    y: torch.Tensor
    lossfn: nn.Module
    output: Union[None, str, int, Callable]
    notes: str
    rtol: float = 1e-8          # relative to the largest entry of the reference
    # the problem curvlib runs on when it is not this one (the references'): a float32 twin of a
    # model whose own forward runs only in float32 (``oracles.ecosystem.float32_twin``)
    computed: Any = None


def _lm_output(o):
    """``[N, V, T]`` logits for ``nn.CrossEntropyLoss`` with ``[N, T]`` targets."""
    return o.logits.transpose(1, 2)


def _finish(model: nn.Module, seed: int, relative: bool = False) -> nn.Module:
    """``model`` in float64, eval mode, every parameter offset from its initialisation by
    ``0.1 · randn`` (``relative``: times the parameter's own spread, 0.1 for a constant one,
    so that deep unnormalised networks keep their logits in softmax's sensitive range)."""
    g = seeded(seed + 1000)
    model = model.to(torch.float64).eval()
    with torch.no_grad():
        for p in model.parameters():
            spread = p.std().item() if relative and p.numel() > 1 else 1.0
            scale = 0.1 * (spread if spread > 0 else 0.1)
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                m.running_mean.uniform_(-0.5, 0.5, generator=g)
                m.running_var.uniform_(0.5, 2.0, generator=g)
    return model


def _ids(g, t=T):
    return torch.randint(0, VOCAB, (N, t), generator=g)


def _images(g, px):
    return torch.randn(N, 3, px, px, generator=g, dtype=torch.float64)


def _labels(g, c=CLASSES):
    return torch.randint(0, c, (N,), generator=g)


# ----------------------------------------------------------------------------------------
# transformers


def _float64_norm(cls):
    """A subclass of an HF RMSNorm class whose forward stays in the input's dtype."""

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    return type(cls.__name__ + "Float64", (cls,), {"forward": forward})


def _hf(name: str, g):
    import transformers

    transformers.logging.set_verbosity_error()
    causal = dict(vocab_size=VOCAB, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                  tie_word_embeddings=False)
    if name.endswith(("_cls_right", "_cls_left")):
        return _decoder_classifier(name, g, causal)
    if name.startswith("gpt2"):
        impl = name.split("_")[1]
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=8, n_layer=1, n_head=2,
                                      n_inner=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      attn_implementation=impl)
        model = transformers.GPT2LMHeadModel(cfg)
        return model, _ids(g), _ids(g), nn.CrossEntropyLoss(), _lm_output, \
            f"GPT-2 (Conv1D, tied lm_head), attn={impl}; causal LM loss over all positions", 1e-8
    if name in ("llama_eager", "llama_sdpa"):
        impl = name.split("_")[1]
        cfg = transformers.LlamaConfig(**causal, attn_implementation=impl)
        model = transformers.LlamaForCausalLM(cfg)
        # LlamaRMSNorm (and eager attention's softmax) compute in float32 inside a float64
        # model: 1e-6, not 1e-8.
        return model, _ids(g), _ids(g), nn.CrossEntropyLoss(), _lm_output, \
            f"Llama (RMSNorm, RoPE, GQA 2q/1kv, SwiGLU), attn={impl}; RMSNorm casts to float32", 1e-6
    if name == "llama_f64norm":
        # diagnostic twin of llama_sdpa: RMSNorm computed in float64 (the float32 cast
        # removed) and SDPA attention (eager attention's softmax runs in float32), so the
        # whole model is float64 and compared at 1e-8
        cfg = transformers.LlamaConfig(**causal, attn_implementation="sdpa")
        model = transformers.LlamaForCausalLM(cfg)
        for m in model.modules():
            if type(m).__name__.endswith("RMSNorm"):
                m.__class__ = _float64_norm(type(m))
        return model, _ids(g), _ids(g), nn.CrossEntropyLoss(), _lm_output, \
            "llama_sdpa with RMSNorm in float64 (no float32 cast): separates float32 noise from errors", 1e-8
    if name == "qwen2":
        cfg = transformers.Qwen2Config(**causal, attn_implementation="eager")
        model = transformers.Qwen2ForCausalLM(cfg)
        # Qwen2RMSNorm computes in float32 inside a float64 model: 1e-6.
        return model, _ids(g), _ids(g), nn.CrossEntropyLoss(), _lm_output, \
            "Qwen2 (q/k/v biases, RMSNorm, RoPE, GQA); RMSNorm casts to float32", 1e-6
    if name == "bart_cls":
        return _bart_classifier(g)
    if name == "bert":
        cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=16, max_position_embeddings=16, type_vocab_size=2,
                                      num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                      attn_implementation="eager")
        model = transformers.BertForSequenceClassification(cfg)
        mask = torch.ones(N, T, dtype=torch.long)
        mask[1, -2:] = 0  # sample 1 is padded
        X = {"input_ids": _ids(g), "attention_mask": mask}
        return model, X, _labels(g), nn.CrossEntropyLoss(), None, \
            "BERT classifier, dict X (input_ids, attention_mask with padding), pooler tanh", 1e-8
    if name == "distilbert":
        cfg = transformers.DistilBertConfig(vocab_size=VOCAB, dim=8, n_layers=1, n_heads=2, hidden_dim=16,
                                            max_position_embeddings=16, num_labels=CLASSES, dropout=0.0,
                                            attention_dropout=0.0, seq_classif_dropout=0.0)
        model = transformers.DistilBertForSequenceClassification(cfg)
        mask = torch.ones(N, T, dtype=torch.long)
        mask[2, -1:] = 0
        X = {"input_ids": _ids(g), "attention_mask": mask}
        return model, X, _labels(g), nn.CrossEntropyLoss(), None, \
            "DistilBERT classifier, dict X with a padding mask", 1e-8
    if name == "vit_hf":
        cfg = transformers.ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=8, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=16, num_labels=CLASSES,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = transformers.ViTForImageClassification(cfg)
        return model, _images(g, 16), _labels(g), nn.CrossEntropyLoss(), None, \
            "HF ViT classifier (patch conv, CLS token, learned positions), 16 px", 1e-8
    if name == "t5_encoder":
        cfg = transformers.T5Config(vocab_size=VOCAB, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2,
                                    dropout_rate=0.0, relative_attention_num_buckets=8,
                                    relative_attention_max_distance=16)
        model = transformers.T5EncoderModel(cfg)
        y = torch.randn(N, T, 8, generator=g, dtype=torch.float64)
        # T5LayerNorm computes its variance in float32 inside a float64 model: 1e-6.
        return model, _ids(g), y, nn.MSELoss(), "last_hidden_state", \
            "T5 encoder (T5LayerNorm = RMSNorm, variance in float32; relative position bias), MSE on last_hidden_state", 1e-6
    raise KeyError(name)


def _decoder_classifier(name: str, g, causal: dict):
    """A decoder's ``*ForSequenceClassification``: pooled at each sample's last non-pad token
    (``logits[arange(N), last]``), padded on the right or the left (``attention_mask``)."""
    import transformers

    pad, left = 0, name.endswith("_left")
    if name.startswith("gpt2"):
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=8, n_layer=1, n_head=2, n_inner=16,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, num_labels=CLASSES,
                                      pad_token_id=pad, attn_implementation="eager")
        model = transformers.GPT2ForSequenceClassification(cfg)
    else:
        cfg = transformers.LlamaConfig(**causal, num_labels=CLASSES, pad_token_id=pad, attn_implementation="sdpa")
        model = transformers.LlamaForSequenceClassification(cfg)
        for m in model.modules():  # float64 throughout (the float32 cast removed): compared at 1e-8
            if type(m).__name__.endswith("RMSNorm"):
                m.__class__ = _float64_norm(type(m))
    ids = torch.randint(1, VOCAB, (N, T), generator=g)
    mask = torch.ones(N, T, dtype=torch.long)
    for i, k in ((1, 2), (2, 1)):  # samples 1 and 2 padded by 2 and 1 tokens
        where = slice(0, k) if left else slice(T - k, T)
        ids[i, where], mask[i, where] = pad, 0
    X = {"input_ids": ids, "attention_mask": mask}
    side = "left" if left else "right"
    return model, X, _labels(g), nn.CrossEntropyLoss(), None, \
        f"{type(model).__name__}: last non-pad token pooling, padding on the {side}", 1e-8


def _bart_classifier(g):
    """BART's sequence classifier: pooled at each sample's end-of-sequence token through a boolean
    mask (``hidden[eos_mask].view(N, -1, H)[:, -1]``), one eos per sample, sample 1 padded after it."""
    import transformers

    cfg = transformers.BartConfig(vocab_size=VOCAB, d_model=8, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16,
                                  decoder_ffn_dim=16, max_position_embeddings=16, num_labels=CLASSES, pad_token_id=1,
                                  eos_token_id=2, bos_token_id=0, dropout=0.0, attention_dropout=0.0,
                                  activation_dropout=0.0, classifier_dropout=0.0)
    model = transformers.BartForSequenceClassification(cfg)
    ids = torch.randint(3, VOCAB, (N, T), generator=g)
    mask = torch.ones(N, T, dtype=torch.long)
    ids[:, -1] = 2
    ids[1, -3], ids[1, -2:], mask[1, -2:] = 2, 1, 0
    X = {"input_ids": ids, "attention_mask": mask}
    return model, X, _labels(g), nn.CrossEntropyLoss(), None, \
        "BART classifier: end-of-sequence pooling through a boolean mask, one eos per sample", 1e-8


# ----------------------------------------------------------------------------------------
# timm


def _timm(name: str, g):
    import timm

    if name == "timm_vit_tiny":
        model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=CLASSES, img_size=32,
                                  patch_size=8, embed_dim=8, depth=1, num_heads=2, mlp_ratio=2.0)
        return model, _images(g, 32), "vit_tiny_patch16_224: img 32, patch 8, dim 8, depth 1"
    if name == "timm_convnext_atto":
        model = timm.create_model("convnext_atto", pretrained=False, num_classes=CLASSES, depths=(1, 1, 1, 1),
                                  dims=(4, 8, 8, 8))
        return model, _images(g, 32), "convnext_atto: depths 1,1,1,1, dims 4,8,8,8 (LayerNorm2d, layer scale)"
    if name == "timm_resnet10t":
        model = timm.create_model("resnet10t", pretrained=False, num_classes=CLASSES, channels=(4, 8, 8, 8),
                                  stem_width=4)
        return model, _images(g, 32), "resnet10t: deep tiered stem width 4, channels 4,8,8,8, avg-pool downsample"
    if name == "timm_efficientnet":
        from timm.models._efficientnet_builder import decode_arch_def
        from timm.models.efficientnet import EfficientNet

        arch = decode_arch_def([["ds_r1_k3_s1_e1_c8"], ["ir_r1_k3_s2_e2_c8_se0.25"], ["ir_r1_k5_s2_e2_c8_se0.25"]])
        model = EfficientNet(arch, num_classes=CLASSES, num_features=16, stem_size=8)
        return model, _images(g, 16), "timm EfficientNet class, 3 tiny stages (DS, IR+SE, k5), 16 px (efficientnet_b0's blocks)"
    if name == "timm_nfnet":
        from timm.models.nfnet import NfCfg, NormFreeNet

        cfg = NfCfg(depths=(1, 1, 1, 1), channels=(8, 8, 8, 8), stem_chs=8, group_size=8, bottle_ratio=0.5,
                    num_features=16, attn_layer="se", attn_kwargs=dict(rd_ratio=0.5), extra_conv=True, act_layer="gelu")
        model = NormFreeNet(cfg, num_classes=CLASSES)
        return model, _images(g, 32), "NormFreeNet (dm_nfnet_f0-like: ScaledStdConv2d, SE, skipinit gain), channels 8"
    if name == "timm_swin":
        from timm.models.swin_transformer import SwinTransformer

        # swin_tiny_patch4_window7_224's class, shrunk: windows of 4x4 tokens merged into the batch
        # ([N·W, 16, C]) before qkv, a relative-position bias, shifted windows with a mask
        model = SwinTransformer(img_size=16, patch_size=2, window_size=4, embed_dim=8, depths=(2, 1),
                                num_heads=(2, 2), num_classes=CLASSES)
        return model, _images(g, 16), "timm SwinTransformer (swin_tiny's class): img 16, patch 2, window 4, dim 8, depths 2,1"
    if name == "timm_mixer":
        from timm.models.mlp_mixer import MlpMixer

        # mixer_s16_224 fixes patch_size, num_blocks and embed_dim: its class, shrunk
        model = MlpMixer(num_classes=CLASSES, img_size=32, patch_size=8, num_blocks=1, embed_dim=8)
        return model, _images(g, 32), "timm MlpMixer (mixer_s16_224's class): img 32, patch 8, 1 block, dim 8"
    raise KeyError(name)


# ----------------------------------------------------------------------------------------
# torchvision


def _tv_resnet18():
    """torchvision's ResNet class and BasicBlock with resnet18's layout [2, 2, 2, 2] at widths
    4, 4, 8, 8 (the constructor hard-codes 64..512, so ``ResNet.__init__`` is redone here)."""
    from torchvision.models.resnet import BasicBlock, ResNet

    m = ResNet.__new__(ResNet)
    nn.Module.__init__(m)
    m._norm_layer, m.inplanes, m.dilation, m.groups, m.base_width = nn.BatchNorm2d, 4, 1, 1, 64
    m.conv1 = nn.Conv2d(3, 4, kernel_size=7, stride=2, padding=3, bias=False)
    m.bn1, m.relu = nn.BatchNorm2d(4), nn.ReLU(inplace=True)
    m.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
    m.layer1 = m._make_layer(BasicBlock, 4, 2)
    m.layer2 = m._make_layer(BasicBlock, 4, 2, stride=2)
    m.layer3 = m._make_layer(BasicBlock, 8, 2, stride=2)
    m.layer4 = m._make_layer(BasicBlock, 8, 2, stride=2)
    m.avgpool = nn.AdaptiveAvgPool2d((1, 1))
    m.fc = nn.Linear(8, CLASSES)
    return m


def _tv(name: str, g):
    import torchvision.models as tv

    if name == "tv_resnet18":
        return _tv_resnet18(), _images(g, 32), "torchvision ResNet/BasicBlock, resnet18 layout, widths 4,4,8,8"
    if name == "tv_mobilenet_v3_small":
        from torchvision.models.mobilenetv3 import InvertedResidualConfig as C

        setting = [C(8, 3, 8, 8, True, "RE", 2, 1, 1.0), C(8, 3, 16, 8, False, "HS", 2, 1, 1.0),
                   C(8, 5, 16, 8, True, "HS", 1, 1, 1.0)]
        model = tv.MobileNetV3(setting, last_channel=16, num_classes=CLASSES, dropout=0.0)
        return model, _images(g, 32), "torchvision MobileNetV3, 3 small blocks (SE, hardswish, hardsigmoid)"
    if name == "tv_efficientnet_b0":
        from torchvision.models.efficientnet import MBConvConfig as C

        setting = [C(1, 3, 1, 8, 8, 1), C(2, 3, 2, 8, 8, 1), C(2, 5, 2, 8, 16, 1)]
        model = tv.EfficientNet(setting, dropout=0.0, stochastic_depth_prob=0.0, num_classes=CLASSES, last_channel=16)
        return model, _images(g, 16), "torchvision EfficientNet, 3 MBConv stages (SE, SiLU), 16 px"
    if name == "tv_convnext_tiny":
        from torchvision.models.convnext import CNBlockConfig as C

        model = tv.ConvNeXt([C(4, 8, 1), C(8, None, 1)], stochastic_depth_prob=0.0, layer_scale=0.5,
                            num_classes=CLASSES)
        return model, _images(g, 16), "torchvision ConvNeXt, block_setting 4->8, 1 block each, 16 px"
    if name == "tv_vit":
        model = tv.VisionTransformer(image_size=32, patch_size=8, num_layers=1, num_heads=2, hidden_dim=8,
                                     mlp_dim=16, num_classes=CLASSES)
        return model, _images(g, 32), "torchvision VisionTransformer (nn.MultiheadAttention), 32 px, patch 8"
    if name == "tv_swin_t":
        model = tv.SwinTransformer(patch_size=[4, 4], embed_dim=8, depths=[1, 1], num_heads=[1, 2],
                                   window_size=[2, 2], mlp_ratio=2.0, stochastic_depth_prob=0.0,
                                   num_classes=CLASSES)
        return model, _images(g, 16), "torchvision SwinTransformer (shifted windows, rel. pos. bias), depths 1,1, 16 px"
    raise KeyError(name)


HF = ["gpt2_eager", "gpt2_sdpa", "llama_eager", "llama_sdpa", "llama_f64norm", "qwen2", "bert", "distilbert", "vit_hf", "t5_encoder",
      "gpt2_cls_right", "gpt2_cls_left", "llama_cls_right", "llama_cls_left", "bart_cls"]
TIMM = ["timm_vit_tiny", "timm_convnext_atto", "timm_resnet10t", "timm_efficientnet", "timm_nfnet", "timm_mixer", "timm_swin"]
TV = ["tv_resnet18", "tv_mobilenet_v3_small", "tv_efficientnet_b0", "tv_convnext_tiny", "tv_vit", "tv_swin_t"]
NAMES = HF + TIMM + TV


def build(name: str, seed: int = 0) -> Problem:
    """The problem ``name`` (one of :data:`NAMES`), weights and data drawn from ``seed``."""
    torch.manual_seed(seed)
    g = seeded(seed)
    if name in HF:
        model, X, y, lossfn, output, notes, rtol = _hf(name, g)
    elif name in TIMM or name in TV:
        model, X, notes = (_timm if name in TIMM else _tv)(name, g)
        y, lossfn, output, rtol = _labels(g), nn.CrossEntropyLoss(), None, 1e-8
    else:
        raise KeyError(f"unknown zoo model {name!r}; one of {NAMES}")
    return Problem(_finish(model, seed), X, y, lossfn, output, notes, rtol)


def select(out, output=None):
    """The tensor ``curvature(..., output=output)`` passes to the loss (README's rule)."""
    if callable(output):
        return output(out)
    if isinstance(output, str):
        return out[output]
    if isinstance(output, int):
        return tuple(v for v in out.values())[output] if isinstance(out, dict) else out[output]
    if torch.is_tensor(out):
        return out
    if isinstance(out, dict):  # ModelOutput is an OrderedDict
        if "logits" in out:
            return out["logits"]
        return next(v for v in out.values() if torch.is_tensor(v))
    return next(v for v in out if torch.is_tensor(v))


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class OneLine(nn.Module):
    """The one-line wrapper users write around a library model: ``forward(ids)`` calls it with
    keywords and returns the loss's tensor (``self.hf(input_ids=ids).logits``); with several
    keyword inputs it takes the dict as one argument; a tensor model's output comes back in a
    dict (another container than the library's)."""

    def __init__(self, model: nn.Module, output, key: Optional[str]):
        super().__init__()
        self.hf, self.output, self.key = model, output, key

    def forward(self, inputs):
        if self.key is not None:
            return select(self.hf(**{self.key: inputs}), self.output)
        if isinstance(inputs, dict):
            return select(self.hf(**inputs), self.output)
        return {"scores": select(self.hf(inputs), self.output)}


def wrapped(prob: Problem) -> Problem:
    """``prob`` with its model behind :class:`OneLine` (the same model object: parameters
    are named ``hf.<name>``) and ``output="scores"`` or the default."""
    key = next(iter(prob.X)) if isinstance(prob.X, dict) and len(prob.X) == 1 else None
    X = prob.X[key] if key is not None else prob.X
    output = "scores" if not isinstance(prob.X, dict) else None
    return prob._replace(model=OneLine(prob.model, prob.output, key), X=X, output=output)
