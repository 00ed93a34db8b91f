"""Named benchmark problems and timed methods, as two registries.

A *problem* is a function ``build(device="cpu", dtype=torch.float32, seed=0)``
returning a :class:`Problem` ``(model, lossfn, X, y)`` with seeded random
data of a realistic shape (nothing is downloaded). A *method* is a function
``setup(problem) -> run`` returning a zero-argument callable that does the
timed work once; ``setup`` may prepare anything that should not be timed
(build the transform, copy the model, pre-allocate a buffer).

To add a problem, write a ``build`` function and add it to :data:`PROBLEMS`.
Each method also has an entry in :data:`INFO` (library, quantity, checks) used by
``run.py`` to group peers with curvlib's extension and to check their values.
To add a method (a peer library such as BackPACK or Opacus, a second-order
curvlib extension), write a ``setup`` function and add it to :data:`METHODS`;
list it in :data:`DEFAULT_METHODS` to run it by default. ``"backward"`` is
the reference every ratio is taken against.

| problem | model | N | input | loss |
|---|---|---|---|---|
| ``mlp`` | MNIST-sized MLP 784-128-128-10, ReLU | 128 | ``[N, 784]`` | ``CrossEntropyLoss()`` |
| ``3c3d`` | DeepOBS ``cifar10_3c3d`` (3 conv + 3 dense) | 64 | ``[N, 3, 32, 32]`` | ``CrossEntropyLoss()`` |
| ``allcnnc`` | DeepOBS ``cifar100_allcnnc`` at 1/3 width (9 conv, C=100) | 32 | ``[N, 3, 32, 32]`` | ``CrossEntropyLoss()`` |
| ``resnet`` | ResNet-8 (3 basic blocks 16-32-64, BatchNorm eval) | 32 | ``[N, 3, 32, 32]`` | ``CrossEntropyLoss()`` |
| ``transformer`` | one pre-LN encoder block, d 64, 4 heads, vocab 1000 | 32 | ``[N, 32]`` tokens | ``CrossEntropyLoss()`` |
| ``gpt`` | GPT from ``nn.TransformerEncoderLayer``: vocab 256, learned positions, 4 pre-LN blocks d 128, 4 heads, causal, T 64 | 32 | ``[N, 64]`` tokens | ``CrossEntropyLoss()``, every position |
| ``gpt-v16`` | the same with vocab 16 (C = 16·64 = 1024 output columns, for the exact quantities) | 32 | ``[N, 64]`` tokens | ``CrossEntropyLoss()``, every position |
| ``lstm`` | ``nn.LSTM`` 32 -> 128, 2 layers, last step -> Linear 10; T 50 | 64 | ``[N, 50, 32]`` | ``CrossEntropyLoss()`` |
| ``gpt2-small`` | ``gpt`` at GPT-2-small size: vocab 50257, T 128, 12 pre-LN blocks d 768, 12 heads, MLP 3072, untied head; 163 M parameters | 4 | ``[N, 128]`` tokens | ``CrossEntropyLoss()``, every position |
| ``gpt-sweep-d{D}-l{L}`` | ``gpt2-small`` with d D (128, 256, 512, 768), L blocks (2, 4, 8, 12), D/64 heads, MLP 4D; ``gpt-sweep-d768-l12`` is ``gpt2-small`` | 4 | ``[N, 128]`` tokens | ``CrossEntropyLoss()``, every position |
| ``gpt2-hf`` | Hugging Face ``GPT2LMHeadModel`` (random weights): 2 layers, n_embd 128, 4 heads, vocab 256, T 64, eval; logits transposed to ``[N, V, T]`` | 32 | ``[N, 64]`` tokens | ``CrossEntropyLoss()``, every position |
| ``gpt2-hf-v16`` | the same with vocab 16 (C = 1024, for the exact quantities) | 32 | ``[N, 64]`` tokens | ``CrossEntropyLoss()``, every position |
| ``vit-timm`` | timm ``vit_tiny_patch16_224`` (random weights) at img_size 32, patch_size 4, depth 2, 10 classes, eval | 32 | ``[N, 3, 32, 32]`` | ``CrossEntropyLoss()`` |
| ``vit-timm-fwd`` | the same inside a module whose ``forward(x)`` has one argument (timm's has ``attn_mask=None, is_causal=False`` too) | 32 | ``[N, 3, 32, 32]`` | ``CrossEntropyLoss()`` |

On request (:data:`GPU_PROBLEMS`, not in the CPU default): ``mlp-1024``, ``3c3d-256``,
``resnet-128`` (the same models with N = 1024, 256, 128) and ``allcnnc-96``
(All-CNN-C at DeepOBS's full width 96/192, N = 128): the GPU sizes.

On request too (:data:`LLM_PROBLEMS`): ``gpt2-small`` and the model-size sweep
``gpt-sweep-d{128,256,512,768}-l{2,4,8,12}`` (:data:`SWEEP_DIAGONAL`: the four sizes along
the diagonal; ``benchmarks/llm_memory.py`` measures them, one method per fresh process). The sequence models and their Opacus copies are in ``sequence_models.py``.
``gpt2-hf``, ``gpt2-hf-v16`` and ``vit-timm`` need the optional packages ``transformers`` and
``timm`` (imported inside their builders; models from configs, nothing downloaded). They
run through curvlib's ATen front end (``make_fx``), not torch.fx. They are on request,
not in the CPU default.
"""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Callable, NamedTuple

