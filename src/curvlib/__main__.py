"""``python -m curvlib``: the self-checking demo (see :mod:`curvlib._demo`)."""

import sys

from ._demo import main

sys.exit(main(sys.argv[1:]))
