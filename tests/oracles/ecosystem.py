"""The ecosystem sweep's problems: every architecture a library exposes, built tiny.

Names are ``library/...``:

* ``transformers/<mapping>/<model_type>`` for every class of transformers'
  ``MODEL_FOR_{CAUSAL_LM, SEQUENCE_CLASSIFICATION, IMAGE_CLASSIFICATION, MASKED_LM}_MAPPING_NAMES``
  (mappings ``causal_lm``, ``seq_cls``, ``image_cls``, ``masked_lm``; ``ecosystem_hf``);
* ``timm/<family>``: one model per module of ``timm.models`` (``ecosystem_vision``);
* ``torchvision/<builder>``: every classification builder of ``torchvision.models``;
* ``peft/lora_llama``, ``peft/lora_gpt2``, ``peft/weight_norm``, ``peft/spectral_norm``.

``build(name, variant)`` gives a ``zoo.Problem`` (float64, eval mode, offset parameters,
``N = 3`` samples) in one of two variants: ``"direct"`` (the library's model with a dict
``X`` of keyword inputs, or a tensor, and an ``output=`` selector) or ``"wrapped"`` (a
one-line ``nn.Module`` around it taking one tensor and returning the loss's input).
``eligibility(name)`` says whether a plain float64 forward and backward runs, and why not.
A model whose forward runs only in float32 (transformers' ``grouped_mm`` experts) is checked
in float32 against float64 references where transformers offers an experts implementation
that runs in float64 (``batched_mm``, then ``eager``): the problem is that float64 model, its
``computed`` twin the float32 original (``float32_twin``), compared at :data:`F32_RTOL`.
"""

from __future__ import annotations

import copy
from typing import List, Optional, Tuple

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from oracles import ecosystem_hf as eh
from oracles import ecosystem_vision as ev
from oracles.on_device import seeded
from oracles.zoo import CLASSES, N, Problem, _finish, _lm_output

LIBRARIES = ["transformers", "timm", "torchvision", "peft"]
VARIANTS = ["direct", "wrapped"]
PEFT = ["lora_llama", "lora_gpt2", "weight_norm", "spectral_norm"]
#: experts implementations of transformers tried, in order, for a float64 reference
EXPERT_PATHS = ("batched_mm", "eager")
#: a float32 result against a float64 reference: relative to the reference's largest entry
F32_RTOL = 1e-4
# a float64 model that computes part of its forward in a lower precision (timm's EfficientViT-MIT
# casts its linear attention to float32): its own derivatives hold that precision's rounding, and
# two exact ways of computing them (torch's autograd, curvlib's per-sample recomputation) agree
# only to it, relative to the largest entry
LOWER_PRECISION_RTOL = 1e-5
#: what a float32-only model with a float64 experts path is checked as: ``"float32"`` (curvlib on
#: the float32 original against the float64 references) or ``"float64"`` (curvlib on the float64
#: experts path itself, at the problem's own tolerance); the sweep's ``--float64-experts``
TWIN = ["float32"]


def names(library: str) -> List[str]:
    """Every problem name of ``library`` (one of :data:`LIBRARIES`)."""
    if library == "transformers":
        from transformers.models.auto import modeling_auto  # optional dependency

        return [f"transformers/{m}/{t}" for m, attr in eh.MAPPINGS.items() for t in getattr(modeling_auto, attr)]
    if library == "timm":
        return [f"timm/{f}" for f in ev.timm_families()]
    if library == "torchvision":
        import torchvision.models as tv  # optional dependency

        return [f"torchvision/{b}" for b in tv.list_models(module=tv)]
    if library == "peft":
        return [f"peft/{p}" for p in PEFT]
    raise KeyError(f"unknown library {library!r}; one of {LIBRARIES}")


class Wrapped(nn.Module):
    """A user's one-line wrapper around a model that takes one tensor."""

    def __init__(self, inner: nn.Module, lm: bool = False):
        super().__init__()
        self.inner, self.lm = inner, lm

    def forward(self, x):
        out = self.inner(x) if not self.lm else self.inner(input_ids=x).logits.transpose(1, 2)
        return out


def _vision(name: str, variant: str, seed: int) -> Problem:
    library, what = name.split("/", 1)
    g = seeded(seed)
    if library == "timm":
        model, X, notes = ev.timm_model(what, ev.timm_families()[what], g)
    elif library == "torchvision":
        model, X, notes = ev.tv_model(what, g)
    elif what.startswith("lora_"):
        model, X, notes = ev.peft_model(what[len("lora_"):], g)
        model = _finish(model, seed)
        y = torch.randint(0, 64, X.shape, generator=g)
        if variant == "wrapped":
            return Problem(Wrapped(model, lm=True), X, y, nn.CrossEntropyLoss(), None, notes, eh.RTOL)
        return Problem(model, {"input_ids": X}, y, nn.CrossEntropyLoss(), _lm_output, notes, eh.RTOL)
    else:
        model, X, notes = ev.parametrized_model(what, g)
    model = _finish(model, seed, relative=library in ("timm", "torchvision"))
    if library in ("timm", "torchvision"):
        model = ev.calibrated(model, X)
    y = torch.randint(0, CLASSES, (N,), generator=g)
    return Problem(Wrapped(model) if variant == "wrapped" else model, X, y, nn.CrossEntropyLoss(), None, notes)


