"""Write docs/_inventories/torch.inv and python.inv: the intersphinx inventories of the build.

The machines that build the site reach neither pytorch.org nor python.org, so conf.py's
``intersphinx_mapping`` reads these small inventories (objects.inv, version 2) instead of the
projects' own. They list what the API reference links to: the classes of the signatures'
annotations (``torch.Tensor``, ``nn.Module``, ``torch.Generator``, ``Mapping``, ``Callable``, ...)
under the names autodoc gives them, each with its page on https://pytorch.org/docs/stable/ or
https://docs.python.org/3/. Add a name here when a new annotation shows up unlinked (a build
with ``-n`` lists the targets it found no page for), then run::

    python docs/make_inventories.py
"""

import os
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "_inventories")

# (name, domain:role, page#anchor relative to the project's root)
TORCH = [
    ("torch.Tensor", "py:class", "tensors.html#torch.Tensor"),
    ("torch.LongTensor", "py:class", "tensors.html#data-types"),
    ("torch.nn.Module", "py:class", "generated/torch.nn.Module.html#torch.nn.Module"),
    ("torch.nn.modules.module.Module", "py:class", "generated/torch.nn.Module.html#torch.nn.Module"),
    ("torch.nn.Parameter", "py:class", "generated/torch.nn.parameter.Parameter.html#torch.nn.parameter.Parameter"),
    ("torch.nn.CrossEntropyLoss", "py:class", "generated/torch.nn.CrossEntropyLoss.html#torch.nn.CrossEntropyLoss"),
    ("torch.nn.MSELoss", "py:class", "generated/torch.nn.MSELoss.html#torch.nn.MSELoss"),
    ("torch.nn.BCEWithLogitsLoss", "py:class", "generated/torch.nn.BCEWithLogitsLoss.html#torch.nn.BCEWithLogitsLoss"),
    ("torch.nn.functional.cross_entropy", "py:function",
     "generated/torch.nn.functional.cross_entropy.html#torch.nn.functional.cross_entropy"),
    ("torch.nn.functional.mse_loss", "py:function",
     "generated/torch.nn.functional.mse_loss.html#torch.nn.functional.mse_loss"),
    ("torch.Generator", "py:class", "generated/torch.Generator.html#torch.Generator"),
    ("torch._C.Generator", "py:class", "generated/torch.Generator.html#torch.Generator"),
    ("torch.dtype", "py:class", "tensor_attributes.html#torch.dtype"),
    ("torch.device", "py:class", "tensor_attributes.html#torch.device"),
    ("torch.Size", "py:class", "size.html#torch.Size"),
    ("torch.optim.Optimizer", "py:class", "optim.html#torch.optim.Optimizer"),
    ("torch.optim.optimizer.Optimizer", "py:class", "optim.html#torch.optim.Optimizer"),
    ("torch.autograd.Function", "py:class", "autograd.html#torch.autograd.Function"),
    ("torch.utils.data.DataLoader", "py:class", "data.html#torch.utils.data.DataLoader"),
    ("torch.func.vmap", "py:function", "generated/torch.func.vmap.html#torch.func.vmap"),
    ("torch.func.grad", "py:function", "generated/torch.func.grad.html#torch.func.grad"),
    ("torch.func.functional_call", "py:function",
     "generated/torch.func.functional_call.html#torch.func.functional_call"),
    ("torch.distributed.device_mesh.DeviceMesh", "py:class",
     "distributed.html#torch.distributed.device_mesh.DeviceMesh"),
    # string annotations autodoc cannot evaluate (the laplace backends: laplace-torch is mocked)
    ("Tensor", "py:class", "tensors.html#torch.Tensor"),
    ("nn.Module", "py:class", "generated/torch.nn.Module.html#torch.nn.Module"),
]

_STDTYPES = "library/stdtypes.html"
_TYPING = "library/typing.html"
_ABC = "library/collections.abc.html"
PYTHON = [
    ("dict", "py:class", f"{_STDTYPES}#dict"),
    ("list", "py:class", f"{_STDTYPES}#list"),
    ("tuple", "py:class", f"{_STDTYPES}#tuple"),
    ("str", "py:class", f"{_STDTYPES}#str"),
    ("frozenset", "py:class", f"{_STDTYPES}#frozenset"),
    ("set", "py:class", f"{_STDTYPES}#set"),
    ("int", "py:class", "library/functions.html#int"),
    ("float", "py:class", "library/functions.html#float"),
    ("bool", "py:class", "library/functions.html#bool"),
    ("object", "py:class", "library/functions.html#object"),
    ("type", "py:class", "library/functions.html#type"),
    ("callable", "py:function", "library/functions.html#callable"),
    ("None", "py:data", "library/constants.html#None"),
    ("ValueError", "py:exception", "library/exceptions.html#ValueError"),
    ("TypeError", "py:exception", "library/exceptions.html#TypeError"),
    ("RuntimeError", "py:exception", "library/exceptions.html#RuntimeError"),
    ("NotImplementedError", "py:exception", "library/exceptions.html#NotImplementedError"),
    ("contextvars", "py:module", "library/contextvars.html#module-contextvars"),
    ("typing.Any", "py:data", f"{_TYPING}#typing.Any"),
    ("typing.Callable", "py:data", f"{_TYPING}#typing.Callable"),
    ("typing.Dict", "py:class", f"{_TYPING}#typing.Dict"),
    ("typing.List", "py:class", f"{_TYPING}#typing.List"),
    ("typing.Tuple", "py:data", f"{_TYPING}#typing.Tuple"),
    ("typing.Optional", "py:data", f"{_TYPING}#typing.Optional"),
    ("typing.Union", "py:data", f"{_TYPING}#typing.Union"),
    ("typing.Mapping", "py:class", f"{_TYPING}#typing.Mapping"),
    ("typing.Sequence", "py:class", f"{_TYPING}#typing.Sequence"),
    ("typing.Iterable", "py:class", f"{_TYPING}#typing.Iterable"),
    ("typing.Iterator", "py:class", f"{_TYPING}#typing.Iterator"),
    ("typing.NamedTuple", "py:function", f"{_TYPING}#typing.NamedTuple"),
    ("typing.TypeVar", "py:class", f"{_TYPING}#typing.TypeVar"),
    ("collections.abc.Callable", "py:class", f"{_ABC}#collections.abc.Callable"),
    ("collections.abc.Mapping", "py:class", f"{_ABC}#collections.abc.Mapping"),
    ("collections.abc.Sequence", "py:class", f"{_ABC}#collections.abc.Sequence"),
    ("collections.abc.Iterable", "py:class", f"{_ABC}#collections.abc.Iterable"),
    ("collections.abc.Iterator", "py:class", f"{_ABC}#collections.abc.Iterator"),
]


def inventory(project: str, version: str, entries) -> bytes:
    """objects.inv version 2: a four-line header, then zlib-compressed ``name role prio uri dispname`` lines."""
    header = (f"# Sphinx inventory version 2\n# Project: {project}\n# Version: {version}\n"
              "# The remainder of this file is compressed using zlib.\n").encode()
    body = "".join(f"{name} {role} 1 {uri} -\n" for name, role, uri in sorted(entries)).encode()
    return header + zlib.compress(body, 9)


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    for filename, project, version, entries in (("torch.inv", "PyTorch", "stable", TORCH),
                                                ("python.inv", "Python", "3", PYTHON)):
        with open(os.path.join(OUT, filename), "wb") as fh:
            fh.write(inventory(project, version, entries))
        print(f"wrote {os.path.join(OUT, filename)}: {len(entries)} objects")


if __name__ == "__main__":
    main()
