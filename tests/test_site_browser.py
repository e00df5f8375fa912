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

pytestmark = pytest.mark.site     # a browser on the built site (make test-fast skips it)

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


@pytest.mark.parametrize("query, chapter", [("数据并行", None),
                                            ("全归约", "communication/allreduce"),
                                            ("梯度累加", "inside-ddp/accumulation")])
def test_chinese_search_finds_pages(server, page, query, chapter):
    page.goto(server + f"zh/search.html?q={query}", wait_until="load")
    results = page.locator("#search-results ul.search li")
    results.first.wait_for(timeout=20_000)
    links = results.locator("a").evaluate_all("els => els.map(e => e.href)")
    assert links and all(link.startswith(server + "zh/chapters/zh/") for link in links), links
    assert all(_status(urldefrag(link)[0]) == 200 for link in links)
    if chapter:    # a term jieba alone would cut in two (全 + 归约) finds its chapter
        assert any(f"/chapters/zh/{chapter}.html" in link for link in links), links


# ---------------------------------------------------------------- interactive widgets

WIDGET_PAGES = {"en": "chapters/en/communication/allreduce.html",
                "zh": "zh/chapters/zh/communication/allreduce.html"}


def _widget_data(page, name: str) -> dict:
    return page.locator(f'.dpbook-widget[data-widget="{name}"] script[type="application/json"]'
                        ).evaluate("e => JSON.parse(e.textContent)")


@pytest.mark.parametrize("lang", list(WIDGET_PAGES))
def test_widgets_mount_in_the_editions_language(server, page, lang):
    """Both widgets of the communication page mount, hide their static fallback, label
    their controls in the edition's language, and get a screenshot each."""
    _open(page, server, WIDGET_PAGES[lang])
    widgets = page.locator(".dpbook-widget.dpbook-widget-mounted")
    widgets.first.wait_for()
    assert widgets.count() == 2
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    for name in ("alpha-beta", "ring-replay"):
        widget = page.locator(f'.dpbook-widget[data-widget="{name}"]')
        assert widget.get_attribute("data-lang") == lang
        assert not widget.locator(".dpbook-widget-fallback").is_visible()
        widget.scroll_into_view_if_needed()
        widget.screenshot(path=str(SCREENSHOTS / f"{lang}-widget-{name}.png"))
    text = page.locator('.dpbook-widget[data-widget="alpha-beta"]').inner_text()
    assert ("链路" in text and "总线带宽" in text) if lang == "zh" else (
        "link" in text and "bus bandwidth" in text)
    assert page.locator('.dpbook-widget[data-widget="alpha-beta"] polyline').count() == 3


@pytest.mark.parametrize("lang", list(WIDGET_PAGES))
def test_calculator_agrees_with_the_cost_model(server, page, lang):
    """The page's formulas equal dpbook.costmodel's at test points, and the preset "this
    machine" holds the values the page prints from the same fit."""
    from dpbook import costmodel
    _open(page, server, WIDGET_PAGES[lang])
    points = [(a, n, N, alpha, beta) for a in costmodel.ALGORITHMS for n in (1, 1e3, 2**20, 3e9)
              for N in (1, 2, 3, 4, 8, 1000) for alpha, beta in ((1e-5, 1e-9), (0, 3e-11), (5e-6, 0))]
    js = page.evaluate("points => points.map(p => window.dpbookWidgets.model.predict(...p))",
                       points)
    for p, value in zip(points, js):
        assert value == pytest.approx(costmodel.predict(*p), rel=1e-12, abs=1e-300), p
    for N in (2, 3, 4, 8, 1000):
        assert page.evaluate("N => window.dpbookWidgets.model.coefficients('ring', N)", N) == \
            pytest.approx(list(costmodel.coefficients("ring", N)))
        assert page.evaluate("args => window.dpbookWidgets.model.busBandwidth(...args)",
                             [2**24, 0.01, N]) == pytest.approx(
            costmodel.bus_bandwidth(2**24, 0.01, N))

    data = _widget_data(page, "alpha-beta")
    prose = page.locator("main").inner_text()
    assert f"α = {data['alpha'] * 1e6:.1f} µs" in prose
    assert f"1/β = {1 / data['beta'] / 1e9:.2f} GB/s" in prose
    widget = page.locator('.dpbook-widget[data-widget="alpha-beta"] .dpbook-widget-live')
    preset = widget.locator('select[data-role="preset"]')
    assert preset.input_value() == "machine"
    assert float(widget.get_attribute("data-alpha")) == data["alpha"]
    assert float(widget.get_attribute("data-beta")) == data["beta"]
    preset.select_option("NVLink (H100, 18 links)")            # a link's β, the reader's α
    assert float(widget.get_attribute("data-beta")) == pytest.approx(1 / 450e9)
    assert float(widget.get_attribute("data-alpha")) == data["alpha"]
    widget.locator('input[data-role="devices"]').fill("8")
    widget.locator('input[data-role="size"]').fill("20")
    shown = widget.locator('tr[data-algorithm="ring"] td[data-seconds]').get_attribute(
        "data-seconds")
    assert float(shown) == pytest.approx(costmodel.predict("ring", 2**20, 8, data["alpha"],
                                                           1 / 450e9))
    preset.select_option("machine")
    assert float(widget.get_attribute("data-beta")) == data["beta"]


