"""The ecosystem sweep's Markdown report from its results (``benchmarks/ecosystem_sweep.py``).

Sections: a summary per library (per mapping for transformers) and variant; the failure
causes grouped by message (numbers masked) with counts and example classes; why classes are
not eligible; the first-order call's cost as multiples of a plain backward; one row per class
with every group's outcome (direct | wrapped) and the backward, first- and second-call seconds.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from typing import Any, Dict, List

SHORT = {"exact": "✓", "refused": "R", "wrong": "W", "crash": "C", "oracle": "O", "timeout": "T"}
BAD = ["refused", "wrong", "crash", "oracle", "timeout"]


def _where(name: str) -> str:
    parts = name.split("/")
    return "/".join(parts[:2]) if parts[0] == "transformers" else parts[0]


def _mask(msg: str) -> str:
    """A message with its numbers, quoted names and shapes masked, to group alike causes."""
    msg = re.sub(r"'[^']*'", "'…'", msg)
    msg = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", msg)
    return msg[:160]


def summary(results: List[Dict[str, Any]], groups: List[str]) -> List[str]:
    head = ["where", "variant", "classes", "eligible"] + [f"{g} exact" for g in groups] + \
        ["all exact"] + [f"{o} (cells)" for o in BAD]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keys = sorted({(_where(r["name"]), r["variant"]) for r in results})
    for lib in sorted({k[0].split("/")[0] for k in keys}):
        sub = [k for k in keys if k[0].split("/")[0] == lib]
        rows = sub + ([(lib, v) for v in sorted({k[1] for k in sub})] if len(sub) > 2 else [])
        for where, variant in rows:
            rs = [r for r in results if r["variant"] == variant and
                  (_where(r["name"]) == where or (where == lib and len(sub) > 2 and r["name"].startswith(lib)))]
            ok = [r for r in rs if r.get("ineligible") is None]
            cells = Counter(c["outcome"] for r in ok for c in r["groups"].values())
            exact = [sum(r["groups"].get(g, {}).get("outcome") == "exact" for r in ok) for g in groups]
            every = sum(all(r["groups"].get(g, {}).get("outcome") == "exact" for g in groups) for r in ok)
            label = f"**{where} (all)**" if where == lib and len(sub) > 2 else where
            row = [label, variant, len(rs), len(ok)] + exact + [every] + [cells.get(o, 0) for o in BAD]
            lines.append("| " + " | ".join(str(x) for x in row) + " |")
    return lines


def causes(results: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``[{outcome, message, cells, classes, groups}]``, most cells first."""
    by = defaultdict(lambda: {"cells": 0, "classes": [], "groups": Counter(), "variants": Counter()})
    for r in results:
        for g, c in r["groups"].items():
            if c["outcome"] == "exact":
                continue
            key = (c["outcome"], _mask(c.get("detail", "")))
            e = by[key]
            e["cells"] += 1
            e["groups"][g] += 1
            e["variants"][r["variant"]] += 1
            if r["name"] not in e["classes"]:
                e["classes"].append(r["name"])
    out = [dict(outcome=k[0], message=k[1], **v) for k, v in by.items()]
    return sorted(out, key=lambda e: -e["cells"])


def _cause_lines(cs: List[Dict[str, Any]]) -> List[str]:
    lines = ["| # | outcome | message (numbers masked) | cells | classes | groups | variants | examples |",
             "|---|---|---|---:|---:|---|---|---|"]
    for i, c in enumerate(cs, 1):
        ex = ", ".join(n.split("/", 1)[1] if "/" in n else n for n in c["classes"][:4])
        gs = ", ".join(f"{g} {n}" for g, n in c["groups"].most_common())
        vs = ", ".join(f"{v} {n}" for v, n in c["variants"].most_common())
        msg = c["message"].replace("|", "\\|")
        lines.append(f"| {i} | {c['outcome']} | {msg} | {c['cells']} | {len(c['classes'])} | {gs} | {vs} | {ex} |")
    return lines


def _ineligible_lines(results: List[Dict[str, Any]]) -> List[str]:
    by = defaultdict(list)
    for r in results:
        if r["variant"] == "direct" and r.get("ineligible"):
            by[_mask(r["ineligible"])].append(r["name"])
    lines = ["| reason (numbers masked) | classes | examples |", "|---|---:|---|"]
    for msg, ns in sorted(by.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"| {msg.replace('|', '/')} | {len(ns)} | {', '.join(n.split('/', 1)[1] for n in ns[:5])} |")
    return lines


def _cell(res, group, index):
    if res is None:
        return "-"
    if res.get("ineligible"):
        return "n/e"
    c = res["groups"].get(group)
    if c is None:
        return "-"
    if c["outcome"] == "exact":
        return "✓"
    return f"{SHORT[c['outcome']]}{index.get((c['outcome'], _mask(c.get('detail', ''))), '')}"


