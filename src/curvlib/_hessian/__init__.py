"""Second-derivative (residual) terms of the Hessian, used while a graph is interpreted.

- ``residuals``: which nonlinear nodes contribute ``∂²f`` terms, recorded per call;
- ``algebra``: their per-sample algebra (signed columns, dense blocks);
- ``structured``, ``norm``, ``smooth``: factored terms of attention, normalisations and
  derivatives taken through results.
"""
