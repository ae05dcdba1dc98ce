"""Texel's page at `/` and its API reference at `/docs`, in a real browser.

Debian's Chromium (unpacked by tests/backends/chromium.sh) driven by Playwright, one
browser for the module, against the shared server with tiny models. Every request to a
host other than the server is aborted and recorded, so what passes here works offline.
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
import pytest

from tests.backends import ensure_backend, unavailable
from tests.conftest import OPENAI_JS_HEADERS, ROOT

pytestmark = pytest.mark.timeout(300)

EXAMPLE = ROOT / "examples" / "formula.png"  # 120 x 50 px
# What the default formula model answers for EXAMPLE (examples/README.md); the tiny
# model of the tests answers something else, typed in for the screenshot only.
EXAMPLE_LATEX = r"\alpha ^ { 2 } = { \frac { Q _ { c } ^ { 2 } } { a } } ,"
SCREENSHOT = ROOT / "docs" / "screenshot.png"
# An answer's time, and the batch it ran in (a formula already read is not batched).
ANSWERED = re.compile(r"Took [\d,]+ ms, (in a batch of \d+|answered from the cache)")


@pytest.fixture(scope="module")
def browser():
    launcher = ensure_backend("chromium.sh")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("playwright is not installed: pip install -e '.[dev]'")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(launcher))
        yield chromium
        chromium.close()


@dataclass
class Tab:
    """A page in its own browser context, with what it tried to fetch elsewhere."""

    page: object
    url: str
    blocked: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def open(self, path: str = "/") -> None:
        self.page.goto(self.url + path)


@contextlib.contextmanager
def open_tab(browser, url: str, **context_options) -> Iterator[Tab]:
    """A fresh context (no storage, no cache) whose requests to other hosts fail."""
    context = browser.new_context(**context_options)
    tab = Tab(context.new_page(), url)
    local = urlsplit(url).hostname

    def offline(route) -> None:
        request_url = route.request.url
        if request_url.startswith(("http:", "https:")) and urlsplit(request_url).hostname != local:
            tab.blocked.append(request_url)
            route.abort()
        else:
            route.continue_()

    context.route("**/*", offline)
    tab.page.on("pageerror", lambda error: tab.errors.append(str(error)))
    try:
        yield tab
    finally:
        context.close()
    assert not tab.errors, f"JavaScript errors on the page: {tab.errors}"


@pytest.fixture
def tab(browser, server) -> Iterator[Tab]:
    with open_tab(browser, server.url, viewport={"width": 1100, "height": 900}) as tab:
        yield tab


def answered(tab: Tab, meta: str = "#formula-meta") -> None:
    """Wait until the page shows an answer's time and batch."""
    from playwright.sync_api import expect

    expect(tab.page.locator(meta)).to_have_text(ANSWERED, timeout=60_000)


