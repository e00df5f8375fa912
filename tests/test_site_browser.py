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
    # Sphinx lists the results one by one, then says how many it found: wait for that
    # (reading the list at its first entry missed pages ranked further down)
    page.wait_for_function("() => /\\d/.test(document.querySelector("
                           "'#search-results .search-summary')?.textContent || '')",
                           timeout=20_000)
    results = page.locator("#search-results ul.search li")
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
    # the links' typical α, passed by the page (communication/allreduce.md)
    assert data["latencies"] == pytest.approx(costmodel.LINK_LATENCY)
    nvlink = "NVLink (H100, 18 links)"
    preset.select_option(nvlink)      # the link's β, and its typical α if the page gives one
    alpha = data.get("latencies", {}).get(nvlink, data["alpha"])
    assert float(widget.get_attribute("data-beta")) == pytest.approx(1 / 450e9)
    assert float(widget.get_attribute("data-alpha")) == alpha
    widget.locator('input[data-role="devices"]').fill("8")
    widget.locator('input[data-role="size"]').fill("20")
    shown = widget.locator('tr[data-algorithm="ring"] td[data-seconds]').get_attribute(
        "data-seconds")
    assert float(shown) == pytest.approx(costmodel.predict("ring", 2**20, 8, alpha, 1 / 450e9))
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



@pytest.mark.parametrize("lang", ["en", "zh"])
def test_formulas_render_without_the_internet(server, browser, lang):
    """MathJax comes with the site (tools/dpbook_site.mathjax_files): with every request
    off the site refused, the allreduce page's formulas are typeset, fonts included."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    outside = []

    def only_the_site(route):
        if route.request.url.startswith(server):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    page.route("**/*", only_the_site)
    path = {"en": "chapters/en/communication/allreduce.html",
            "zh": "zh/chapters/zh/communication/allreduce.html"}[lang]
    fonts = []
    page.on("response", lambda r: fonts.append(r.url) if r.url.endswith(".woff") else None)
    _open(page, server, path)
    page.wait_for_selector("mjx-container", timeout=20000)
    assert page.locator("mjx-container").count() > 5
    text = page.locator("article").inner_text()
    assert "\\(" not in text and "\\alpha" not in text      # no raw TeX left
    assert fonts, "MathJax loaded no font from the site"
    assert not [u for u in outside if "mathjax" in u.lower()], outside
    context.close()

_CALCULATOR_COPY = """([data, lang]) => {
  const div = document.createElement('div');
  div.className = 'dpbook-widget';
  div.dataset.widget = 'alpha-beta';
  div.dataset.lang = lang;
  div.id = 'dpbook-test-calculator';
  const script = document.createElement('script');
  script.type = 'application/json';
  script.textContent = JSON.stringify(data);
  div.appendChild(script);
  document.querySelector('.dpbook-widget[data-widget="alpha-beta"]').after(div);
  window.dpbookWidgets.mountAll();
}"""


def _calculator_with_latencies(page, lang: str):
    """A second calculator on the page, fed the page's data with ``latencies`` from
    costmodel.LINK_LATENCY, as the page passes them (or will: the widget takes them when
    they are there), so that these tests do not depend on the stored page's data."""
    from dpbook import costmodel
    data = dict(_widget_data(page, "alpha-beta"), latencies=costmodel.LINK_LATENCY)
    page.evaluate(_CALCULATOR_COPY, [data, lang])
    widget = page.locator("#dpbook-test-calculator .dpbook-widget-live")
    widget.wait_for()
    return widget, data


@pytest.mark.parametrize("lang", list(WIDGET_PAGES))
def test_calculator_presets_carry_their_links_latency(server, page, lang):
    """A link preset sets β from LINKS and α from LINK_LATENCY, and says so; "α from this
    machine" is said of the machine preset only. With NVLink's few µs the ring overtakes
    the tree on 8 GPUs at a few MiB, not at the 137 MiB this machine's α made of it."""
    from dpbook import costmodel
    _open(page, server, WIDGET_PAGES[lang])
    widget, data = _calculator_with_latencies(page, lang)
    source = widget.locator('[data-role="source"]')
    machine_words = "本机" if lang == "zh" else "this machine"
    assert machine_words in source.inner_text()
    preset = widget.locator('select[data-role="preset"]')
    for name, bandwidth in costmodel.LINKS.items():
        preset.select_option(name)
        assert float(widget.get_attribute("data-alpha")) == pytest.approx(
            costmodel.LINK_LATENCY[name])
        assert float(widget.get_attribute("data-beta")) == pytest.approx(1 / bandwidth)
        assert widget.get_attribute("data-alpha-from") == "link"
        assert machine_words not in source.inner_text(), (name, source.inner_text())
        assert float(widget.locator('input[data-role="alpha"]').input_value()) == \
            pytest.approx(costmodel.LINK_LATENCY[name] * 1e6, rel=1e-3)
    preset.select_option("NVLink (H100, 18 links)")
    widget.locator('input[data-role="devices"]').fill("8")
    note = widget.locator('[data-role="crossover"]').inner_text()
    mib = float(re.search(r"([\d.]+) MiB", note).group(1))
    assert 1 < mib < 10, note
    preset.select_option("machine")
    assert float(widget.get_attribute("data-alpha")) == data["alpha"]
    assert machine_words in source.inner_text()


