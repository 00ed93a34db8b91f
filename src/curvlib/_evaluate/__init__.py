"""Stages 4-7 (:mod:`curvlib._transform.entry`), evaluate: linearise one forward pass and read
the quantities off it.

- ``linearise``: the forward with probes and its pullbacks;
- ``first_order``: the gradient and first-order quantities from the sites' output gradients;
- ``second_order``, ``root_buffers``: GGN/Hessian diagonals, square roots and Kronecker factors;
- ``products``: block curvature-matrix products (``GGNMP``, ``HMP``, ``PCHMP``);
- ``kfra``: KFRA's batch-averaged recursion.
"""
