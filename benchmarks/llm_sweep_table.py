"""The model-size sweep's tables from ``llm_memory.py``'s JSON output, one or several files.

    python benchmarks/llm_sweep_table.py benchmarks/results/cpu/llm-sweep.json benchmarks/results/cpu/llm-sweep-d768.json

Prints two Markdown tables, sizes as columns: per method, the call's peak memory above the memory
just before it over the plain backward's (same measure, same size), and its time over the backward's
(median over median in one process); a peer's failure or a curvlib refusal shows its first line.
"""

from __future__ import annotations

import json
import re
import sys


def _size(problem: str) -> str:
    m = re.fullmatch(r"gpt-sweep-d(\d+)-l(\d+)", problem)
    return f"d {m.group(1)}, {m.group(2)} layers" if m else problem


def tables(paths: list[str]) -> str:
    rows: dict = {}  # problem -> method -> row
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for by_problem in data["rows"].values():
            for problem, by_method in by_problem.items():
                rows.setdefault(problem, {}).update(by_method)
    problems = list(rows)
    methods = list(dict.fromkeys(m for p in problems for m in rows[p]))
    out = []
    for title, cell in (("peak memory of the call / the backward's (MiB: the backward's)", _memory),
                        ("time / the backward's (ms: the backward's median)", _time)):
        out += [f"{title}:", "", "| method | " + " | ".join(_size(p) for p in problems) + " |",
                "|---|" + "---:|" * len(problems)]
        for m in methods:
            out.append(f"| `{m}` | " + " | ".join(cell(rows[p], m) for p in problems) + " |")
        out.append("")
    return "\n".join(out)


def _failed(r: dict) -> str | None:
    if "refused" in r:
        return f"refused: {r['refused'][:120]}"
    if "error" in r:
        return f"failed: {r['error'][:120]}"
    return None


def _memory(by_method: dict, m: str) -> str:
    r = by_method.get(m)
    if r is None:
        return ""
    if _failed(r) and r.get("call_above_mib") is None:
        return _failed(r)
    ref = by_method.get("backward", {}).get("call_above_mib")
    mib = r.get("call_above_mib")
    if m == "backward":
        return f"1.00 ({mib:.0f})"
    return "" if mib is None or not ref else f"{mib / ref:.2f}"


def _time(by_method: dict, m: str) -> str:
    r = by_method.get(m)
    if r is None:
        return ""
    if _failed(r):
        return "" if "refused" in r else "time: " + _failed(r)
    if m == "backward":
        return f"1.00 ({r['ms']['backward']:.0f})" if "ms" in r else ""
    return "" if r.get("ratio") is None else f"{r['ratio']:.2f}"


if __name__ == "__main__":
    print(tables(sys.argv[1:]))
