"""Stage-free foundations every other folder may import (and which import nothing above them).

- ``errors``: the exception family (``CurvatureError``, ``CurvatureTypeError``);
- ``sync``: the one lock around process-wide state;
- ``settings``: the tunable sizes and switches, one frozen record (``current()``, ``override``);
- ``tensors``: facts about tensors and devices (is a value readable, may it be written in
  place, is a torch.func transform running, is a value traced, free memory);
- ``calls``: one argument of a call, by position or keyword;
- ``strategy``: how many root columns are pulled back at once, per device;
- ``inputs``, ``outputs``, ``buffers``: the call's data as users pass it;
- ``draws``, ``dropout``: random draws made explicit (Monte-Carlo vectors, masks);
- ``site``: the records the trace is made of (``Site``, ``Rule``, ``Residual``);
- ``family``: a layer family's record (``Family``): every fact the stages read of it;
- ``batch_layout``: a site's tensors in the canonical batch-first layout and back;
- ``kronlayout``: how Kronecker factors are laid out per parameter;
- ``sink``: where each first-order result goes as it is read (a sharded model's reduction).
"""
