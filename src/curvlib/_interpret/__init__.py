"""Interpret: run a traced program node by node, on fake tensors for stage 3 (plan), on real
ones for stage 4 (forward; :mod:`curvlib._transform.entry` numbers the stages).

- ``graph``: the interpreter (sites recorded, probes added, residuals tapped);
- ``diagnose``: why a forward failed on ``X``, naming the node.
"""
