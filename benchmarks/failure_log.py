"""A pytest plugin that writes each failure's traceback to a file as it happens.

A lent GPU machine stops a command at its time limit, and pytest prints its
failures (and writes a JUnit file) only at the end of the run; with this
plugin (``-p failure_log``, the folder on ``PYTHONPATH``) the tracebacks of
the failures seen so far survive the stop. ``CURVLIB_FAILURE_LOG`` names the
file; each entry is the test's node id, its phase, the first 1000
characters of its report and its last 4000 (where the error is). Under
pytest-xdist the workers report to the controller, which alone writes.
"""

import os

_HEAD, _TAIL = 1000, 4000
_worker = False


def pytest_configure(config):
    global _worker
    _worker = hasattr(config, "workerinput")


def pytest_runtest_logreport(report):
    path = os.environ.get("CURVLIB_FAILURE_LOG")
    if not path or not report.failed or _worker:
        return
    text = report.longreprtext
    if len(text) > _HEAD + _TAIL:
        text = f"{text[:_HEAD]}\n[...]\n{text[-_TAIL:]}"
    with open(path, "a") as log:
        log.write(f"=== {report.nodeid} ({report.when})\n{text}\n\n")
