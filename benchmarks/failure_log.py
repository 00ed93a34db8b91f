"""A pytest plugin that writes each failure's traceback to a file as it happens.

A lent GPU machine stops a command at its time limit, and pytest prints its
failures (and writes a JUnit file) only at the end of the run; with this
plugin (``-p failure_log``, the folder on ``PYTHONPATH``) the tracebacks of
the failures seen so far survive the stop. ``CURVLIB_FAILURE_LOG`` names the
file; each entry is the test's node id, its phase and the first 4000
characters of its report. Under pytest-xdist the hook runs in the controller,
so one process writes the file.
"""

import os

_LIMIT = 4000


def pytest_runtest_logreport(report):
    path = os.environ.get("CURVLIB_FAILURE_LOG")
    if not path or not report.failed:
        return
    with open(path, "a") as log:
        log.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[:_LIMIT]}\n\n")