@pytest.mark.parametrize("lang", list(WIDGET_PAGES))
def test_ring_replay_ends_with_every_rank_holding_the_sum(server, page, lang):
    """Step through the recorded run with the buttons, then back and forth with the
    keyboard; at the end every rank's row is the final tensor the trace recorded, which is
    the sum of the initial ones."""
    _open(page, server, WIDGET_PAGES[lang])
    trace = _widget_data(page, "ring-replay")
    total = [sum(values) for values in zip(*(r["initial"] for r in trace["ranks"]))]
    assert all(r["final"] == total for r in trace["ranks"])
    widget = page.locator('.dpbook-widget[data-widget="ring-replay"] .dpbook-widget-live')
    rounds = int(widget.get_attribute("data-frames"))
    assert rounds == 2 * (trace["processes"] - 1)
    forward = widget.locator('button[data-role="forward"]')
    for k in range(rounds):
        forward.click()
        if k == 1:                            # mid-way: chunks on the move, sums growing
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            widget.scroll_into_view_if_needed()
            widget.screenshot(path=str(SCREENSHOTS / f"{lang}-widget-ring-replay-round2.png"))
    assert forward.is_disabled() and widget.get_attribute("data-frame") == str(rounds)
    rows = widget.locator('table[data-role="states"] tbody tr')
    assert rows.count() == trace["processes"]
    for rank in range(trace["processes"]):
        cells = rows.nth(rank).locator("td").evaluate_all(
            "tds => tds.map(td => JSON.parse(td.dataset.values))")
        assert [v for chunk in cells for v in chunk] == trace["ranks"][rank]["final"]
    status = widget.locator(".dpbook-widget-status").inner_text()
    assert ("每个进程都得到了总和" if lang == "zh" else "every rank holds the sum") in status
    widget.focus()
    page.keyboard.press("ArrowLeft")
    assert widget.get_attribute("data-frame") == str(rounds - 1)
    page.keyboard.press("ArrowRight")
    assert widget.get_attribute("data-frame") == str(rounds)


def test_widgets_fall_back_to_tables_without_javascript(server, browser):
    context = browser.new_context(java_script_enabled=False)
    try:
        page = context.new_page()
        page.goto(server + WIDGET_PAGES["zh"], wait_until="load")
        fallbacks = page.locator(".dpbook-widget-fallback table")
        assert fallbacks.count() == 2 and fallbacks.first.is_visible()
        assert "JavaScript未启用" in page.locator(".dpbook-widget-fallback").first.inner_text()
    finally:
        context.close()


@pytest.mark.parametrize("lang", list(WIDGET_PAGES))
def test_timeline_zooms_and_names_its_blocks(server, page, lang):
    """The DDP timeline of the inside-DDP chapter: every lane of the profiled run drawn,
    zoom with the buttons and the keyboard, a tooltip on every block."""
    path = {"en": "chapters/en/inside-ddp/timeline.html",
            "zh": "zh/chapters/zh/inside-ddp/timeline.html"}[lang]
    _open(page, server, path)
    root = page.locator('.dpbook-widget[data-widget="timeline"]')
    root.locator(".dpbook-widget-live").wait_for()
    data = _widget_data(page, "timeline")
    widget = root.locator(".dpbook-widget-live")
    blocks = sum(len(spans) for lanes in data.values() for spans in lanes.values())
    assert widget.locator("rect title").count() == blocks
    assert widget.locator("g[data-lane] rect").count() == blocks
    end = max(s + d for lanes in data.values() for spans in lanes.values() for s, d in spans)
    assert float(widget.get_attribute("data-to")) == pytest.approx(end)
    widget.locator('button[data-role="zoom-in"]').click()
    assert float(widget.get_attribute("data-to")) - float(widget.get_attribute("data-from")) \
        == pytest.approx(end / 2)
    assert float(widget.get_attribute("data-from")) == pytest.approx(end / 4)  # the middle
    widget.focus()
    page.keyboard.press("ArrowRight")                     # a quarter of the view onwards
    assert float(widget.get_attribute("data-from")) == pytest.approx(3 * end / 8)
    page.keyboard.press("-")             # back to the whole run (up to float rounding)
    assert float(widget.get_attribute("data-from")) == pytest.approx(0, abs=1e-9 * end)
    assert float(widget.get_attribute("data-to")) == pytest.approx(end)
    title = widget.locator("rect title").first.text_content()
    assert ("开始" in title) if lang == "zh" else ("lasts" in title), title
    root.scroll_into_view_if_needed()
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    root.screenshot(path=str(SCREENSHOTS / f"{lang}-widget-timeline.png"))


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_the_table_of_contents_opens_on_a_phone(server, browser, lang):
    """Below 992 px the theme hides the table of contents behind a button; at 390 px
    (a phone) that button must open it. With pydata-sphinx-theme 0.17 and
    sphinx-book-theme 1.3 it did nothing (their issues #2451 and #988): requirements.txt
    pins a pair that works."""
    context = browser.new_context(viewport={"width": 390, "height": 844})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    _open(page, server, PAGES[f"{lang}-from-scratch-pytorch"][0])
    link = page.locator(".bd-sidebar-primary nav.bd-docs-nav a.reference").first  # home
    assert not link.is_visible()               # hidden until asked for
    page.locator(".primary-toggle:visible").first.click()
    from playwright.sync_api import expect
    expect(link).to_be_in_viewport(ratio=1, timeout=5000)   # slid in, whole, on the screen
    context.close()
    assert not errors, f"JavaScript errors: {errors}"
