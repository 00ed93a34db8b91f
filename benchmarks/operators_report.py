"""The markdown of ``operators.py``'s results: products, eigenvalues, traces (one table each)."""

from __future__ import annotations


def _f(x, fmt=".2f") -> str:
    return "" if x is None else format(x, fmt)


def products_table(rows: dict) -> list:
    lines = ["| problem | method | time / backward | ms | call's peak / backward's | call's peak (MiB) "
             "| held by set-up (MiB) | first call (s) | vs curvlib |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for problem, r in rows.items():
        memory, timing = r["memory"], r["time"]
        ref = memory.get("backward", {}).get("call_above_mib")
        methods = list(dict.fromkeys(list(memory) + list(timing.get("ms", {})) + list(timing.get("errors", {}))))
        for m in methods:
            mem = memory.get(m, {})
            error = mem.get("error") or timing.get("errors", {}).get(m)
            if error and m not in timing.get("ms", {}):
                lines.append(f"| {problem} | `{m}` | failed: {error[:200]} | | | | | | |")
                continue
            peak = mem.get("call_above_mib")
            agree = timing.get("agree", {}).get(m)
            agree_cell = "" if agree is None else f"{'ok' if agree < 1e-3 else 'differs'} ({agree:.1e})"
            lines.append(
                f"| {problem} | `{m}` | {_f(timing.get('ratio', {}).get(m))} | {_f(timing.get('ms', {}).get(m), '.1f')} | "
                f"{'' if peak is None or not ref else f'{peak / ref:.2f}'} | {_f(peak, '.0f')} | "
                f"{_f(mem.get('setup_above_mib'), '.0f')} | {_f(timing.get('first_s', {}).get(m))} | {agree_cell} |")
    return lines


def spectral_tables(rows: dict) -> list:
    eig = ["| problem | matrix | method | products | time / backward | relative error | reached | set-up (s) |",
           "|---|---|---|---:|---:|---:|---|---:|"]
    tr = ["| problem | matrix | method | products | time / backward | mean relative error | set-up (s) |",
          "|---|---|---|---:|---:|---:|---:|"]
    for problem, r in rows.items():
        if "error" in r:
            eig.append(f"| {problem} | | failed: {r['error'][:200]} | | | | | |")
            continue
        bw = r["backward_s"]
        for kind, k in r["kinds"].items():
            setup = k.get("setup_s", {})
            ref = k.get("eigen_reference")
            if ref:
                eig.append(f"| {problem} | {kind} | reference: ARPACK, tol 1e-9: λ = {ref['value']:.6g} | "
                           f"{ref['matvecs']} | {ref['s'] / bw:.1f} | | | |")
            for m, e in k["eigen"].items():
                if "error" in e:
                    eig.append(f"| {problem} | {kind} | `{m}` | failed: {e['error'][:160]} | | | | |")
                    continue
                eig.append(f"| {problem} | {kind} | `{m}` | {e['matvecs']} | {e['s'] / bw:.1f} | "
                           f"{e['rel_error']:.1e} | {'yes' if e['rel_error'] <= r.get('eig_tol', 1e-3) else 'no'} | "
                           f"{_f(setup.get(m.split(':')[0]))} |")
            if "trace_exact" in k:
                tr.append(f"| {problem} | {kind} | exact (sum of the diagonal): {k['trace_exact']:.6g} | | | | |")
            for m, e in k["trace"].items():
                if "error" in e:
                    tr.append(f"| {problem} | {kind} | `{m}` | failed: {e['error'][:160]} | | | |")
                    continue
                tr.append(f"| {problem} | {kind} | `{m}` | {e['matvecs']} | {e['s'] / bw:.1f} | {e['rel_error']:.1e} | "
                          f"{_f(setup.get(m.split(':')[0]))} |")
    return eig, tr


def report(meta: dict, rows: dict) -> str:
    args = meta["args"]
    head = [f"# Operators against their peers ({args['device']}, {args['threads']} thread(s))", "",
            f"`python benchmarks/operators.py` with {', '.join(f'--{k.replace(chr(95), chr(45))} {v}' for k, v in args.items() if k in ('problems', 'spectral_problems', 'rounds', 'gpt_n', 'gpt_t', 'eig_tol', 'trace_matvecs', 'trace_seeds', 'quick'))}; "
            f"torch {meta['torch']}, load average at the end {', '.join(f'{x:.1f}' for x in meta['load'])}, "
            f"{meta['seconds'] / 60:.1f} min.", ""]
    if meta.get("malloc_mmap_threshold"):
        head += [f"Under `MALLOC_MMAP_THRESHOLD_={meta['malloc_mmap_threshold']}`: glibc maps every allocation above "
                 "it on its own and unmaps it when freed, so a peak counts the memory allocated then, not freed "
                 "heap pages kept resident (glibc's default raises the threshold as blocks are freed).", ""]
    out = head
    if rows["products"]:
        out += ["## Products `A @ v`", ""] + products_table(rows["products"]) + [""]
    if rows["spectral"]:
        for r in rows["spectral"].values():
            r["eig_tol"] = args["eig_tol"]
        eig, tr = spectral_tables(rows["spectral"])
        out += [f"## Largest eigenvalue, target relative error {args['eig_tol']:g}", ""] + eig + [""]
        out += [f"## Trace, {args['trace_matvecs']} products each", ""] + tr + [""]
    return "\n".join(out)