def build(name: str, variant: str = "direct", seed: int = 0) -> Problem:
    """The problem ``name`` (see the module docstring) in ``variant`` "direct" or "wrapped"."""
    torch.manual_seed(seed)
    if name.startswith("transformers/"):
        _, mapping, model_type = name.split("/", 2)
        return eh.hf_problem(mapping, model_type, variant, seed)
    return _vision(name, variant, seed)


def _forward_backward(prob: Problem) -> None:
    from oracles.zoo_reference import forward

    loss = prob.lossfn(forward(prob.model, prob.X, prob.output), prob.y)
    loss.backward()


def _as_float32(prob: Problem) -> Problem:
    cast = lambda t: t.float() if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
    X = {k: cast(v) for k, v in prob.X.items()} if isinstance(prob.X, dict) else cast(prob.X)
    return prob._replace(model=copy.deepcopy(prob.model).float(), X=X)


def _float32_runs(prob: Problem) -> bool:
    try:
        _forward_backward(_as_float32(prob))
        return True
    except Exception:  # noqa: BLE001 - not float32-only either
        return False


def _library_model(model: nn.Module) -> nn.Module:
    """The library's model: ``model`` itself, or the one a one-line wrapper holds."""
    for attribute in ("hf", "inner"):
        if isinstance(getattr(model, attribute, None), nn.Module):
            return getattr(model, attribute)
    return model


def float32_twin(prob: Problem) -> Optional[Problem]:
    """For a model whose forward runs only in float32: the float64 problem on the first of
    :data:`EXPERT_PATHS` whose forward and backward run in float64, with the float32 original
    as ``computed`` and ``rtol`` :data:`F32_RTOL`; ``None`` if the model has no such path."""
    if not hasattr(_library_model(prob.model), "set_experts_implementation"):
        return None
    twin = _as_float32(prob)
    for path in EXPERT_PATHS:
        ref = prob._replace(model=copy.deepcopy(prob.model))
        try:
            _library_model(ref.model).set_experts_implementation(path)
            _forward_backward(ref)
        except Exception:  # noqa: BLE001 - this path does not run in float64 either
            continue
        for p in list(ref.model.parameters()) + list(twin.model.parameters()):
            p.grad = None
        notes = f"{prob.notes}; float32 ({_library_model(twin.model).config._experts_implementation}) vs float64 ({path}) references"
        return ref._replace(computed=twin, rtol=F32_RTOL, notes=notes)
    return None


def eligibility(name: str, variant: str = "direct") -> Optional[str]:
    """``None`` if the problem builds and a float64 forward + backward runs, else why not:
    ``"too large: ..."``, ``"build: Type: message"``, ``"float32-only: message"`` (runs in
    float32, not in float64) or ``"forward: Type: message"``."""
    return eligible_problem(name, variant)[0]


def eligible_problem(name: str, variant: str = "direct") -> Tuple[Optional[str], Optional[Problem]]:
    """``(eligibility(name, variant), the problem if eligible)``; the forward + backward's
    gradients are cleared again."""
    try:
        prob = build(name, variant)
    except (eh.TooLarge, ev.TooLarge) as e:
        return f"too large: {e}", None
    except Exception as e:  # noqa: BLE001 - the reason is the report's
        return f"build: {type(e).__name__}: {_first_line(e)}", None
    try:
        _forward_backward(prob)
    except Exception as e:  # noqa: BLE001 - the reason is the report's
        if _float32_runs(prob):
            twin = float32_twin(prob)
            if twin is not None and TWIN[0] == "float64":
                return None, twin._replace(computed=None, rtol=prob.rtol, notes=twin.notes.split(";")[0]
                                           + "; float64 experts path " + twin.notes.rsplit("(", 1)[1].split(")")[0])
            if twin is not None:
                return None, twin
            return f"float32-only: {type(e).__name__}: {_first_line(e)}", None
        return f"forward: {type(e).__name__}: {_first_line(e)}", None
    # (Longformer's masked LM: softmax rows of -inf at its padding, zeroed after, give NaN in
    # torch's own backward: no exact reference exists)
    bad = next((k for k, p in prob.model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()), None)
    for p in prob.model.parameters():
        p.grad = None
    if bad is not None:
        return f"backward: the model's own gradient of {bad} is not finite (torch autograd)", None
    return None, _lower_precision(prob)


class _FloatDtypes(TorchDispatchMode):
    """The floating dtypes of every op's tensor outputs."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.seen.add(t.dtype)
        return out


def _lower_precision(prob: Problem) -> Problem:
    """``prob`` at :data:`LOWER_PRECISION_RTOL` with a note when its float64 forward computes in a
    lower floating precision anywhere (a cast to float32 inside the model)."""
    from oracles.zoo_reference import forward

    if prob.computed is not None or any(p.dtype != torch.float64 for p in prob.model.parameters()):
        return prob
    with torch.no_grad(), _FloatDtypes() as mode:
        forward(prob.model, prob.X, prob.output)
    lower = sorted(str(d).replace("torch.", "") for d in mode.seen if d != torch.float64)
    if not lower:
        return prob
    return prob._replace(rtol=max(prob.rtol, LOWER_PRECISION_RTOL),
                         notes=f"{prob.notes}; computes in {', '.join(lower)} inside")


def _first_line(e: BaseException, limit: int = 200) -> str:
    lines = [s for s in str(e).strip().splitlines() if s.strip()]
    return (lines[0] if lines else "")[:limit]
