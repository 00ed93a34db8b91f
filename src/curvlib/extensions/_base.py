"""Extensions are small frozen records: a result name and what they need.

An extension holds no state and no code that walks the model; the engine
computes the per-site pieces an extension needs and the extension's class
says how they are laid out. Which extension supports which layer family is a
table checked before any work (second-order extensions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class Extension:
    """Base class of every curvlib extension.

    Attributes:
        name: key of the extension's result in the dict returned by
            ``curvlib.curvature`` (BackPACK's attribute name).
        order: 1 for first-order extensions (they need only the gradient
            backpropagated once), 2 for curvature extensions.
    """

    name: ClassVar[str] = ""
    order: ClassVar[int] = 1
