"""Stage 1, trace (:mod:`curvlib._transform.entry` numbers the stages): a model becomes a
:class:`~curvlib._trace.program.Program` (a graph plus a table of parametrized sites).

- ``program``: torch.fx front end, one node per layer a rule knows (``tracer``: its leaves);
- ``layer``: a layer of the trace (``Layer``), its family's record at hand;
- ``modes``: grad mode, autocast and in-place assignments of the traced code, on the nodes;
- ``aten``, ``aten_ops``: the ATen-level front end for model code torch.fx cannot follow;
- ``branches``: value-dependent branches of an ATen trace, checked per group of samples;
- ``untraced``: running a model that no front end can trace, eagerly, for first order.
"""
