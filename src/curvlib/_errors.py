"""The one exception family curvlib raises for bad input."""

from __future__ import annotations


class CurvatureError(ValueError):
    """Bad input to :func:`curvlib.curvature` or to a function it returned.

    Every message names the offending module, parameter, tensor or argument,
    shows the bad value and says what is supported.
    """


class CurvatureTypeError(CurvatureError, TypeError):
    """A :class:`CurvatureError` about the *type* of an argument."""


def output_not_a_tensor(result: object) -> CurvatureError:
    """The refusal of a model whose ``forward`` returns something other than one tensor.

    Names the type the user wrote (torch.fx hands a traced ``dict`` back as its own
    ``immutable_dict``, a subclass) and, for a mapping or a sequence, what it holds, so the
    user sees which entry to return.
    """
    kind = type(result)
    if isinstance(result, dict):
        kind = dict if type(result).__module__.startswith("torch.fx") else kind
        inside = ", ".join(f"{k!r}: {_describe(v)}" for k, v in result.items())
    elif isinstance(result, (tuple, list)):
        inside = ", ".join(_describe(v) for v in result)
    else:
        inside = ""
    held = f" ({inside})" if inside else ""
    return CurvatureError(
        f"The model returns a {kind.__name__}{held}; curvlib needs a single output tensor with the "
        "batch in dim 0, the one the loss takes. Wrap the model in an nn.Module whose forward "
        "returns that tensor, e.g. `return self.model(x)[\"logits\"]` (a Hugging Face model: "
        "`.logits`)."
    )


def _describe(value: object) -> str:
    shape = getattr(value, "shape", None)
    return f"tensor {list(shape)}" if shape is not None else type(value).__name__
