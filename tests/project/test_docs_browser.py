"""The built site as a browser shows it: docs/browser_check.py on an existing browser build.

``python docs/browser_check.py`` builds the site with MathJax served locally (the machines that
check it have no CDN) and opens its key pages in headless Chromium at 1400 px: formulas typeset,
nothing cut off at the article's right edge, figures loaded, in-page anchors, previous/next
links, the gallery's thumbnails. This test re-runs those checks on the build that command left in
docs/_build/browser; it skips without that build, without Chromium or without playwright (CI
has none of them: tests/project/test_docs_site.py's structural checks run there).
"""

import importlib.util
import os
import shutil
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.path.join(ROOT, "docs", "_build", "browser")


def test_pages_in_a_browser(tmp_path):
    if not os.path.exists(os.path.join(BUILD, "index.html")):
        pytest.skip("no browser build: python docs/browser_check.py")
    if importlib.util.find_spec("playwright") is None or not shutil.which("chromium"):
        pytest.skip("needs playwright and Chromium (apt-get install chromium)")
    sys.path.insert(0, os.path.join(ROOT, "docs"))
    try:
        import browser_check
    finally:
        sys.path.pop(0)
    assert browser_check.main(["--no-build", "--html", BUILD, "--out", str(tmp_path)]) == 0, \
        open(tmp_path / "report.md", encoding="utf-8").read()