@pytest.mark.parametrize("lang", list(WIDGET_PAGES))
def test_calculator_explains_its_lines_and_axes(server, page, lang):
    """A legend names the three curves (in the edition's words), the crossover line and
    the chosen size; the y axis reads 1 ms, 10 ms, 100 ms; one device draws no curves
    and says there is nothing to send."""
    _open(page, server, WIDGET_PAGES[lang])
    widget = page.locator('.dpbook-widget[data-widget="alpha-beta"] .dpbook-widget-live')
    widget.wait_for()
    names = (["朴素全归约", "环形全归约", "树形全归约"] if lang == "zh"
             else ["naive", "ring", "tree"])
    widget.locator('input[data-role="alpha"]').fill("10")          # crossover at 188 kB
    widget.locator('input[data-role="bandwidth"]').fill("10")
    widget.locator('input[data-role="devices"]').fill("8")
    legend = widget.locator(".dpbook-legend text").all_text_contents()
    assert legend[:3] == names, legend
    assert len(legend) == 5, legend                   # with the crossover's line
    assert widget.locator(".dpbook-legend line.dpbook-crossover").count() == 1
    assert widget.locator(".dpbook-legend line.dpbook-chosen").count() == 1
    assert widget.locator("svg > line.dpbook-crossover").count() == 1
    rows = widget.locator("tr[data-algorithm] td:first-child").all_inner_texts()
    assert rows == names
    ticks = widget.locator(".dpbook-axes text.dpbook-ytick").all_text_contents()
    assert len(ticks) >= 2, ticks
    assert all(re.fullmatch(r"\d+(\.\d+)? (ns|µs|ms|s)", t) for t in ticks), ticks
    widget.locator('input[data-role="devices"]').fill("1")
    assert widget.locator("polyline").count() == 0
    nothing = "只有一个设备" if lang == "zh" else "one device: nothing to send"
    assert nothing in widget.locator('[data-role="crossover"]').inner_text()
    assert nothing in widget.locator("svg").text_content()
    widget.locator('input[data-role="devices"]').fill("4")
    assert widget.locator("polyline").count() == 3


_COLOURS = """root => {
  const background = el => {          // the colour behind an element: its own or an ancestor's
    for (let e = el; e; e = e.parentElement) {
      const c = getComputedStyle(e).backgroundColor;
      if (c && c !== 'transparent' && !/rgba\\(.*, 0\\)$/.test(c)) return c;
    }
    return 'rgb(255, 255, 255)';
  };
  const pairs = [];
  root.querySelectorAll('circle.dpbook-ring-node').forEach((circle, i) => {
    const text = root.querySelectorAll('text.dpbook-ring-rank')[i];
    pairs.push(['rank ' + i, getComputedStyle(text).fill, getComputedStyle(circle).fill]);
  });
  root.querySelectorAll('td.dpbook-changed, td.dpbook-final, .dpbook-widget-legend span')
    .forEach(td => pairs.push([td.className + ' ' + td.textContent,
                               getComputedStyle(td).color, background(td)]));
  return pairs;
}"""


def _contrast(a: str, b: str) -> float:
    """WCAG contrast ratio of two CSS ``rgb(...)`` colours."""
    def luminance(colour):
        r, g, b = (int(v) / 255 for v in re.findall(r"[\d.]+", colour)[:3])
        lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in (r, g, b)]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]
    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


@pytest.mark.parametrize("theme", ["light", "dark"])
@pytest.mark.parametrize("lang", list(WIDGET_PAGES))
def test_ring_replay_is_legible_in_both_themes_and_does_not_jump(server, page, lang, theme):
    """Rank numbers on their nodes and the changed and final cells keep a contrast of at
    least 4.5 (WCAG AA) in light and dark mode; a legend says what yellow and green bold
    mean; the status line keeps one height while the replay plays."""
    _open(page, server, WIDGET_PAGES[lang])
    if theme == "dark":
        page.evaluate("document.documentElement.dataset.theme = 'dark'")
    widget = page.locator('.dpbook-widget[data-widget="ring-replay"] .dpbook-widget-live')
    widget.wait_for()
    key = widget.locator(".dpbook-widget-legend")
    assert key.locator(".dpbook-changed").count() == key.locator(".dpbook-final").count() == 1
    assert ("本轮有变化" if lang == "zh" else "changed in this round") in key.inner_text()
    status = widget.locator(".dpbook-widget-status")
    heights = [status.bounding_box()["height"]]
    forward = widget.locator('button[data-role="forward"]')
    low = []
    for _ in range(int(widget.get_attribute("data-frames"))):
        forward.click()
        heights.append(status.bounding_box()["height"])
        for what, fg, bg in widget.evaluate(_COLOURS):
            if _contrast(fg, bg) < 4.5:
                low.append((what, fg, bg, round(_contrast(fg, bg), 2)))
    assert not low, f"{theme}: too little contrast {low}"
    assert max(heights) - min(heights) < 0.5, heights


