"""Open the built site in a real browser and check what a reader sees.

    python docs/browser_check.py [--mathjax DIR] [--out DIR] [--no-build] [--shots N ...]

The site is built (``-W``) into ``docs/_build/browser`` with MathJax served from the site
itself (``mathjax_path`` and ``html_static_path`` given on Sphinx's command line; docs/conf.py
is unchanged, and the published site keeps loading MathJax from its CDN), then each page of
``PAGES`` is opened in headless Chromium at 1400 px and checked in the rendered page:

* math: every formula MyST wrote (``span.math``, ``div.math``) typeset by MathJax, no
  ``merror`` (a TeX error);
* layout: no horizontal scroll of the page, nothing in the article (table, figure, formula)
  reaching past the article's right edge unless inside a box that scrolls;
* figures: every image loaded, and its shown width against its own (a figure shown below
  60 % of its size is listed: its text shrinks with it);
* links inside the page (``#anchor``) point at an element that exists; previous/next links.

A screenshot of each page's first 1400 x 900 pixels (an example's: around its figure) goes to
``--out`` (default ``docs/_build/browser-check``), with ``report.md``. Exit status 1 when a
check fails.

Needs Chromium (Debian: ``apt-get install chromium``), the ``playwright`` Python package (its
own browser download is not used: ``/usr/bin/chromium`` is launched) and MathJax 3's ``es5``
folder: ``--mathjax`` names an unpacked ``npm pack mathjax@3`` (its ``package`` folder), or
the script packs one itself with ``npm`` into the output folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile

DOCS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(DOCS)

# page (under the site's root, without .html) -> what it is checked for beyond the common checks
PAGES = {
    "index": "",
    "get-started": "",
    "conventions": "math",
    "supported-models": "",
    "operators": "math",
    "influence": "math",
    "many-devices": "math",
    "api/curvlib.curvature": "math",
    "api/curvlib.extensions.KFAC": "math",
    "api/curvlib.operators.xtrace": "math",
    "examples/index": "gallery",
    "examples/noise_monitor": "figure",
    "examples/ddp_curvature": "figure",
}

WIDTH, HEIGHT = 1400, 900
SHRUNK = 0.6  # a figure shown below this fraction of its width is listed

# Runs in the page: what the checks read. Returns a dict (see check_page).
MEASURE = r"""
() => {
  const article = document.querySelector("article") || document.body;
  // the article's right edge; Furo's table boxes stand a few pixels out of it (their shadow)
  const right = article.getBoundingClientRect().right, slack = 12;
  const scrolls = (el) => {
    for (let a = el.parentElement; a && a !== article.parentElement; a = a.parentElement) {
      const o = getComputedStyle(a).overflowX;
      if ((o === "auto" || o === "scroll") && a.getBoundingClientRect().right <= right + slack) return true;
    }
    return false;
  };
  const label = (el) => (el.tagName.toLowerCase() + (el.className && typeof el.className === "string" ? "." +
    el.className.trim().split(/\s+/).join(".") : "") + ": " + (el.textContent || el.getAttribute("src") || "")
    .trim().replace(/\s+/g, " ").slice(0, 60));
  const formulas = [...article.querySelectorAll("span.math, div.math")];
  const wide = [];
  for (const el of article.querySelectorAll("table, img, pre, mjx-container, .highlight")) {
    if (el.getBoundingClientRect().right > right + slack && !scrolls(el)) wide.push(label(el));
  }
  const images = [...article.querySelectorAll("img")].map((img) => ({
    src: img.getAttribute("src"), loaded: img.complete && img.naturalWidth > 0,
    natural: img.naturalWidth, shown: Math.round(img.getBoundingClientRect().width)}));
  const anchors = [...article.querySelectorAll('a[href^="#"]')].map((a) => decodeURIComponent(a.getAttribute("href").slice(1)))
    .filter((id) => id && !document.getElementById(id));
  return {
    title: document.title,
    page_scrolls: document.documentElement.scrollWidth > window.innerWidth,
    formulas: formulas.length,
    typeset: formulas.filter((el) => el.querySelector("mjx-container")).length,
    tex_errors: [...article.querySelectorAll("mjx-merror")].map((e) => e.textContent.slice(0, 60)),
    wide: wide,
    images: images,
    missing_anchors: [...new Set(anchors)],
    tables_scrolling: [...article.querySelectorAll("table")].filter((t) => t.getBoundingClientRect().right > right + slack).length,
    code_blocks_scrolling: [...article.querySelectorAll("pre")].filter((p) => p.scrollWidth > p.clientWidth + 1).length,
    prev_next: !!document.querySelector(".prev-page, .next-page"),
    gallery_cards: article.querySelectorAll(".curvlib-gallery a.curvlib-card img").length,
  };
}
"""


def mathjax_folder(given: str | None, work: str) -> str:
    """MathJax 3's ``es5`` folder: from ``given`` (an unpacked npm package) or ``npm pack mathjax@3``."""
    if given:
        es5 = given if os.path.exists(os.path.join(given, "tex-mml-chtml.js")) else os.path.join(given, "es5")
    else:
        os.makedirs(work, exist_ok=True)
        name = subprocess.run(["npm", "pack", "mathjax@3", "--pack-destination", work], check=True,
                              capture_output=True, text=True).stdout.strip().splitlines()[-1]
        with tarfile.open(os.path.join(work, name)) as tar:
            tar.extractall(work, filter="data")
        es5 = os.path.join(work, "package", "es5")
    if not os.path.exists(os.path.join(es5, "tex-mml-chtml.js")):
        sys.exit(f"no tex-mml-chtml.js in {es5}: pass --mathjax with an unpacked mathjax@3 package")
    return es5