import torch
from torch import Tensor, nn

from curvlib import curvature, extensions
from sequence_models import GPT, LSTMClassifier, opacus_copy, opacus_to_original


class Problem(NamedTuple):
    """A model, its loss and one batch. Unpacks as ``(model, lossfn, X, y)``."""

    model: nn.Module
    lossfn: nn.Module
    X: Tensor
    y: Tensor


# --------------------------------------------------------------------------- problems


def mlp(device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0, classes: int = 10,
        n: int = 128) -> Problem:
    """MNIST-sized MLP 784-128-128-``classes`` (default 10) with ReLU; N=``n`` (128),
    ``CrossEntropyLoss(mean)``. ``classes`` is swept by ``run.py --sweep-classes``."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    d = 784
    model = nn.Sequential(
        nn.Linear(d, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, classes)
    )
    X = torch.rand(n, d, generator=gen, device=gen.device)
    y = torch.randint(0, classes, (n,), generator=gen, device=gen.device)
    return _place(Problem(model, nn.CrossEntropyLoss(), X, y), device, dtype)


def cifar10_3c3d(device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0, n: int = 64) -> Problem:
    """DeepOBS's ``cifar10_3c3d`` net; N=``n`` (64), input ``[N, 3, 32, 32]``, ``CrossEntropyLoss(mean)``.

    DeepOBS (Schneider et al., 2019): conv 64@5x5 "valid", ReLU, max-pool 3x3
    stride 2 "same"; conv 96@3x3 "valid", ReLU, max-pool; conv 128@3x3 "same",
    ReLU, max-pool; dense 512, ReLU; dense 256, ReLU; dense 10. Spatial sizes
    32 -> 28 -> 14 -> 12 -> 6 -> 6 -> 3, so the first dense layer has
    3*3*128 = 1152 inputs (computed below by a dry forward). TensorFlow's
    "same" max-pool pads only at the bottom/right; ``MaxPool2d(3, 2, padding=1)``
    pads both sides and gives the same shapes and cost.
    """
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    classes = 10
    features = nn.Sequential(
        nn.Conv2d(3, 64, 5),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Conv2d(64, 96, 3),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Conv2d(96, 128, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Flatten(),
    )
    with torch.no_grad():
        flat = features(torch.zeros(1, 3, 32, 32)).shape[1]
    model = nn.Sequential(
        *features,
        nn.Linear(flat, 512),
        nn.ReLU(),
        nn.Linear(512, 256),
        nn.ReLU(),
        nn.Linear(256, classes),
    )
    X = torch.rand(n, 3, 32, 32, generator=gen, device=gen.device)
    y = torch.randint(0, classes, (n,), generator=gen, device=gen.device)
    return _place(Problem(model, nn.CrossEntropyLoss(), X, y), device, dtype)


def allcnnc(device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0, width: int = 32,
            n: int = 32) -> Problem:
    """DeepOBS's ``cifar100_allcnnc`` (Springenberg et al., 2015) at reduced width; N=``n`` (32),
    input ``[N, 3, 32, 32]``, C=100, ``CrossEntropyLoss(mean)``.

    The original has widths 96 and 192; here ``width`` and ``2 * width`` (default 32
    and 64, a third), so that the exact second-order quantities (about C = 100
    backward passes each) fit a CPU benchmark. Layers as in DeepOBS, without its
    dropout (the timed quantities must be deterministic): conv w@3x3 same, conv
    w@3x3 same, conv w@3x3 stride 2 same, conv 2w@3x3 same, conv 2w@3x3 same, conv
    2w@3x3 stride 2 same, conv 2w@3x3 valid, conv 2w@1x1, conv 100@1x1, each
    followed by ReLU; global average pooling. Spatial 32 -> 16 -> 8 -> 6.
    """
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    classes, w1, w2 = 100, width, 2 * width

    def conv(c_in: int, c_out: int, k: int, stride: int = 1, pad: int = 0):
        return [nn.Conv2d(c_in, c_out, k, stride, pad), nn.ReLU()]

    model = nn.Sequential(
        *conv(3, w1, 3, 1, 1), *conv(w1, w1, 3, 1, 1), *conv(w1, w1, 3, 2, 1),
        *conv(w1, w2, 3, 1, 1), *conv(w2, w2, 3, 1, 1), *conv(w2, w2, 3, 2, 1),
        *conv(w2, w2, 3), *conv(w2, w2, 1), *conv(w2, classes, 1),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    )
    X = torch.rand(n, 3, 32, 32, generator=gen, device=gen.device)
    y = torch.randint(0, classes, (n,), generator=gen, device=gen.device)
    return _place(Problem(model, nn.CrossEntropyLoss(), X, y), device, dtype)


class _BasicBlock(nn.Module):
    """ResNet basic block: ``relu(bn(conv(relu(bn(conv(x))))) + shortcut(x))``."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
            if stride != 1 or c_in != c_out
            else nn.Identity()
        )

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class _ResNet8(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.blocks = nn.Sequential(_BasicBlock(16, 16, 1), _BasicBlock(16, 32, 2), _BasicBlock(32, 64, 2))
        self.head = nn.Linear(64, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.blocks(self.stem(x))
        return self.head(h.mean(dim=(2, 3)))


def resnet(device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0, n: int = 32) -> Problem:
    """ResNet-8 on CIFAR-10 shapes: stem conv 16, basic blocks 16 -> 32 -> 64 (identity
    and 1x1-projection shortcuts), BatchNorm in eval mode (random running statistics),
    global average pooling, Linear 64 -> 10; N=``n`` (32), ``CrossEntropyLoss(mean)``."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    classes = 10
    model = _ResNet8(classes)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(0.1 * torch.randn(m.num_features, generator=gen, device=gen.device))
                m.running_var.copy_(0.5 + torch.rand(m.num_features, generator=gen, device=gen.device))
    model.eval()
    X = torch.rand(n, 3, 32, 32, generator=gen, device=gen.device)
    y = torch.randint(0, classes, (n,), generator=gen, device=gen.device)
    return _place(Problem(model, nn.CrossEntropyLoss(), X, y), device, dtype)


class _EncoderBlock(nn.Module):
    """Token + learned positional embedding, one pre-LayerNorm encoder block
    (multi-head self-attention from ``nn.Linear`` projections, GELU MLP,
    residuals), mean pooling over the sequence, Linear classifier."""

    def __init__(self, vocab: int, length: int, d: int, heads: int, hidden: int, classes: int):
        super().__init__()
        self.heads, self.d_head = heads, d // heads
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(length, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
        self.head = nn.Linear(d, classes)

    def attention(self, x: Tensor) -> Tensor:
        def split(t: Tensor) -> Tensor:
            return t.unflatten(-1, (self.heads, self.d_head)).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        att = torch.softmax(q @ k.transpose(-2, -1) / self.d_head**0.5, dim=-1) @ v
        return self.o(att.transpose(1, 2).flatten(2))

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens) + self.pos.weight
        h = h + self.attention(self.ln1(h))
        h = h + self.mlp(self.ln2(h))
        return self.head(h.mean(dim=1))


def transformer(device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> Problem:
    """One encoder block for sequence classification: vocab 1000, sequence length 32,
    d_model 64, 4 heads, MLP 256, 10 classes; N=32 token sequences ``[N, 32]``,
    ``CrossEntropyLoss(mean)``."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    n, vocab, length, classes = 32, 1000, 32, 10
    model = _EncoderBlock(vocab, length, d=64, heads=4, hidden=256, classes=classes)
    X = torch.randint(0, vocab, (n, length), generator=gen, device=gen.device)
    y = torch.randint(0, classes, (n,), generator=gen, device=gen.device)
    return Problem(model.to(device=device, dtype=dtype), nn.CrossEntropyLoss(), X.to(device), y.to(device))


def gpt(device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0, vocab: int = 256,
        n: int = 32, length: int = 64, **size) -> Problem:
    """GPT-style language model (``sequence_models.GPT``): token embedding (``vocab``, default
    256) + learned positions ``nn.Parameter [64, 128]``, 4 pre-LN ``nn.TransformerEncoderLayer``
    (d 128, 4 heads, MLP 512, GELU, dropout 0) with the causal mask, final LayerNorm, Linear
    head; eval mode. N=32 sequences of T=64 tokens; the loss is ``CrossEntropyLoss(mean)`` of
    the next-token logits ``[N, V, T]`` at every position against targets ``[N, T]``. ``size``:
    ``GPT``'s ``d``, ``heads``, ``hidden``, ``layers`` (:func:`gpt2_small`)."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = GPT(vocab=vocab, length=length, **size).eval()
    X = torch.randint(0, vocab, (n, length), generator=gen, device=gen.device)
    y = torch.randint(0, vocab, (n, length), generator=gen, device=gen.device)
    return Problem(model.to(device=device, dtype=dtype), nn.CrossEntropyLoss(), X.to(device), y.to(device))


def gpt2_small(device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> Problem:
    """:func:`gpt` at GPT-2-small size: vocab 50257, 12 pre-LN blocks of d 768 with
    12 heads and MLP 3072, learned positions ``[128, 768]``, untied head ``Linear(768, 50257)``
    (163 M parameters, 650 MB in float32); N=4 sequences of T=128 tokens, ``CrossEntropyLoss``
    over every position (logits ``[4, 50257, 128]``, 103 MB)."""
    return gpt(device, dtype, seed, vocab=50257, n=4, length=128, d=768, heads=12, hidden=3072, layers=12)


def gpt_sweep(device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0, d: int = 768,
              layers: int = 12) -> Problem:
    """The model-size sweep: :func:`gpt2_small` with width ``d`` and ``layers`` pre-LN
    blocks, ``d // 64`` heads (GPT-2's head width 64) and MLP ``4 d``; vocab 50257, N=4, T=128.
    ``gpt_sweep(d=768, layers=12)`` is :func:`gpt2_small`."""
    return gpt(device, dtype, seed, vocab=50257, n=4, length=128, d=d, heads=d // 64, hidden=4 * d,
               layers=layers)


def gpt_v16(device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> Problem:
    """:func:`gpt` with a 16-token vocabulary: C = V·T = 1024 output columns per sample instead
    of 16384, so the exact GGN family (which backpropagates all of them) can be measured."""
    return gpt(device, dtype, seed, vocab=16)


def lstm(device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> Problem:
    """Sequence classifier (``sequence_models.LSTMClassifier``): ``nn.LSTM`` 32 -> 128, 2 layers,
    ``batch_first``, last time step -> Linear 128 -> 10; N=64 sequences ``[N, 50, 32]``,
    ``CrossEntropyLoss(mean)``."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    n, length, features, classes = 64, 50, 32, 10
    model = LSTMClassifier(features=features, hidden=128, layers=2, classes=classes)
    X = torch.randn(n, length, features, generator=gen, device=gen.device)
    y = torch.randint(0, classes, (n,), generator=gen, device=gen.device)
    return _place(Problem(model, nn.CrossEntropyLoss(), X, y), device, dtype)


def _zoo_imports() -> None:
    """Before transformers/timm import torchvision: the tests' shim for a CUDA-built
    torchvision wheel on CPU torch (``tests/torchvision_shim.py``; a no-op elsewhere)."""
    import os
    import sys

    tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import torchvision_shim

    torchvision_shim.install()


class HFLogits(nn.Module):
    """``model(input_ids=ids).logits.transpose(1, 2)``: a Hugging Face causal LM's logits
    ``[N, T, V]`` as ``[N, V, T]``, the layout ``CrossEntropyLoss`` takes with targets ``[N, T]``
    (every method in ``run.py`` calls ``model(X)`` and needs a tensor)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids).logits.transpose(1, 2)


def gpt2_hf(device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0, vocab: int = 256) -> Problem:
    """Hugging Face ``transformers.GPT2LMHeadModel`` from a ``GPT2Config`` with random weights
    (nothing downloaded): 2 layers, n_embd 128, 4 heads, vocab ``vocab`` (256), n_positions 64,
    dropout 0, eval mode, wrapped in :class:`HFLogits`. N=32 sequences of T=64 tokens;
    ``CrossEntropyLoss(mean)`` over every position (logits ``[N, V, T]``, targets ``[N, T]``)."""
    _zoo_imports()
    from transformers import GPT2Config, GPT2LMHeadModel

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    n, length = 32, 64
    config = GPT2Config(vocab_size=vocab, n_positions=length, n_embd=128, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = HFLogits(GPT2LMHeadModel(config)).eval()
    X = torch.randint(0, vocab, (n, length), generator=gen, device=gen.device)
    y = torch.randint(0, vocab, (n, length), generator=gen, device=gen.device)
    return Problem(model.to(device=device, dtype=dtype), nn.CrossEntropyLoss(), X.to(device), y.to(device))


def gpt2_hf_v16(device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> Problem:
    """:func:`gpt2_hf` with a 16-token vocabulary: C = V·T = 1024 output columns per sample."""
    return gpt2_hf(device, dtype, seed, vocab=16)


class Forward1(nn.Module):
    """``model(x)``: a forward with one argument around a model whose ``forward`` has more
    (timm's ``forward(x, attn_mask=None, is_causal=False)``), so that tracing sees only ``x``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)


def vit_timm(device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0, wrap: bool = False) -> Problem:
    """timm ``vit_tiny_patch16_224`` built with random weights (``pretrained=False``) at
    img_size 32, patch_size 4 (8x8 = 64 patches + class token), depth 2, 10 classes
    (d 192, 3 heads, MLP 768), eval mode. N=32 images ``[N, 3, 32, 32]``,
    ``CrossEntropyLoss(mean)``. ``wrap``: in :class:`Forward1` (``vit-timm-fwd``)."""
    _zoo_imports()
    import timm

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    n, classes = 32, 10
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4, depth=2,
                              num_classes=classes).eval()
    if wrap:
        model = Forward1(model).eval()
    X = torch.rand(n, 3, 32, 32, generator=gen, device=gen.device)
    y = torch.randint(0, classes, (n,), generator=gen, device=gen.device)
    return _place(Problem(model, nn.CrossEntropyLoss(), X, y), device, dtype)


def _place(problem: Problem, device: str, dtype: torch.dtype) -> Problem:
    model, lossfn, X, y = problem
    return Problem(model.to(device=device, dtype=dtype), lossfn, X.to(device=device, dtype=dtype), y.to(device))


PROBLEMS: dict[str, Callable[..., Problem]] = {
    "mlp": mlp,
    "3c3d": cifar10_3c3d,
    "allcnnc": allcnnc,
    "resnet": resnet,
    "transformer": transformer,
    "gpt": gpt,
    "gpt-v16": gpt_v16,
    "lstm": lstm,
}

#: What ``run.py`` times by default (the CPU benchmark); ``GPU_PROBLEMS`` on request.
DEFAULT_PROBLEMS: tuple[str, ...] = tuple(PROBLEMS)

#: The model zoo (Hugging Face / timm through the ATen front end), on request: optional packages.
ZOO_PROBLEMS: dict[str, Callable[..., Problem]] = {
    "gpt2-hf": gpt2_hf,
    "gpt2-hf-v16": gpt2_hf_v16,
    "vit-timm": vit_timm,
    "vit-timm-fwd": functools.partial(vit_timm, wrap=True),
}
PROBLEMS.update(ZOO_PROBLEMS)

#: The GPU sizes (``--problems mlp-1024 3c3d-256 allcnnc-96 resnet-128``):
#: more samples, and All-CNN-C at DeepOBS's full width (96/192). Too large for the CPU default.
GPU_PROBLEMS: dict[str, Callable[..., Problem]] = {
    "mlp-1024": functools.partial(mlp, n=1024),
    "3c3d-256": functools.partial(cifar10_3c3d, n=256),
    "allcnnc-96": functools.partial(allcnnc, width=96, n=128),
    "resnet-128": functools.partial(resnet, n=128),
}
PROBLEMS.update(GPU_PROBLEMS)

#: Language models at full size, on request: ``benchmarks/llm_memory.py``.
LLM_PROBLEMS: dict[str, Callable[..., Problem]] = {"gpt2-small": gpt2_small}
LLM_PROBLEMS.update({f"gpt-sweep-d{d}-l{n}": functools.partial(gpt_sweep, d=d, layers=n)
                     for d in (128, 256, 512, 768) for n in (2, 4, 8, 12)})
#: The sweep's diagonal (d 128 -> 768 with layers 2 -> 12), what ``llm_memory.py --problems sweep`` runs.
SWEEP_DIAGONAL: tuple[str, ...] = ("gpt-sweep-d128-l2", "gpt-sweep-d256-l4", "gpt-sweep-d512-l8", "gpt-sweep-d768-l12")
PROBLEMS.update(LLM_PROBLEMS)


# --------------------------------------------------------------------------- methods


class Info(NamedTuple):
    """What a method computes, for grouping, size limits and value checks in ``run.py``.

    ``library``: ``"reference"``, ``"bound"``, ``"curvlib"`` or a peer's name.
    ``quantity``: the curvlib extension (class name) whose result it computes, or ``""``.
    ``check``: whether its values are compared with curvlib's (deterministic quantities
    in the same layout). ``size``: the result's leading dimensions per parameter,
    ``"N"`` (``[N, *p]``), ``"CN"`` (``[C, N, *p]``) or ``""`` (at most ``p``-sized).
    ``post``: maps the output into curvlib's layout for the check (not timed).
    """

    library: str
    quantity: str = ""
    check: bool = False
    size: str = ""
    post: Callable[[Problem, object], object] | None = None


FIRST_ORDER = ("BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance")
SECOND_ORDER = (
    "DiagGGNExact", "DiagGGNMC", "BatchDiagGGNExact", "BatchDiagGGNMC", "DiagHessian",
    "BatchDiagHessian", "KFAC", "KFLR", "KFRA", "SqrtGGNExact", "SqrtGGNMC",
)
#: Extensions whose result is random (Monte-Carlo): timed, never value-checked.
MONTE_CARLO = ("DiagGGNMC", "BatchDiagGGNMC", "KFAC", "SqrtGGNMC")
#: Result sizes of the extensions whose result is larger than the parameters.
SIZES = {"BatchGrad": "N", "BatchDiagGGNExact": "N", "BatchDiagGGNMC": "N", "BatchDiagHessian": "N",
         "SqrtGGNMC": "N", "SqrtGGNExact": "CN"}


def outputs_per_sample(problem: Problem) -> int:
    """``C``: the model's output numel per sample (the number of classes here)."""
    model, _, X, _ = problem
    with torch.no_grad():
        return model(X[:1]).numel()


def backward(problem: Problem) -> Callable[[], object]:
    """The reference: ``lossfn(model(X), y).backward()`` after ``zero_grad(set_to_none=True)``."""
    model, lossfn, X, y = problem

    def run():
        model.zero_grad(set_to_none=True)
        lossfn(model(X), y).backward()

    return run


def _bound(leading: str) -> Callable[[Problem], Callable[[], object]]:
    def setup(problem: Problem) -> Callable[[], object]:
        model, _lossfn, X, _y = problem
        total = X.shape[0] * sum(p.numel() for p in model.parameters() if p.requires_grad)
        if leading == "CN":
            total *= outputs_per_sample(problem)
        src = torch.ones(total, dtype=X.dtype, device=X.device)
        reference = backward(problem)

        def run():
            reference()
            return torch.empty(total, dtype=src.dtype, device=src.device).copy_(src)

        return run

    shape = "[N, *p]" if leading == "N" else "[C, N, *p]"
    setup.__doc__ = f"""The physical bound for a result of size ``{shape}``: a plain backward plus
    writing that many elements once (``torch.empty(total).copy_(src)`` from a
    pre-allocated source), the memory traffic any method pays to return it."""
    return setup


grad_batch_bound = _bound("N")


def _curvlib(*exts, **options) -> Callable[[Problem], Callable[[], object]]:
    def setup(problem: Problem) -> Callable[[], object]:
        model, lossfn, X, y = problem
        f = curvature(model, lossfn, [e() for e in exts], **options)
        if len(exts) == 1:
            key = exts[0]().name
            return lambda: f(X, y)[key]
        return lambda: f(X, y)

    extra = "".join(f", {k}={v}" for k, v in options.items())
    setup.__doc__ = f"curvlib ``curvature(model, lossfn, [{', '.join(e.__name__ + '()' for e in exts)}]{extra})(X, y)``."
    return setup


def vmap_grad(problem: Problem) -> Callable[[], object]:
    """Peer: individual gradients with ``torch.func.vmap(torch.func.grad(...))``.

    Each sample's loss is scaled like the batch loss (``1/N`` for ``"mean"``),
    so the result matches ``grad_batch``.
    """
    from torch.func import functional_call, grad, vmap

    model, lossfn, X, y = problem
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    buffers = dict(model.named_buffers())
    scale = 1.0 / X.shape[0] if lossfn.reduction == "mean" else 1.0

    def loss_one(p, x, t):
        out = functional_call(model, {**p, **buffers}, (x.unsqueeze(0),))
        return lossfn(out, t.unsqueeze(0)) * scale

    per_sample = vmap(grad(loss_one), in_dims=(None, 0, 0))
    return lambda: per_sample(params, X, y)


def _backpack(ext_name: str) -> Callable[[Problem], Callable[[], object]]:
    def setup(problem: Problem) -> Callable[[], object]:
        import backpack.extensions as bpext
        from backpack import backpack, extend

        # BackPACK's hooks warn when the input does not require gradients.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        warnings.filterwarnings("ignore", module="backpack")
        model, lossfn, X, y = problem
        model = copy.deepcopy(model)
        # Second order walks the module graph: BackPACK needs its fx converter off Sequential.
        converter = ext_name in SECOND_ORDER and not isinstance(model, nn.Sequential)
        model = extend(model, use_converter=converter)
        lossfn = extend(copy.deepcopy(lossfn))
        ext = getattr(bpext, ext_name)()
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

        def run():
            model.zero_grad(set_to_none=True)
            loss = lossfn(model(X), y)
            with backpack(ext):
                loss.backward()
            return {n: getattr(p, ext.savefield) for n, p in params}

        return run

    setup.__doc__ = f"Peer: BackPACK's ``{ext_name}`` (``extend`` on a deep copy of the model, once, in setup)."
    return setup


def opacus_grad_sample(problem: Problem) -> Callable[[], object]:
    """Peer: Opacus ``GradSampleModule`` per-sample gradients (``p.grad_sample``) on a copy
    (``sequence_models.opacus_copy``: ``DPMultiheadAttention``/``DPLSTM`` where needed)."""
    from opacus import GradSampleModule

    warnings.filterwarnings("ignore", module="opacus")
    model, lossfn, X, y = problem
    copied = opacus_copy(model)
    gsm = GradSampleModule(copied, batch_first=getattr(copied, "batch_first", True), loss_reduction=lossfn.reduction)
    params = [(n, p) for n, p in gsm._module.named_parameters() if p.requires_grad]

    def run():
        gsm.zero_grad(set_to_none=True)
        lossfn(gsm(X), y).backward()
        missing = [n for n, p in params if p.grad_sample is None]
        if missing:  # a parameter used outside a module Opacus knows (e.g. ``pos.weight`` as a tensor)
            raise NotImplementedError(f"Opacus computed no grad_sample for {', '.join(missing)}")
        return {n: p.grad_sample for n, p in params}

    return run


def _opacus_post(problem: Problem, out):
    # Opacus returns gradients of the individual (unscaled) losses; curvlib's carry 1/N for "mean".
    scale = 1.0 / problem.X.shape[0] if problem.lossfn.reduction == "mean" else 1.0
    return opacus_to_original(problem.model, {n: g * scale for n, g in out.items()})


def _curvlinops_kfac(fisher_type: str, linear_only: bool = False) -> Callable[[Problem], Callable[[], object]]:
    def setup(problem: Problem) -> Callable[[], object]:
        from curvlinops import KFACLinearOperator

        model, lossfn, X, y = problem
        model = copy.deepcopy(model)
        params = [p for p in model.parameters() if p.requires_grad]
        if linear_only:  # only the parameters of nn.Linear modules, the rest frozen out
            params = [p for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()]
        op = KFACLinearOperator(
            model, lossfn, params, [(X, y)], check_deterministic=False,
            fisher_type=fisher_type, num_data=X.shape[0],
        )

        def run():
            op.compute_kronecker_factors()
            return op

        return run

    setup.__doc__ = (f"Peer: curvlinops ``KFACLinearOperator(fisher_type={fisher_type!r})``; timed: "
                     "``compute_kronecker_factors()`` (one forward-backward over the batch).")
    return setup


METHODS: dict[str, Callable[[Problem], Callable[[], object]]] = {
    "backward": backward,
    "bound:BatchGrad": grad_batch_bound,
    "bound:SqrtGGNExact": _bound("CN"),
}
INFO: dict[str, Info] = {
    "backward": Info("reference"),
    "bound:BatchGrad": Info("bound", size="N"),
    "bound:SqrtGGNExact": Info("bound", size="CN"),
}
for _name in FIRST_ORDER + SECOND_ORDER:
    _q = Info("curvlib", _name, _name not in MONTE_CARLO, SIZES.get(_name, ""))
    METHODS[_name], INFO[_name] = _curvlib(getattr(extensions, _name)), _q
    if _name == "BatchGrad":
        METHODS["vmap(grad)"], INFO["vmap(grad)"] = vmap_grad, _q._replace(library="torch.func")
        METHODS["opacus"] = opacus_grad_sample
        INFO["opacus"] = _q._replace(library="opacus", post=_opacus_post)
    METHODS[f"backpack:{_name}"], INFO[f"backpack:{_name}"] = _backpack(_name), _q._replace(library="backpack")
    if _name == "KFAC":
        METHODS["curvlinops:KFAC(mc)"] = _curvlinops_kfac("mc")
        INFO["curvlinops:KFAC(mc)"] = Info("curvlinops", "KFAC")
    if _name == "KFLR":
        METHODS["curvlinops:KFAC(type-2)"] = _curvlinops_kfac("type-2")
        INFO["curvlinops:KFAC(type-2)"] = Info("curvlinops", "KFLR")
METHODS["curvlinops:KFAC(empirical)"] = _curvlinops_kfac("empirical")
INFO["curvlinops:KFAC(empirical)"] = Info("curvlinops")

#: Methods run when none are named ("backward" is always run: it is the reference).
DEFAULT_METHODS: tuple[str, ...] = tuple(METHODS)

# On request: curvlinops' KFAC on the nn.Linear parameters only (it refuses Embedding,
# LayerNorm, MultiheadAttention's in_proj_weight and bare parameters): a lower bound on
# a full KFAC peer's time for the transformers, not the same quantity (never checked).
for _ft in ("mc", "type-2"):
    METHODS[f"curvlinops:KFAC({_ft},Linear)"] = _curvlinops_kfac(_ft, linear_only=True)
    INFO[f"curvlinops:KFAC({_ft},Linear)"] = Info("curvlinops")

# Every other exported extension (GGNMP, HMP, PCHMP, ...): timed alone on request, not by default.
for _name in extensions.__all__:
    _cls = getattr(extensions, _name)
    if isinstance(_cls, type) and issubclass(_cls, extensions.Extension) and _cls.name and _name not in METHODS:
        METHODS[_name], INFO[_name] = _curvlib(_cls), Info("curvlib", _name)

# Memory knobs, timed on request (e.g. with --problems allcnnc to see peak memory fall):
# "DiagGGNExact[chunk_size=10]", "DiagGGNExact[batch_chunk_size=8]", both together.
for _name in ("DiagGGNExact", "BatchDiagGGNExact", "KFLR"):
    for _opts in ({"chunk_size": 10}, {"chunk_size": 5}, {"chunk_size": 3}, {"chunk_size": 2}, {"chunk_size": 1},
                  {"chunk_size": None},
                  {"batch_chunk_size": 8}, {"chunk_size": 10, "batch_chunk_size": 8}):
        _key = f"{_name}[{','.join(f'{k}={v}' for k, v in _opts.items())}]"
        METHODS[_key], INFO[_key] = _curvlib(getattr(extensions, _name), **_opts), Info("curvlib")

#: The pip requirement that provides each peer library (for "skipped" messages).
PEER_PACKAGES = {
    "backpack": "backpack-for-pytorch",
    "opacus": "opacus",
    "curvlinops": "curvlinops-for-pytorch",
}

# torch.compile, timed on request: "compiled:<Extension>" is
# curvature(..., compile=True) (one traced, torch.compile(fullgraph=True) program per
# input signature; the tracing and compilation fall in the "first call" column), checked
# against the eager method like a peer; "compiled:backward" is torch.compile of the loss
# and backward step (compiled forward+backward by AOTAutograd), for reference.
for _name in FIRST_ORDER + ("DiagGGNExact", "DiagGGNMC", "BatchDiagGGNExact", "BatchDiagGGNMC", "KFAC", "KFLR",
                            "SqrtGGNExact", "SqrtGGNMC", "DiagHessian", "BatchDiagHessian"):
    METHODS[f"compiled:{_name}"] = _curvlib(getattr(extensions, _name), compile=True)
    INFO[f"compiled:{_name}"] = INFO[_name]._replace(library="curvlib compiled")


def compiled_backward(problem: Problem) -> Callable[[], object]:
    """``torch.compile`` of ``lossfn(model(X), y).backward()`` (after ``zero_grad``)."""
    model, lossfn, X, y = problem
    forward = torch.compile(lambda X, y: lossfn(model(X), y))

    def run():
        model.zero_grad(set_to_none=True)
        forward(X, y).backward()

    return run


METHODS["compiled:backward"], INFO["compiled:backward"] = compiled_backward, Info("torch.compile")