@pytest.mark.parametrize("lang", list(WIDGET_PAGES))
def test_widget_labels_stay_legible_on_a_phone(server, browser, lang):
    """At 390 px the drawings are drawn for their width instead of shrinking a 640-px
    drawing: no label of the calculator, the ring or the timeline is under 10 px on the
    screen, and nothing in a widget scrolls sideways. The Chinese timeline names its
    lanes in Chinese."""
    context = browser.new_context(viewport={"width": 390, "height": 844})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    timeline = {"en": "chapters/en/inside-ddp/timeline.html",
                "zh": "zh/chapters/zh/inside-ddp/timeline.html"}[lang]
    small, wide = [], []
    for path in (WIDGET_PAGES[lang], timeline):
        _open(page, server, path)
        page.locator(".dpbook-widget-live").first.wait_for()
        small += page.evaluate("""() => [...document.querySelectorAll(
            '.dpbook-widget-live svg text')].map(t => {
              const svg = t.ownerSVGElement;
              const scale = svg.getBoundingClientRect().width / svg.viewBox.baseVal.width;
              return [t.textContent, parseFloat(getComputedStyle(t).fontSize) * scale];
            }).filter(([_, px]) => px < 10)""")
        wide += page.evaluate("""() => [...document.querySelectorAll('.dpbook-widget-live')]
            .filter(w => w.scrollWidth > w.clientWidth + 1)
            .map(w => w.parentNode.dataset.widget)""")
    lanes = page.locator(".dpbook-widget-live svg text").all_text_contents()
    context.close()
    assert not small, f"labels under 10 px at 390 px: {small[:10]}"
    assert not wide, f"widgets wider than a phone: {wide}"
    assert ({"反向传播", "全归约"} if lang == "zh" else {"backward", "allreduce"}) <= set(lanes)
    assert not errors, f"JavaScript errors: {errors}"


#: Pages whose figures or widgets the site review found hard to read: the sideways test
#: saves a full-page screenshot of each, both editions, under _build/screenshots/pages/.
FIGURE_PAGES = ("communication/allreduce", "communication/parameter-server",
                "devices/pytorch", "devices/jax", "from-scratch/pytorch", "from-scratch/jax",
                "concise/pytorch", "inside-ddp/timeline")

_OVERFLOW = """() => {
  const wide = [];
  const article = document.querySelector('article');
  for (const pre of article.querySelectorAll('pre')) {
    const input = pre.closest('.cell_input') !== null;
    const before = pre.style.whiteSpace;
    if (input) pre.style.whiteSpace = 'pre';     // a code cell must fit without wrapping
    if (pre.scrollWidth > pre.clientWidth + 1)
      wide.push((input ? 'code: ' : 'text: ') + pre.textContent.split('\\n')
                .sort((a, b) => b.length - a.length)[0].slice(0, 90));
    pre.style.whiteSpace = before;
  }
  for (const t of article.querySelectorAll('table, .MathJax, mjx-container, img, svg'))
    if (t.getBoundingClientRect().right > article.getBoundingClientRect().right + 1)
      wide.push('element: ' + t.tagName + ' ' + (t.textContent || '').slice(0, 60));
  if (document.documentElement.scrollWidth > document.documentElement.clientWidth)
    wide.push('the page itself');
  return wide;
}"""


def test_nothing_scrolls_sideways(server, page):
    """At 1280 px every code cell fits the column without wrapping (tests/test_stage.py
    keeps them within 80 columns; the site's CSS sizes the font for that), outputs and
    included package code wrap, and tables, formulas and figures stay inside the article.
    Every page of both editions."""
    from book import toc_files
    paths = ([f"{e}.html" for e in toc_files("en")]
             + [f"zh/{e}.html" for e in toc_files("zh")])
    wide = {}
    shots = SCREENSHOTS / "pages"
    shots.mkdir(parents=True, exist_ok=True)
    for path in paths:
        _open(page, server, path)
        page.evaluate("() => window.MathJax?.startup?.promise ?? null")   # typeset first
        found = page.evaluate(_OVERFLOW)
        if found:
            wide[path] = found
        if any(f"/{p}." in path for p in FIGURE_PAGES):     # to look at (issue 30)
            name = path.replace("/", "-").removesuffix(".html")
            page.screenshot(path=str(shots / f"{name}.png"), full_page=True)
    assert not wide, f"wider than the column at 1280 px: {wide}"
