"""``python -m curvlib``: the self-checking demo (see :mod:`curvlib._demo.main`)."""

import sys

from ._demo.main import main

sys.exit(main(sys.argv[1:]))
