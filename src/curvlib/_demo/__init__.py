"""``python -m curvlib``: the self-checking demo (``main``), its problem, command line and figure."""
