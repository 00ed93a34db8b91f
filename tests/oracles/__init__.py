"""Shared models, cases, brute-force oracles and checks of the test suite (no tests here).

Test files import from here as ``from oracles.<module> import ...`` (``tests/`` is on
``sys.path``: pytest's default "prepend" import mode puts the root ``conftest.py``'s folder
there). The oracles use plain ``torch.func`` / autograd in float64, never curvlib; the
checks run curvlib and compare with them.

Oracles (no curvlib):

* ``first_order``: per-sample-copies individual gradients and first-order quantities;
* ``second_order``: GGN / Hessian blocks, per-sample blocks, loss roots, residuals,
  Kronecker factors (KFLR, KFRA) by their definitions;
* ``kron``: KFAC's expand/reduce factors from per-position offsets; KFLR over shared uses;
* ``pchmp``: positive-curvature Hessian blocks by walking a traced graph;
* ``reference``: every exact quantity of a small model in curvlib's layout, and
  ``assert_matches`` to compare a result with it;
* ``residuals``: dense per-sample residuals ``∇²_u (g · f(u))``;
* ``compose``, ``compose_kron``: the brute force of the composition matrix;
* ``zoo_reference``: loop-based references for the real-library model zoo;
* ``laplace_torch``: models, data and references of the laplace-torch backend tests.

Checks (run curvlib against the oracles):

* ``checks``: first order, GGN columns, every exact second-order quantity of one call,
  the Hessian family on any graph, the model left untouched;
* ``loss_checks``: the loss tests' checks and drawn loss-option problems;
* ``attention``: every exact extension on attention models, oracles in ``oracle_mode``;
* ``compose_cells``: one cell (model x extension x transform) of the composition matrix,
  and the refusals each cell must raise;
* ``zoo_checks``: one check per (zoo model, extension group), ``check_problem`` for any ``Problem``;
* ``ecosystem_checks``: one ecosystem-sweep case (eligibility, call times, each group's outcome).

Models and cases:

* ``cases``: hypothesis strategies and small modules shared by several test files;
* ``models``: small non-Sequential architectures (ResNet, transformer block, ...);
* ``compose_models``: the models of the composition matrix;
* ``zoo``: tiny Hugging Face / timm / torchvision models (import after ``conftest.py``,
  which installs ``torchvision_shim``);
* ``ecosystem`` (with ``ecosystem_hf``, ``ecosystem_vision``): every class of transformers' four
  auto mappings from a generically shrunk config, one timm model per family, every torchvision
  builder, PEFT LoRA and parametrized layers, direct and wrapped.

Test infrastructure and scripts:

* ``on_device``: the test device (``CURVLIB_TEST_DEVICE``) and ``seeded(seed)`` generators;
* ``compose_table``, ``zoo_checks``: report scripts, run as
  ``PYTHONPATH=src:tests python -m oracles.compose_table`` (or ``oracles.zoo_checks``).
"""
