"""Run every cell of the composition matrix once and print a markdown table of the failures.

``PYTHONPATH=src:tests python -m oracles.compose_table [model ...] > table.md``: one row per
failing cell (model x extension x transform -> wrong by how much / NaN / crash
message), then a count. Refusals expected by ``oracles.compose_cells.REFUSED`` are checked
like the test does. Seed 0, two samples.
"""

from __future__ import annotations

import re
import sys
import time
import warnings

import torch

from oracles.compose_cells import TRANSFORMS, expected_refusal, rows, run_cell
from oracles.compose_models import INTEGER_INPUT, MODELS

torch.set_num_threads(1)
warnings.simplefilter("ignore")


def outcome(model: str, cls_name: str, transform: str) -> str:
    refused = expected_refusal(model, cls_name, transform)
    try:
        run_cell(model, cls_name, transform)
    except AssertionError as e:
        msg = str(e)
        m = re.search(r"max error (\S+) at scale (\S+) \(rel (\S+)\)", msg)
        if m and m.group(1) in ("inf", "nan"):
            return "NaN/inf"
        return f"wrong: rel {m.group(3)} (err {m.group(1)}, scale {m.group(2)})" if m else "wrong: " + msg[:160]
    except Exception as e:  # noqa: BLE001
        msg = " ".join(str(e).split())
        if refused and isinstance(e, refused[0]) and re.search(refused[1], msg):
            return "ok"
        return f"crash {type(e).__name__}: {msg[:160]}"
    return "ok" if not refused else f"NOT refused (expected {refused[0].__name__}: {refused[1]})"


def main(models) -> None:
    rows, total, xfail = [], 0, []
    for model in models:
        for cls_name in rows():
            for transform in TRANSFORMS:
                if transform == "grad_X" and model in INTEGER_INPUT:
                    continue
                total += 1
                t0 = time.time()
                res = outcome(model, cls_name, transform)
                dt = time.time() - t0
                if res != "ok":
                    rows.append(f"| {model} | {cls_name} | {transform} | {res} |")
                    xfail.append(f"    ({model!r}, {cls_name!r}, {transform!r}): {res[:70]!r},")
                print(f"{model} {cls_name} {transform} {dt:.1f}s {res}", file=sys.stderr, flush=True)
    print("| model | extension | transform | result |\n|---|---|---|---|")
    print("\n".join(rows))
    print(f"\n{len(rows)} of {total} cells fail.")
    print("\nXFAIL entries for test_compose.py:\n```python\n" + "\n".join(xfail) + "\n```")


if __name__ == "__main__":
    main(sys.argv[1:] or MODELS)