def wait_until(page, expression: str, timeout_s: float = 60) -> None:
    """Poll `expression` in the page until it is true: Playwright's `wait_for_function`
    evaluates a string in the page, which the page's Content-Security-Policy refuses."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"not true within {timeout_s} s: {expression}"
        page.wait_for_timeout(50)


def test_the_page_loads_its_script_styles_and_math_fonts_from_texel_itself(tab):
    page = tab.page
    tab.open()
    page.fill("#latex", r"\alpha + \beta")
    loaded = page.evaluate(
        """async () => { await document.fonts.ready;
        return Array.from(document.fonts).filter((f) => f.status === "loaded")
                    .map((f) => f.family); }"""
    )
    assert page.evaluate("typeof katex") == "object"
    assert "KaTeX_Math" in loaded
    assert tab.blocked == []


def test_a_chosen_formula_picture_is_answered_in_the_box_and_rendered_by_katex(tab, server):
    expected = httpx.post(
        server.url + "/recognize", files={"image": EXAMPLE.open("rb")}, timeout=60
    ).json()
    page = tab.page
    tab.open()
    page.fill("#latex", r"\beta")  # replaced by the answer
    page.set_input_files("#formula-file", EXAMPLE)
    answered(tab)
    assert page.input_value("#latex") == expected["latex"]
    assert page.text_content("#latex-compact") == expected["latex_compact"]
    assert f"confidence {expected['confidence']:.2f} " in page.text_content("#formula-meta")
    assert page.locator("#preview .katex").count() == 1
    annotation = page.locator("#preview annotation[encoding='application/x-tex']")
    assert annotation.text_content() == expected["latex"]


@pytest.mark.parametrize("gesture", ["paste", "drop"])
def test_a_pasted_or_dropped_picture_is_recognized(tab, gesture):
    page = tab.page
    tab.open()
    png = base64.b64encode(EXAMPLE.read_bytes()).decode()
    page.evaluate(
        """([png, gesture]) => {
        const bytes = Uint8Array.from(atob(png), (c) => c.charCodeAt(0));
        const data = new DataTransfer();
        data.items.add(new File([bytes], "formula.png", { type: "image/png" }));
        const target = gesture === "paste" ? document.body : document.getElementById("drop-zone");
        const event = gesture === "paste"
            ? new ClipboardEvent("paste", { clipboardData: data, bubbles: true })
            : new DragEvent("drop", { dataTransfer: data, bubbles: true, cancelable: true });
        target.dispatchEvent(event); }""",
        [png, gesture],
    )
    answered(tab)
    assert page.evaluate("document.getElementById('formula-picture').naturalWidth") == 120


def test_editing_the_latex_renders_it_as_math_as_it_is_typed(tab):
    page = tab.page
    tab.open()
    page.locator("#latex").press_sequentially(r"\frac{1}{2}")
    assert page.locator("#preview .katex .mfrac").count() == 1


def test_copy_compact_puts_the_edited_latex_without_its_spaces_on_the_clipboard(tab):
    page = tab.page
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    tab.open()
    page.fill("#latex", r"\alpha x ^ { 2 } + 1")
    page.click("#copy-compact")
    assert page.evaluate("navigator.clipboard.readText()") == r"\alpha x^{2}+1"


def test_a_generated_image_is_shown_decoded_with_a_download_link(tab):
    page = tab.page
    tab.open()
    page.fill("#prompt", "a red circle")
    page.fill("#seed", "7")
    page.click("#generate")
    wait_until(page, "document.querySelector('img.generated')?.naturalWidth > 0")
    with page.expect_download() as download:
        page.click("#images a[download]")
    png = download.value.path().read_bytes()
    assert download.value.suggested_filename == "texel-seed-7.png"
    shown = page.evaluate(
        "(() => { const img = document.querySelector('img.generated');"
        " return [img.naturalWidth, img.naturalHeight]; })()"
    )
    assert list(struct.unpack(">II", png[16:24])) == shown  # the PNG's IHDR: its size


def test_the_progress_bar_follows_the_denoising_steps_of_the_image(tab):
    from playwright.sync_api import expect

    page = tab.page
    tab.open()
    progress = page.locator("#image-progress")
    assert progress.is_hidden()
    page.fill("#steps", "40")
    page.click("#generate")
    expect(progress).to_be_visible()
    # The bar takes the step count from the streamed progress events.
    wait_until(
        page,
        "document.querySelector('#image-progress-bar').max === 40"
        " && document.querySelector('#image-progress-bar').value > 0",
    )
    expect(page.locator("#image-progress-text")).to_contain_text("of 40")
    expect(progress).to_be_hidden(timeout=60_000)
    expect(page.locator("img.generated")).to_be_visible()


def test_an_unsupported_file_shows_the_error(tab):
    from playwright.sync_api import expect

    page = tab.page
    tab.open()
    page.set_input_files(
        "#formula-file",
        {"name": "notes.txt", "mimeType": "text/plain", "buffer": b"not a picture\n"},
    )
    error = page.locator("#formula-error")
    expect(error).to_be_visible(timeout=30_000)
    expect(error).to_contain_text("Unsupported file: send a PNG, JPEG, WebP, BMP or GIF")
    expect(error).to_contain_text("415 unsupported_image")


def test_a_picture_over_the_upload_limit_says_it_is_too_large(tab):
    from playwright.sync_api import expect

    page = tab.page
    tab.open()
    big = EXAMPLE.read_bytes() + bytes(300 * 1024)  # over the shared server's 256 KiB
    page.set_input_files(
        "#formula-file", {"name": "big.png", "mimeType": "image/png", "buffer": big}
    )
    error = page.locator("#formula-error")
    expect(error).to_contain_text("Too large", timeout=30_000)
    expect(error).to_contain_text("413")


def test_an_api_key_is_asked_for_after_a_401_kept_and_sent_as_bearer(browser, tiny_models):
    """On the one-process app of the settings, in a thread of this process: what the page
    meets is the app's answers, and a server process would spend seconds importing."""
    from playwright.sync_api import expect

    from app.launcher import single_process_app
    from app.settings import Settings
    from tests.server import serving_in_thread

    settings = Settings(
        device="cpu",
        api_keys=["sesame"],
        formula={"enabled": False, "model": str(tiny_models["formula"])},
        image={"enabled": False, "model": str(tiny_models["image"])},
    )
    app = single_process_app(settings)  # no model: never ready, live at once
    with serving_in_thread(app, ready_path="/livez") as url, open_tab(browser, url) as tab:
        page = tab.page
        tab.open()
        assert page.locator("#key-section").is_hidden()
        page.click("#generate")
        expect(page.locator("#image-error")).to_contain_text("401 unauthorized")
        expect(page.locator("#api-key")).to_be_focused()
        page.keyboard.type("sesame")
        page.keyboard.press("Enter")  # saves the key and sends the request again
        # Past the key check: the next answer is the disabled model's.
        expect(page.locator("#image-error")).to_contain_text("404 model_disabled")
        assert page.evaluate("localStorage.getItem('texel.apiKey')") == "sesame"


