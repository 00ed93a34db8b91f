"""The entry: ``curvature(model, lossfn, extensions)``, which runs the stages 1-7, and the ways
to run it.

- ``entry``: the transform, calling the stages below in order;
- ``chunking``: ``batch_chunk_size``: the batch in slices, results combined;
- ``compiled``: ``compile=True``: one compiled program per input signature;
- ``wrappers``: inference mode and argument unwrapping around the returned function.
"""
