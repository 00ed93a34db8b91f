"""Named benchmark problems and timed methods, as two registries.

A *problem* is a function ``build(device="cpu", dtype=torch.float32, seed=0)``
returning a :class:`Problem` ``(model, lossfn, X, y)`` with seeded random
data of a realistic shape (nothing is downloaded). A *method* is a function
``setup(problem) -> run`` returning a zero-argument callable that does the
timed work once; ``setup`` may prepare anything that should not be timed
(build the transform, copy the model, pre-allocate a buffer).

To add a problem, write a ``build`` function and add it to :data:`PROBLEMS`.
To add a method (a peer library such as BackPACK or Opacus, a second-order
curvlib extension), write a ``setup`` function and add it to :data:`METHODS`;
list it in :data:`DEFAULT_METHODS` to run it by default. ``"backward"`` is
the reference every ratio is taken against.

| problem | model | N | input | loss |
|---|---|---|---|---|
| ``mlp`` | MNIST-sized MLP 784-128-128-10, ReLU | 128 | ``[N, 784]`` | ``CrossEntropyLoss()`` |
| ``3c3d`` | DeepOBS ``cifar10_3c3d`` (3 conv + 3 dense) | 64 | ``[N, 3, 32, 32]`` | ``CrossEntropyLoss()`` |
| ``resnet`` | ResNet-8 (3 basic blocks 16-32-64, BatchNorm eval) | 32 | ``[N, 3, 32, 32]`` | ``CrossEntropyLoss()`` |
| ``transformer`` | one pre-LN encoder block, d 64, 4 heads, vocab 1000 | 32 | ``[N, 32]`` tokens | ``CrossEntropyLoss()`` |
"""

from __future__ import annotations

import copy
import warnings
from typing import Callable, Dict, NamedTuple, Tuple

import torch
from torch import Tensor, nn

import curvlib.extensions as extensions
from curvlib import curvature
from curvlib.extensions import BatchGrad, BatchL2Grad, SumGradSquared, Variance


class Problem(NamedTuple):
    """A model, its loss and one batch. Unpacks as ``(model, lossfn, X, y)``."""

    model: nn.Module
    lossfn: nn.Module
    X: Tensor
    y: Tensor


# --------------------------------------------------------------------------- problems