@contextlib.contextmanager
def frontend_origin() -> Iterator[str]:
    """A web app's origin: a page served by a server of its own, on this machine (a page
    on a public origin may not reach a loopback address at all, whatever Texel answers)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<!doctype html><title>app</title><p>app</p>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    with ThreadingHTTPServer(("127.0.0.1", 0), Page) as site:
        Thread(target=site.serve_forever, daemon=True).start()
        try:
            yield f"http://127.0.0.1:{site.server_address[1]}"
        finally:
            site.shutdown()


def test_a_page_of_another_origin_generates_through_v1_as_openais_js_client_does(
    browser, tiny_models
):
    from app.launcher import single_process_app
    from app.settings import Settings
    from tests.server import serving_in_thread

    with frontend_origin() as frontend:
        settings = Settings(
            device="cpu",
            api_keys=["sk-frontend"],
            cors_origins=[frontend],
            formula={"enabled": False, "model": str(tiny_models["formula"])},
            image={"model": str(tiny_models["image"])},
        )
        with serving_in_thread(single_process_app(settings)) as url:
            context = browser.new_context()
            try:
                page = context.new_page()
                page.goto(frontend + "/")
                answer = page.evaluate(
                    """async ([url, extra]) => {
                      const response = await fetch(url + "/v1/images/generations", {
                        method: "POST",
                        headers: {
                          ...extra,
                          Authorization: "Bearer sk-frontend",
                          "Content-Type": "application/json",
                          Accept: "application/json",
                        },
                        body: JSON.stringify({prompt: "a red circle", size: "32x32", steps: 1}),
                      });
                      return [response.status, (await response.json()).data.length];
                    }""",
                    [url, OPENAI_JS_HEADERS],
                )
            finally:
                context.close()
    assert answer == [200, 1]


def test_the_page_fits_a_phone_width(browser, server):
    with open_tab(browser, server.url, viewport={"width": 360, "height": 740}) as tab:
        tab.open()
        assert tab.page.evaluate("document.documentElement.scrollWidth") <= 360


def test_every_control_of_the_page_has_a_label(tab):
    tab.open()
    unlabelled = tab.page.evaluate(
        """Array.from(document.querySelectorAll("input, textarea, select"))
        .filter((c) => c.labels.length === 0 && !c.getAttribute("aria-label")).map((c) => c.id)"""
    )
    assert unlabelled == []


def test_markup_that_reached_the_page_could_not_run_script(tab):
    """The page shows LaTeX that a picture can make the model write, and keeps an API
    key: KaTeX renders a link or picture command as text, and were any text ever taken
    as markup, the page's Content-Security-Policy keeps its handlers and `javascript:`
    links from running."""
    page = tab.page
    tab.open()
    violations = []
    page.on("console", lambda message: violations.append(message.text))
    page.fill("#latex", r"\href{javascript:window.ran=1}{x} \url{javascript:1} \includegraphics{x}")
    assert page.locator("#preview a, #preview img").count() == 0
    page.evaluate(
        """() => document.getElementById('preview').insertAdjacentHTML('beforeend',
        '<img src="missing.png" onerror="window.ran = 1">'
        + '<a id="evil" href="javascript:window.ran = 1">x</a>')"""
    )
    page.click("#evil")
    page.wait_for_timeout(500)
    assert page.evaluate("window.ran") is None
    assert any("Content Security Policy" in text for text in violations), violations


def test_docs_render_offline_from_the_packaged_swagger_ui(tab):
    from playwright.sync_api import expect

    page = tab.page
    tab.open("/docs")
    expect(page.locator(".swagger-ui .opblock").first).to_be_visible(timeout=30_000)
    paths = page.locator(".swagger-ui .opblock-summary-path").all_text_contents()
    assert {"/recognize", "/generate"} <= {path.strip() for path in paths}
    assert tab.blocked == []


def test_a_screenshot_of_the_page_in_use_is_saved_for_the_readme(tab, tmp_path):
    """Into a temporary file; with TEXEL_UPDATE_SCREENSHOT=1 into the README's own, so a
    test run leaves the working tree as it was."""
    page = tab.page
    shot = SCREENSHOT if os.environ.get("TEXEL_UPDATE_SCREENSHOT") == "1" else tmp_path / "s.png"
    tab.open()
    page.set_input_files("#formula-file", EXAMPLE)
    answered(tab)
    page.fill("#latex", EXAMPLE_LATEX)
    page.fill("#seed", "1")
    page.click("#generate")
    answered(tab, "#image-status")
    wait_until(page, "document.querySelector('img.generated')?.naturalWidth > 0")
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    assert "docs/screenshot.png" in (ROOT / "README.md").read_text() and SCREENSHOT.exists()
