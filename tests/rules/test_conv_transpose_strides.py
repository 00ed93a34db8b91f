"""A transposed convolution read as a function in ``forward``, on an input whose strides are
row-major but for its size-one dims.

LowFormer's attention (timm) upsamples ``values.permute(0, 1, 3, 2).reshape(N, C, h, w)`` with
an ``nn.ConvTranspose2d``; at ``h = w = 1`` the reshape is a view with strides ``(C, 1, C, C)``
(``is_contiguous()`` holds, so ``Tensor.contiguous`` keeps them). The layer is a generic
functional site on the ATen front end, whose individual gradients are the node's
vector-Jacobian product vmapped over the samples; torch's (2.13) batching rule of the
transposed convolution's backward then raised ``RuntimeError: grad_weight needs to be
contiguous`` on such an input. Curvlib hands its per-sample maps inputs with row-major strides
(``curvlib._core.tensors.dense``). Checked with hypothesis over the dims, the sizes, the
stride and padding, and the spelling of the layer, against the brute-force oracles (first
order and GGN).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import curvature

from oracles.on_device import seeded
from oracles.reference import assert_matches, exact_extensions, reference

DT = torch.float64
CONV_T = {1: (nn.ConvTranspose1d, F.conv_transpose1d), 2: (nn.ConvTranspose2d, F.conv_transpose2d)}


class TokensUp(nn.Module):
    """``head(up(tokens))``: ``[N, 1, c_in]`` tokens as ``[N, c_in, 1(, 1)]`` by a transpose and
    a reshape (strides ``(c_in, 1, c_in(, c_in))``), upsampled by a transposed convolution called
    as its module or as ``F.conv_transposeNd`` on its parameters (``functional``)."""

    def __init__(self, d: int, c_in: int, c_out: int, k: int, stride: int, padding: int, functional: bool):
        super().__init__()
        self.d, self.functional, self.conv_args = d, functional, (stride, padding)
        self.lin = nn.Linear(3, c_in)
        self.up = CONV_T[d][0](c_in, c_out, k, stride=stride, padding=padding)
        out = (1 - 1) * stride - 2 * padding + k
        self.head = nn.Linear(c_out * out**d, 3)

    def forward(self, x):
        h = self.lin(x).transpose(1, 2)
        h = h.reshape(h.shape[0], h.shape[1], *(1,) * self.d)
        if self.functional:
            h = CONV_T[self.d][1](h, self.up.weight, self.up.bias, *self.conv_args)
        else:
            h = self.up(h)
        return self.head(torch.tanh(h).flatten(1))


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 3), d=st.sampled_from([1, 2]), c_in=st.integers(1, 4), c_out=st.integers(1, 3),
       k_stride_pad=st.sampled_from([(4, 2, 1), (3, 1, 1), (2, 2, 0), (3, 2, 0)]), functional=st.booleans(),
       seed=st.integers(0, 2**16))
def test_transposed_conv_on_size_one_strides_is_exact(n, d, c_in, c_out, k_stride_pad, functional, seed):
    torch.manual_seed(seed)
    model = TokensUp(d, c_in, c_out, *k_stride_pad, functional).to(DT)
    g = seeded(seed)
    X, y = torch.randn(n, 1, 3, generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g)
    lossfn = nn.CrossEntropyLoss()
    qs = curvature(model, lossfn, exact_extensions(hessian=False))(X, y)
    ref = reference(model, lossfn, X, y, hessian=False)
    assert_matches(qs, ref, f"n={n} d={d} c_in={c_in} c_out={c_out} k/s/p={k_stride_pad} functional={functional}")