def mlp(device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> Problem:
    """MNIST-sized MLP 784-128-128-10 with ReLU; N=128, ``CrossEntropyLoss(mean)``."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    n, d, classes = 128, 784, 10
    model = nn.Sequential(
        nn.Linear(d, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, classes)
    )
    X = torch.rand(n, d, generator=gen)
    y = torch.randint(0, classes, (n,), generator=gen)
    return _place(Problem(model, nn.CrossEntropyLoss(), X, y), device, dtype)


def cifar10_3c3d(device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> Problem:
    """DeepOBS's ``cifar10_3c3d`` net; N=64, input ``[N, 3, 32, 32]``, ``CrossEntropyLoss(mean)``.

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
    n, classes = 64, 10
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
    X = torch.rand(n, 3, 32, 32, generator=gen)
    y = torch.randint(0, classes, (n,), generator=gen)
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


def resnet(device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> Problem:
    """ResNet-8 on CIFAR-10 shapes: stem conv 16, basic blocks 16 -> 32 -> 64 (identity
    and 1x1-projection shortcuts), BatchNorm in eval mode (random running statistics),
    global average pooling, Linear 64 -> 10; N=32, ``CrossEntropyLoss(mean)``."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    n, classes = 32, 10
    model = _ResNet8(classes)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(0.1 * torch.randn(m.num_features, generator=gen))
                m.running_var.copy_(0.5 + torch.rand(m.num_features, generator=gen))
    model.eval()
    X = torch.rand(n, 3, 32, 32, generator=gen)
    y = torch.randint(0, classes, (n,), generator=gen)
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
    X = torch.randint(0, vocab, (n, length), generator=gen)
    y = torch.randint(0, classes, (n,), generator=gen)
    return Problem(model.to(device=device, dtype=dtype), nn.CrossEntropyLoss(), X.to(device), y.to(device))


def _place(problem: Problem, device: str, dtype: torch.dtype) -> Problem:
    model, lossfn, X, y = problem
    return Problem(model.to(device=device, dtype=dtype), lossfn, X.to(device=device, dtype=dtype), y.to(device))


PROBLEMS: Dict[str, Callable[..., Problem]] = {
    "mlp": mlp,
    "3c3d": cifar10_3c3d,
    "resnet": resnet,
    "transformer": transformer,
}


# --------------------------------------------------------------------------- methods


def backward(problem: Problem) -> Callable[[], object]:
    """The reference: ``lossfn(model(X), y).backward()`` after ``zero_grad(set_to_none=True)``."""
    model, lossfn, X, y = problem

    def run():
        model.zero_grad(set_to_none=True)
        lossfn(model(X), y).backward()

    return run


def grad_batch_bound(problem: Problem) -> Callable[[], object]:
    """A lower bound for ``BatchGrad``: the backward plus writing ``[N, *p]`` once.

    Copies a pre-allocated source of ``N * Σ_p p.numel()`` elements into a
    fresh buffer, the memory traffic any method must pay to return the
    individual gradients.
    """
    model, lossfn, X, y = problem
    total = X.shape[0] * sum(p.numel() for p in model.parameters() if p.requires_grad)
    src = torch.ones(total, dtype=X.dtype, device=X.device)
    reference = backward(problem)

    def run():
        reference()
        return torch.empty(total, dtype=src.dtype, device=src.device).copy_(src)

    return run


def _curvlib(*extensions) -> Callable[[Problem], Callable[[], object]]:
    def setup(problem: Problem) -> Callable[[], object]:
        model, lossfn, X, y = problem
        f = curvature(model, lossfn, [e() for e in extensions])
        return lambda: f(X, y)

    setup.__doc__ = f"curvlib ``curvature(model, lossfn, [{', '.join(e.__name__ + '()' for e in extensions)}])(X, y)``."
    return setup


def vmap_grad(problem: Problem) -> Callable[[], object]:
    """Peer: individual gradients with ``torch.func.vmap(torch.func.grad(...))``.

    Each sample's loss is scaled like the batch loss (``1/N`` for ``"mean"``),
    so the result matches ``grad_batch``.
    """
    from torch.func import functional_call, grad, vmap

    model, lossfn, X, y = problem
    params = {n: p.detach() for n, p in model.named_parameters()}
    scale = 1.0 / X.shape[0] if lossfn.reduction == "mean" else 1.0

    def loss_one(p, x, t):
        out = functional_call(model, p, (x.unsqueeze(0),))
        return lossfn(out, t.unsqueeze(0)) * scale

    per_sample = vmap(grad(loss_one), in_dims=(None, 0, 0))
    return lambda: per_sample(params, X, y)


def backpack_batch_grad(problem: Problem) -> Callable[[], object]:
    """Peer: BackPACK's ``BatchGrad`` (on a deep copy of the model, as ``extend`` changes it)."""
    from backpack import backpack, extend
    from backpack.extensions import BatchGrad as BPBatchGrad

    # BackPACK's hooks warn when the input does not require gradients.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    model, lossfn, X, y = problem
    model = extend(copy.deepcopy(model))
    lossfn = extend(copy.deepcopy(lossfn))

    def run():
        model.zero_grad(set_to_none=True)
        loss = lossfn(model(X), y)
        with backpack(BPBatchGrad()):
            loss.backward()

    return run


METHODS: Dict[str, Callable[[Problem], Callable[[], object]]] = {
    "backward": backward,
    "BatchGrad": _curvlib(BatchGrad),
    "BatchL2Grad": _curvlib(BatchL2Grad),
    "SumGradSquared": _curvlib(SumGradSquared),
    "Variance": _curvlib(Variance),
    "bound:BatchGrad": grad_batch_bound,
    "vmap(grad)": vmap_grad,
    "backpack:BatchGrad": backpack_batch_grad,
}

# Every other exported extension (second order, ...), timed alone; not run by default.
for _name in extensions.__all__:
    _cls = getattr(extensions, _name)
    if isinstance(_cls, type) and issubclass(_cls, extensions.Extension) and _cls.name and _name not in METHODS:
        METHODS[_name] = _curvlib(_cls)

# Methods run when none are named; "backward" is always run (it is the reference).
DEFAULT_METHODS: Tuple[str, ...] = (
    "backward",
    "BatchGrad",
    "BatchL2Grad",
    "SumGradSquared",
    "Variance",
    "bound:BatchGrad",
)
