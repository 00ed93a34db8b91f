"""Stage 5, the entry: ``curvature(model, lossfn, extensions)`` and the ways to run it.

- ``entry``: the transform, calling the stages below in order;
- ``chunking``: ``batch_chunk_size``: the batch in slices, results combined;
- ``compiled``: ``compile=True``: one compiled program per input signature;
- ``wrappers``: inference mode and argument unwrapping around the returned function.
"""
