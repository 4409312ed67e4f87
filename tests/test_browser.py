"""The playground and `bench --html` in a real browser: headless Chromium from the system's
packages (Debian: `apt-get install chromium`), driven by Playwright for Python through its
`executable_path` (Playwright's own browser download is never used). Not in the default run:
`python -m pytest -m browser` (CI's own step); skipped where Playwright or Chromium is absent.

Screenshots go to $SPECGEN_TEST_OUTPUT (CI keeps them), else the test's temporary folder."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
from test_server import pair, served, settings_for, start, stop  # noqa: F401

pytestmark = pytest.mark.browser
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="Playwright is not installed (pip install -e '.[browser]')"
)
CHROMIUM = os.environ.get("SPECGEN_CHROMIUM") or next(
    (path for name in ("chromium", "chromium-browser", "google-chrome") if (path := shutil.which(name))), None
)
if CHROMIUM is None:
    pytest.skip("no Chromium on this machine (apt-get install chromium)", allow_module_level=True)

PROMPT = "Write a haiku about caches"
WIDE, NARROW = 1280, 360
# text elements that must never overlap one another (a page squeezed to 360 px overlaps first)
TEXT = (
    "h1, h2, label, legend, button, input, select, textarea, dt, dd, figcaption, .legend > *, .speed, .detail"
)


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        args = ["--no-sandbox"] if os.geteuid() == 0 else []  # root: Chromium's sandbox refuses to start
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=args)
        yield launched
        launched.close()


@pytest.fixture
def output(tmp_path) -> Path:
    folder = Path(os.environ.get("SPECGEN_TEST_OUTPUT") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class Page:
    """A page with its console errors and uncaught exceptions collected."""

    def __init__(self, browser, url: str, width: int = WIDE):
        self.page = browser.new_page(viewport={"width": width, "height": 900})
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(url)

    def __getattr__(self, name):
        return getattr(self.page, name)


@pytest.fixture
def page(browser, served):  # noqa: F811
    opened = Page(browser, served.state.info["url"] + "/")
    yield opened
    opened.page.close()


def until(page, condition: str, arg=None, seconds: float = 60.0) -> None:
    """Wait until the JavaScript function `condition` holds in the page. (Playwright's own
    wait_for_function evaluates a string, which the page's Content-Security-Policy forbids.)"""
    deadline = time.monotonic() + seconds
    while not page.evaluate(condition, arg):
        assert time.monotonic() < deadline, f"timed out waiting for {condition}"
        time.sleep(0.1)


def login(page, key: str) -> None:
    page.fill("#key", key)
    page.press("#key", "Tab")  # a change event: the page checks the key and reads what the server runs


def wait_done(page, columns: int) -> None:
    until(page, f"() => document.querySelectorAll('.column .summary[data-drafted]').length === {columns}")


def answer_texts(page) -> list[str]:
    """Each column's answer: its accepted draft pieces and the target's tokens, in order."""
    return page.evaluate("""() => [...document.querySelectorAll('.column .answer')].map(
        a => [...a.querySelectorAll('.acc, .tgt')].map(e => e.textContent).join(''))""")


def test_the_page_loads_with_no_console_errors(page, served):  # noqa: F811
    assert page.title() == "specgen playground"
    assert page.is_visible("#legend") and page.inner_text("#legend .rej")
    login(page, served.token)
    until(page, "() => document.getElementById('served').textContent.startsWith('Serving')")  # /health read
    methods = page.eval_on_selector_all("#method option", "options => options.map(o => o.value)")
    assert "chain" in methods and "eagle" not in methods  # what this server can run
    assert page.evaluate("sessionStorage.getItem('specgen-playground-key')") == served.token
    assert served.token not in page.url
    assert page.errors == []


def test_a_prompt_streams_its_rounds_in_colour(page, served, output):  # noqa: F811
    login(page, served.token)
    page.fill("#prompt", PROMPT)
    page.select_option("#method", "lookup")  # on the tiny models, lookup's drafts are both kept and refused
    page.fill("#max-tokens", "64")
    page.click("#go")
    page.wait_for_selector(
        ".column .round", state="attached", timeout=60_000
    )  # the first round shows before the answer ends
    wait_done(page, 1)
    summary = page.eval_on_selector(".column .summary", "s => ({...s.dataset})")
    green, red = page.locator(".column .answer .acc").count(), page.locator(".column .answer .rej").count()
    # each span a token: the accepted draft tokens, and the rejected ones, as the API counted them
    assert green == int(summary["accepted"]) and green + red == int(summary["drafted"])
    assert green > 0 and red > 0
    assert page.locator(".column .answer .tgt").count() > 0
    assert page.locator(".column .histogram svg rect").count() >= 1
    assert page.locator(".column .rate svg polyline").count() == 1
    # a round's draft on hover, and from the keyboard
    page.hover(".column .round >> nth=0")
    assert page.inner_text(".column .detail").startswith("Round 1:")
    page.focus(".column .answer")
    page.keyboard.press("ArrowRight")
    assert page.inner_text(".column .detail").startswith("Round 2:")
    assert "ms" in page.inner_text(".column .detail")
    page.screenshot(path=str(output / "playground-answer.png"), full_page=True)
    assert page.errors == []


def test_race_mode_shows_the_same_text_under_greedy(page, served, monkeypatch):  # noqa: F811
    """The race's three methods run as rows of one batch (the engine saw them together) and
    show the same text."""
    import time

    from specgen.decoding.engine import Engine

    widths, real = [], Engine._round

    def paced(self, rows):  # rounds at a real model's pace: the three requests overlap
        widths.append(len(rows))
        time.sleep(0.01)
        return real(self, rows)

    monkeypatch.setattr(Engine, "_round", paced)
    login(page, served.token)
    page.fill("#prompt", PROMPT)
    page.select_option("#method", "chain")
    page.check("#race")
    page.select_option("#third", "lookup-chain")
    page.fill("#max-tokens", "40")
    page.click("#go")
    wait_done(page, 3)
    methods = page.eval_on_selector_all(".column", "columns => columns.map(c => c.dataset.method)")
    assert methods == ["plain", "chain", "lookup-chain"]
    texts = answer_texts(page)
    assert texts[0] and texts[0] == texts[1] == texts[2]
    assert "the same text in every column" in page.inner_text("#verdict")
    assert page.locator(".column[data-method=plain] .answer .acc").count() == 0  # plain drafts nothing
    assert max(widths) == 3  # one batch
    assert page.errors == []


def test_a_race_says_when_a_row_drafted_nothing_beside_the_others(page, served, monkeypatch):  # noqa: F811
    """Where the server holds a draft model's row to plain rounds (too few such rows to repay
    the model's step: widths.WidthCosts.least), the race's verdict says so instead of leaving a
    1.00x unexplained."""
    import dataclasses

    engine = served.scheduler.engine  # built by the warm-up
    monkeypatch.setattr(engine, "policy", dataclasses.replace(engine.policy, together=lambda width, n: False))
    login(page, served.token)
    page.fill("#prompt", PROMPT)
    page.select_option("#method", "chain")
    page.check("#race")
    page.fill("#max-tokens", "16")
    page.click("#go")
    wait_done(page, 2)
    until(page, "() => !document.getElementById('verdict').hidden")
    verdict = page.inner_text("#verdict")
    assert "chain drafted nothing: beside the others its drafting would not pay" in verdict, verdict
    assert "plain drafted nothing" not in verdict
    assert page.errors == []


def test_a_wrong_key_shows_the_servers_401(page):
    login(page, "not-the-key")
    page.wait_for_selector("#error:not([hidden])")
    assert "401: a valid API key is required" in page.inner_text("#error")
    page.fill("#prompt", PROMPT)
    page.click("#go")  # the page asks again, and says why it cannot go on
    until(page, "() => document.getElementById('error').textContent.includes('401')")
    # a browser logs a failed fetch's status as a console error: nothing else may appear
    assert all("401" in error for error in page.errors)


def test_the_metrics_panel_updates(page, served):  # noqa: F811
    login(page, served.token)
    until(page, "() => Number(document.getElementById('metrics').dataset.updates || 0) >= 1")
    first = int(page.get_attribute("#metrics", "data-updates"))
    before = page.inner_text("#metrics")
    page.fill("#prompt", PROMPT)
    page.fill("#max-tokens", "16")
    page.click("#go")
    wait_done(page, 1)
    until(page, f"() => Number(document.getElementById('metrics').dataset.updates) > {first}")
    until(page, "(before) => document.getElementById('metrics').innerText !== before", before)
    text = page.inner_text("#metrics")
    for name in ("requests", "queue", "batch width", "draft length per width", "acceptance"):
        assert name in text
    assert page.errors == []


def overlaps(page) -> list:
    """Pairs of visible text elements whose boxes overlap (neither inside the other)."""
    return page.evaluate(
        """(selector) => {
        const shown = [...document.querySelectorAll(selector)].filter(e => {
            const r = e.getBoundingClientRect(); return r.width > 0 && r.height > 0; });
        const found = [];
        for (let i = 0; i < shown.length; i++) for (let j = i + 1; j < shown.length; j++) {
            const a = shown[i], b = shown[j];
            if (a.contains(b) || b.contains(a) || a.closest('label') === b || b.closest('label') === a)
            continue;
            const p = a.getBoundingClientRect(), q = b.getBoundingClientRect();
            const x = Math.min(p.right, q.right) - Math.max(p.left, q.left);
            const y = Math.min(p.bottom, q.bottom) - Math.max(p.top, q.top);
            if (x > 1 && y > 1) found.push([a.outerHTML.slice(0, 60), b.outerHTML.slice(0, 60)]);
        }
        return found; }""",
        TEXT,
    )


@pytest.mark.parametrize("width", [WIDE, NARROW])
def test_the_page_fits_at_1280_and_360_px(browser, served, output, width):  # noqa: F811
    page = Page(browser, served.state.info["url"] + "/", width)
    try:
        login(page, served.token)
        page.fill("#prompt", PROMPT)
        page.check("#race")
        page.fill("#max-tokens", "24")
        page.click("#go")
        wait_done(page, 2)
        until(page, "() => Number(document.getElementById('metrics').dataset.updates || 0) >= 1")
        page.screenshot(path=str(output / f"playground-{width}px.png"), full_page=True)
        assert page.evaluate("document.documentElement.scrollWidth") <= width  # no horizontal scroll
        assert overlaps(page) == []
        # keyboard: Tab reaches the key, the prompt and the button in order
        page.focus("#key")
        order = []
        for _ in range(12):
            page.keyboard.press("Tab")
            order.append(page.evaluate("document.activeElement.id"))
        assert order.index("prompt") < order.index("method") < order.index("go")
        assert page.errors == []
    finally:
        page.page.close()


def test_a_bench_report_loads_in_chromium(browser, tiny_dirs, tmp_path, output):
    from test_server import invoke, options

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"id": "one", "category": "code", "prompt": "def fib(n):"}\n'
        '{"id": "two", "category": "chat", "prompt": "Say hello"}\n',
        encoding="utf-8",
    )
    report = tmp_path / "bench.html"
    result = invoke(
        "bench",
        *options(tiny_dirs),
        "--prompts",
        str(prompts),
        "--methods",
        "chain,lookup",
        "-n",
        "8",
        "--no-warmup",
        "--threads",
        "1",
        "--html",
        str(report),
    )
    assert result.exit_code == 0, result.output
    page = browser.new_page(viewport={"width": WIDE, "height": 900})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: errors.append(f"fetched {r.url}") if not r.url.startswith("file:") else None)
    try:
        page.goto(report.as_uri())
        assert page.locator("svg[data-plot]").count() == 3
        assert page.locator("table tbody tr").count() == 3 * 3  # plain, chain, lookup: all, code, chat
        for plot in page.locator("svg[data-plot]").all():
            box = plot.bounding_box()
            assert box["width"] > 200 and box["height"] > 60
        page.screenshot(path=str(output / "bench-report.png"), full_page=True)
        assert errors == []
    finally:
        page.close()
