"""Stage 2, interpret: run a traced program node by node on real or fake tensors.

- ``graph``: the interpreter (sites recorded, probes added, residuals tapped);
- ``diagnose``: why a forward failed on ``X``, naming the node.
"""