def _ratio(res, key):
    """A call's seconds over the plain backward's, or ``None`` where either is missing."""
    if not res or not res.get(key) or not res.get("backward_s"):
        return None
    return res[key] / res["backward_s"]


def _seconds(res, key) -> str:
    r = _ratio(res, key)
    return f"{res.get(key)}" + (f" ({r:.0f}x)" if r is not None else "")


def cost_lines(results: List[Dict[str, Any]]) -> List[str]:
    """Median and largest first- and second-call cost of the first-order extensions, as
    multiples of a plain forward + backward, per library and mapping (direct runs)."""
    lines = ["| where | classes timed | 1st call median | 1st call max | 2nd call median | 2nd call max |",
             "|---|---:|---:|---:|---:|---:|"]
    by = defaultdict(list)
    for r in results:
        if r["variant"] == "direct" and _ratio(r, "second_call_s") is not None:
            by[_where(r["name"])].append(r)
    for where, rs in sorted(by.items()):
        first = sorted(_ratio(r, "first_call_s") for r in rs)
        second = sorted(_ratio(r, "second_call_s") for r in rs)
        lines.append(f"| {where} | {len(rs)} | {first[len(first) // 2]:.0f}x | {first[-1]:.0f}x | "
                     f"{second[len(second) // 2]:.0f}x | {second[-1]:.0f}x |")
    return lines


def class_rows(results: List[Dict[str, Any]], groups: List[str], cs) -> List[str]:
    index = {(c["outcome"], c["message"]): i for i, c in enumerate(cs, 1)}
    by = defaultdict(dict)
    for r in results:
        by[r["name"]][r["variant"]] = r
    head = ["class"] + [f"{g} d\\|w" for g in groups] + ["params", "backward s", "1st call s (x)", "2nd call s (x)",
                                                           "ineligible / notes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in sorted(by):
        d, w = by[name].get("direct"), by[name].get("wrapped")
        cells = [f"{_cell(d, g, index)} \\| {_cell(w, g, index)}" for g in groups]
        first = d or w
        note = (first.get("ineligible") or first.get("notes") or "").replace("|", "/")[:140]
        times = [str(first.get("backward_s", "")), _seconds(first, "first_call_s"), _seconds(first, "second_call_s")]
        lines.append("| " + " | ".join([name] + cells + [str(first.get("params", ""))] + times + [note]) + " |")
    return lines


def write_report(path: str, meta: Dict[str, Any], results: List[Dict[str, Any]]) -> None:
    groups = meta["groups"]
    cs = causes(results)
    text = [
        "# Ecosystem sweep", "",
        f"`{meta['command']}` ({meta['date']}; {meta.get('wall_s', '?')} s; timeout {meta['timeout_s']} s per group; "
        f"versions {meta['versions']}).", "",
        *([meta["note"], ""] if meta.get("note") else []),
        "Every class a library exposes, built from a tiny config (random weights, float64, eval mode, parameters "
        "offset from their initialisation), checked against float64 brute force (`tests/oracles/zoo_checks.py`): "
        "**direct** (the library's model, dict `X` of keyword inputs, `output=`) and **wrapped** (a one-line "
        "`nn.Module` taking one tensor). Eligible: builds and runs a float64 forward and backward. Outcomes per "
        "group: exact; R refused (`CurvatureError`); W wrong (values off the oracle, or a Linear/Conv weight "
        "without two Kronecker factors); C crash (any other exception); O the oracle failed; T timeout. Cells "
        "count (class, group) pairs. Tolerance: 1e-6 relative to the largest entry for transformers and the LoRA "
        "models (norms and softmax compute in float32 inside a float64 model), 1e-8 otherwise; the JSON has "
        "each check's error.", "",
        "## Summary", "", *summary(results, groups), "",
        "## Failure causes", "", "Grouped by outcome and message; the class table's cells carry the cause's number.", "",
        *_cause_lines(cs), "",
        "## Not eligible", "", *_ineligible_lines(results), "",
        "## Cost of a call", "", "The first-order extensions (BatchGrad, BatchL2Grad, SumGradSquared, Variance) in one "
        "call, direct variant, as multiples of a plain forward + `loss.backward()` timed in the same process: the "
        "first call traces and plans, the second reuses the plan. Only classes whose backward was timed.", "",
        *cost_lines(results), "",
        "## Every class", "", "Cells: direct \\| wrapped; n/e not eligible. Call times: the first-order extensions "
        "(BatchGrad, BatchL2Grad, SumGradSquared, Variance), direct variant: a plain forward + backward, the first "
        "call (trace + plan) and the second, with their multiple of the backward.", "",
        *class_rows(results, groups, cs), "",
    ]
    with open(path, "w") as fh:
        fh.write("\n".join(text))