def build(html: str, es5: str, stage: str) -> None:
    """The site, warning-free, with MathJax copied into its ``_static/mathjax``."""
    target = os.path.join(stage, "mathjax")
    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(os.path.join(target, "output", "chtml", "fonts"))
    shutil.copy(os.path.join(es5, "tex-mml-chtml.js"), target)
    shutil.copytree(os.path.join(es5, "output", "chtml", "fonts", "woff-v2"),
                    os.path.join(target, "output", "chtml", "fonts", "woff-v2"))
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    # -E: read every page again (autodoc does not see a docstring change as a change of the page)
    subprocess.run([sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-q", "-b", "html",
                    "-D", "mathjax_path=mathjax/tex-mml-chtml.js",
                    "-D", f"html_static_path=_static,{stage}", "docs", html], cwd=ROOT, env=env, check=True)


def check_page(page, url: str, kind: str, shot: str | None) -> tuple[dict, list[str]]:
    """Open ``url``, wait for MathJax, measure; the measures and the failures."""
    page.goto(url)
    page.wait_for_load_state("load")
    page.evaluate("() => window.MathJax && MathJax.startup ? MathJax.startup.promise.then(() => true) : true")
    page.wait_for_timeout(300)  # fonts applied after typesetting
    m = page.evaluate(MEASURE)
    problems = []
    if m["typeset"] < m["formulas"]:
        problems.append(f"{m['formulas'] - m['typeset']} of {m['formulas']} formulas not typeset")
    if kind == "math" and m["formulas"] == 0:
        problems.append("no formula on a formula page")
    problems += [f"TeX error: {e}" for e in m["tex_errors"]]
    if m["page_scrolls"]:
        problems.append("the page scrolls sideways")
    problems += [f"past the right edge: {w}" for w in m["wide"]]
    problems += [f"image not loaded: {i['src']}" for i in m["images"] if not i["loaded"]]
    problems += [f"link to a missing anchor: #{a}" for a in m["missing_anchors"]]
    if not m["prev_next"]:
        problems.append("no previous/next links")
    if kind == "gallery" and m["gallery_cards"] == 0:
        problems.append("no gallery thumbnails")
    if kind == "figure" and not any(i["loaded"] for i in m["images"]):
        problems.append("no figure")
    if shot:
        if kind == "figure" and m["images"]:  # the figure in view, as a reader scrolling to it sees it
            page.locator("article img").first.scroll_into_view_if_needed()
        page.screenshot(path=shot)
    return m, problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mathjax", help="an unpacked mathjax@3 npm package (or its es5 folder)")
    ap.add_argument("--html", default=os.path.join(DOCS, "_build", "browser"), help="where the site is built")
    ap.add_argument("--out", default=os.path.join(DOCS, "_build", "browser-check"), help="screenshots and report")
    ap.add_argument("--no-build", action="store_true", help="check the site already in --html")
    ap.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = ap.parse_args(argv)

    from playwright.sync_api import sync_playwright

    os.makedirs(args.out, exist_ok=True)
    if not args.no_build:
        es5 = mathjax_folder(args.mathjax, os.path.join(args.out, "mathjax-npm"))
        build(args.html, es5, os.path.join(args.out, "static"))
    results, failed = {}, 0
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
        tab = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
        for name, kind in PAGES.items():
            url = "file://" + os.path.join(os.path.abspath(args.html), name + ".html")
            shot = os.path.join(args.out, name.replace("/", "--") + ".png")
            m, problems = check_page(tab, url, kind, shot)
            shrunk = [f"{i['src']} at {i['shown'] / i['natural']:.0%}" for i in m["images"]
                      if i["loaded"] and i["natural"] > 0 and i["shown"] / i["natural"] < SHRUNK and kind == "figure"]
            results[name] = dict(m, problems=problems, shrunk=shrunk)
            failed += bool(problems)
            print(f"{'FAIL' if problems else 'ok  '} {name}: {m['typeset']}/{m['formulas']} formulas typeset, "
                  f"{len(m['images'])} images, {m['tables_scrolling']} tables and {m['code_blocks_scrolling']} code blocks scroll"
                  + "".join(f"\n     {p}" for p in problems + [f"shrunk: {s}" for s in shrunk]))
        browser.close()
    with open(os.path.join(args.out, "report.json"), "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=1)
    lines = ["| page | formulas typeset | images | tables / code blocks that scroll | problems |",
             "|---|---|---|---|---|"]
    lines += [f"| {n} | {r['typeset']}/{r['formulas']} | {len(r['images'])} | "
              f"{r['tables_scrolling']} / {r['code_blocks_scrolling']} | "
              f"{'; '.join(r['problems'] + r['shrunk']) or 'none'} |" for n, r in results.items()]
    with open(os.path.join(args.out, "report.md"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
    print(f"{len(PAGES) - failed} of {len(PAGES)} pages pass; screenshots and report.md in {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
