"""Stages 1 and 3 (:mod:`curvlib._transform.entry`): the trace's refusals, and the plan:
everything decided once per input signature, before any real work.

- ``arguments``: checks of ``curvature``'s and ``f``'s arguments;
- ``traces``: one trace per ``training`` flags and input structure, and its refusals;
- ``plan``: shapes, batch dimensions and per-site checks from fake runs;
- ``independence``, ``mixing_*``: where samples mix inside the model (``mixing_refusals``: the
  refusal and its message);
- ``batch_merges``, ``unmerge``, ``merged_modules``: the batch merged with windows or heads, split
  off (which nodes; the graph rewrites);
- ``support``, ``budget``: refusals of extensions and memory the call would need.
"""
