"""The built site in a real browser: headless Chromium (Debian's ``chromium``) driven by
Playwright, loading the site from a local server on 127.0.0.1.

For the home page and one chapter in each language it takes a screenshot (under
``_build/screenshots/``), checks that every image has loaded and every internal link
answers, follows the language switch, and asks Chromium which fonts it used for the
Chinese headings. A search for a Chinese word must find pages.

Without Chromium the tests skip and say how to install it — unless
``DPBOOK_REQUIRE_BROWSER=1`` (set by ``.ci/run``), which turns the skip into a failure.
"""
from __future__ import annotations

import os
import re
import shutil
import urllib.error
import urllib.request
from urllib.parse import urldefrag

import pytest

from book import ROOT
from helpers import serve_folder

SCREENSHOTS = ROOT / "_build" / "screenshots"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu",
                  "--disable-background-networking", "--disable-component-update",
                  "--no-first-run"]
PAGES = {   # name: (path on the site, language of the page)
    "en-home": ("index.html", "en"),
    "en-from-scratch-pytorch": ("chapters/en/from-scratch/pytorch.html", "en"),
    "zh-home": ("zh/index.html", "zh-CN"),
    "zh-from-scratch-pytorch": ("zh/chapters/zh/from-scratch/pytorch.html", "zh-CN"),
}


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path:
        return path
    reason = ("headless Chromium is not installed: `apt-get install chromium "
              "fonts-noto-cjk` (Debian/Ubuntu; .ci/run does this)")
    if os.environ.get("DPBOOK_REQUIRE_BROWSER") == "1":
        pytest.fail(reason + " — and DPBOOK_REQUIRE_BROWSER=1 requires it")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def server(site):
    """The site, served over HTTP on a free port of 127.0.0.1."""
    with serve_folder(site) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    executable = _chromium()
    try:
        import playwright.sync_api as playwright_api
    except ImportError:
        why = "pip install playwright (requirements.txt)"
        if os.environ.get("DPBOOK_REQUIRE_BROWSER") == "1":
            pytest.fail(why + "; DPBOOK_REQUIRE_BROWSER=1 forbids skipping", pytrace=False)
        pytest.skip(why)
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    yield page
    context.close()
    assert not errors, f"JavaScript errors: {errors}"


def _open(page, server: str, path: str):
    """Go to ``path``; the site's root pages redirect to the edition's first chapter."""
    response = page.goto(server + path, wait_until="load")
    assert response is not None and response.ok, path
    if path.endswith("index.html") and "chapters/" not in path:
        page.wait_for_url(re.compile(r".*/chapters/(en|zh)/index\.html$"))
        page.wait_for_load_state("load")
    return response


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.parametrize("name", list(PAGES))
def test_page_renders_with_working_links_and_images(server, page, name):
    path, lang = PAGES[name]
    _open(page, server, path)
    assert page.locator("html").get_attribute("lang") == lang
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)

    images = page.eval_on_selector_all(
        "img", "els => els.map(e => [e.currentSrc || e.src, e.complete && e.naturalWidth > 0])")
    assert all(ok for _, ok in images), [src for src, ok in images if not ok]
    if "from-scratch" in name:      # the chapter's figure and its learning curves
        assert any("data-parallel-step" in src for src, _ in images)
        assert sum(src.endswith(".svg") for src, _ in images) >= 2

    hrefs = page.eval_on_selector_all("a[href]", "els => els.map(e => e.href)")
    internal = {urldefrag(h)[0] for h in hrefs if h.startswith(server)}
    assert internal
    broken = [h for h in sorted(internal) if _status(h) != 200]
    assert not broken, f"{name}: broken links {broken}"


@pytest.mark.parametrize("name", list(PAGES))
def test_language_switch_leads_to_the_same_page(server, page, name):
    path, lang = PAGES[name]
    _open(page, server, path)
    switch = page.locator("a.dpbook-lang-switch")
    assert switch.count() == 1
    switch.click()
    page.wait_for_load_state("load")
    other = "en" if lang.startswith("zh") else "zh-CN"
    assert page.locator("html").get_attribute("lang") == other
    here = page.url[len(server):]
    expected = (path.replace("zh/chapters/zh/", "chapters/en/") if lang.startswith("zh")
                else "zh/" + path.replace("chapters/en/", "chapters/zh/"))
    if path.endswith("index.html") and "chapters" not in path:   # the root redirects
        expected = ("chapters/en/index.html" if lang.startswith("zh")
                    else "zh/chapters/zh/index.html")
    assert here == expected


def _fonts_of(page, selector: str) -> dict[str, int]:
    """The platform fonts Chromium used to draw the text of ``selector``: name → glyphs."""
    cdp = page.context.new_cdp_session(page)
    cdp.send("DOM.enable")
    cdp.send("CSS.enable")
    root = cdp.send("DOM.getDocument")["root"]["nodeId"]
    node = cdp.send("DOM.querySelector", {"nodeId": root, "selector": selector})["nodeId"]
    assert node, f"{selector} not found"
    fonts = cdp.send("CSS.getPlatformFontsForNode", {"nodeId": node})["fonts"]
    return {f["familyName"]: f["glyphCount"] for f in fonts}


@pytest.mark.parametrize("name", ["zh-home", "zh-from-scratch-pytorch"])
def test_chinese_text_renders_with_a_cjk_font(server, page, name):
    _open(page, server, PAGES[name][0])
    text = page.locator("main p").first.inner_text()
    assert sum("\u4e00" <= ch <= "\u9fff" for ch in text) >= 10, text
    fonts = _fonts_of(page, "main p")
    cjk = {f: n for f, n in fonts.items() if "CJK" in f or "Han" in f or "Hei" in f}
    assert cjk, f"no CJK font drew {text[:40]!r}: {fonts} (install fonts-noto-cjk)"
    assert sum(cjk.values()) >= 10     # the Chinese characters, not a stray symbol


def test_chinese_search_finds_pages(server, page):
    page.goto(server + "zh/search.html?q=数据并行", wait_until="load")
    results = page.locator("#search-results ul.search li")
    results.first.wait_for(timeout=20_000)
    links = results.locator("a").evaluate_all("els => els.map(e => e.href)")
    assert links and all(link.startswith(server + "zh/chapters/zh/") for link in links), links
    assert all(_status(urldefrag(link)[0]) == 200 for link in links)
