"""conftest.py for laplace-torch's own test suite run with curvlib's backends.

Copied next to the extracted tests by ``run_suite.py`` (never collected by
curvlib's own ``pytest``). It

* names parametrized classes by ``__name__`` (``backend=CurvlibGGN``, not
  ``backend3``), so that curvlib's cases can be picked out of the report;
* stands in for ``pytest-mock``'s ``mocker`` when it is not installed
  (``run_suite.py`` replaces missing torchvision models by skips);
* with ``CURVLIB_SUITE_BYPASS_WHITELIST=1``, lets curvlib's backends through
  ``FunctionalLaplace``'s ``assert backend in [BackPackGGN, AsdlGGN,
  CurvlinopsGGN]`` (constructed with CurvlinopsGGN, then switched).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import unittest.mock

import pytest


def pytest_make_parametrize_id(config, val, argname):
    if isinstance(val, type):
        return val.__name__
    return None


if importlib.util.find_spec("pytest_mock") is None:

    class _Mocker:
        def __init__(self):
            self._patches = []

        def patch(self, target, *args, **kwargs):
            p = unittest.mock.patch(target, *args, **kwargs)
            self._patches.append(p)
            return p.start()

        def stopall(self):
            for p in reversed(self._patches):
                p.stop()

    @pytest.fixture
    def mocker():
        m = _Mocker()
        yield m
        m.stopall()


if os.environ.get("CURVLIB_SUITE_BYPASS_WHITELIST") == "1":
    import laplace.baselaplace as _bl
    from laplace.curvature import CurvlinopsGGN

    from curvlib.laplace import CurvlibInterface

    _original_init = _bl.FunctionalLaplace.__init__
    _signature = inspect.signature(_original_init)

    def _init(self, *args, **kwargs):
        bound = _signature.bind(self, *args, **kwargs)
        backend = bound.arguments.get("backend")
        if isinstance(backend, type) and issubclass(backend, CurvlibInterface):
            bound.arguments["backend"] = CurvlinopsGGN
            _original_init(*bound.args, **bound.kwargs)
            self._backend_cls, self._backend = backend, None
        else:
            _original_init(*bound.args, **bound.kwargs)

    _bl.FunctionalLaplace.__init__ = _init
