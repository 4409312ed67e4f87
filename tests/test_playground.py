"""The playground's server side, without a browser (tests/test_browser.py drives it in Chromium):
`GET /` and its two files need no key, carry a Content-Security-Policy of this origin only and
hold no secret; every API call the page makes still needs the key; `--open` opens the page once
the server answers."""

from __future__ import annotations

import http.client
import io
import json
import re
import sys
import threading
import time
import webbrowser

import pytest
from test_server import invoke, options, pair, served, settings_for, start, stop  # noqa: F401

from specgen.serve import playground
from specgen.serve.server import ServeOptions, prepare


def _get(running, path: str, headers: dict | None = None, method: str = "GET"):
    host, port = running.state.info["url"].removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request(method, path, headers=headers or {})
    response = conn.getresponse()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()


@pytest.mark.parametrize(
    "path, kind", [("/", "text/html"), ("/playground.js", "text/javascript"), ("/playground.css", "text/css")]
)
def test_the_page_needs_no_key_and_allows_only_its_own_origin(served, path, kind):
    status, headers, body = _get(served, path)
    assert status == 200 and headers["content-type"].startswith(kind) and body
    policy = dict(part.strip().split(" ", 1) for part in headers["content-security-policy"].split(";"))
    assert policy["default-src"] == "'none'"
    for directive in ("script-src", "style-src", "connect-src"):
        assert policy[directive] == "'self'"  # no inline script or style, nothing from another origin
    assert policy["frame-ancestors"] == "'none'" and headers["x-frame-options"] == "DENY"
    assert headers["x-content-type-options"] == "nosniff" and headers["referrer-policy"] == "no-referrer"
    # the page holds no secret: neither the local token nor the server's --api-key
    assert served.token.encode() not in body
    status, _, _ = _get(served, path, method="HEAD")
    assert status == 200


def test_the_page_loads_nothing_from_elsewhere_and_keeps_the_key_out_of_urls():
    html, script = (
        playground.content("playground.html").decode(),
        playground.content("playground.js").decode(),
    )
    for text in (html, script, playground.content("playground.css").decode()):
        assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", text)  # no CDN, no other origin
        assert "style=" not in text.replace('"style-src', "")  # inline styles would need 'unsafe-inline'
    assert "<script>" not in html and 'src="/playground.js"' in html  # no inline script
    assert "sessionStorage" in script and "localStorage" not in script
    assert not re.search(r"[?&](key|api_key|token)=", script)  # the key goes in a header, never in a URL
    assert re.search(r"fetch\(\"/", script) and "http" not in re.sub(
        r"https?://www\.w3\.org/2000/svg", "", script
    )


def test_every_api_call_still_needs_the_key(served):
    for path in ("/v1/models", "/metrics", "/tokenizer_info"):
        status, _, body = _get(served, path)
        assert status == 401 and b"a valid API key is required" in body
    status, _, _ = _get(served, "/v1/models", {"Authorization": f"Bearer {served.token}"})
    assert status == 200
    # /health tells a caller with the key what the page may offer: the methods this pair serves
    status, _, body = _get(served, "/health", {"Authorization": f"Bearer {served.token}"})
    info = json.loads(body)
    assert status == 200 and {"plain", "chain", "lookup", "lookup-chain"} <= set(info["methods"])
    assert "eagle" not in info["methods"]  # the tiny pair's draft is a model, not a head
    status, _, body = _get(served, "/health")
    assert "methods" not in json.loads(body)


def test_an_api_key_server_serves_the_page_and_still_needs_the_key(tiny_dirs, pair):  # noqa: F811
    running, thread = start(settings_for(tiny_dirs), pair, api_key="sesame-0123")
    try:
        status, headers, body = _get(running, "/")
        assert status == 200 and b"sesame-0123" not in body and "content-security-policy" in headers
        assert _get(running, "/v1/models")[0] == 401
        assert _get(running, "/v1/models", {"Authorization": "Bearer wrong"})[0] == 401
        assert _get(running, "/v1/models", {"Authorization": "Bearer sesame-0123"})[0] == 200
    finally:
        stop(running, thread)


def test_nothing_a_caller_sends_names_a_file(served):
    for path in ("/?name=../../../etc/passwd", "/playground.js?name=playground.py"):
        status, headers, body = _get(served, path)
        assert status == 200 and b"root:" not in body and b"import" not in body[:200]
    for path in ("/static/playground.js", "/../playground.py", "/playground.py"):
        assert _get(served, path)[0] == 404


def test_open_starts_the_users_browser_once_the_server_answers(tiny_dirs, pair, tmp_path, monkeypatch):  # noqa: F811
    opened = tmp_path / "opened"
    # a "browser" that loads the page it is given: webbrowser runs $BROWSER with the URL for %s
    browser = tmp_path / "browser.py"
    browser.write_text(
        "import sys, urllib.request\n"
        f"status = urllib.request.urlopen(sys.argv[1], timeout=10).status\n"
        f"open({str(opened)!r}, 'w').write(f'{{sys.argv[1]}} {{status}}')\n"
    )
    monkeypatch.setenv("BROWSER", f"{sys.executable} {browser} %s")
    monkeypatch.setattr(webbrowser, "_tryorder", None)  # read $BROWSER again
    said = []
    running = prepare(settings_for(tiny_dirs), ServeOptions(port=0), quiet=True, log=io.StringIO(), pair=pair)
    url = running.state.info["url"]
    thread = threading.Thread(
        target=running.serve_until_stopped,
        args=(lambda: playground.open_page(url, said.append),),
        daemon=True,
    )
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not opened.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert opened.read_text() == f"{url}/ 200" and not said
    finally:
        stop(running, thread)


def test_no_browser_gives_a_line_not_a_failure(monkeypatch):
    monkeypatch.setattr(webbrowser, "open", lambda url: False)
    said = []
    playground.open_page("http://127.0.0.1:1", said.append).join(10)
    assert said == ["specgen: no browser could be opened; the playground is at http://127.0.0.1:1/"]


def test_serve_open_is_an_option(tiny_dirs):
    result = invoke("serve", "--help")
    assert "--open" in result.output


def test_the_start_line_says_which_key_the_page_wants():
    from specgen.serve.server import playground_key

    assert playground_key(ServeOptions(api_key="k"), "tok") == "your --api-key"  # never printed
    assert playground_key(ServeOptions(), "tok") == "this server's local token tok"


def test_serve_detach_open_opens_the_page_once_the_server_answers(tiny_dirs, monkeypatch):
    """`specgen serve --detach --open`: the browser gets the playground's URL after the
    background server answers, not before (the process and the server are stand-ins here)."""
    from specgen.cli import remote as client
    from specgen.cli import serve as serve_cli

    events = []

    class Child:
        pid, returncode = 4242, None

        def __init__(self, args, **kwargs):
            events.append("started")

        def poll(self):
            return None

    answers = iter(
        [None, client.Server("http://127.0.0.1:8765", "t", {"pid": 4242, "models": "target tiny"})]
    )

    def find(settings, timeout=2.0):
        server = next(answers)
        events.append("answers" if server else "not yet")
        return server

    def start_then_answer(settings, timeout=2.0):  # nothing runs before the start
        return find(settings, timeout) if "started" in events else None

    monkeypatch.setattr(serve_cli.subprocess, "Popen", Child)
    monkeypatch.setattr(client, "find", start_then_answer)
    monkeypatch.setattr(webbrowser, "open", lambda url: events.append(f"opened {url}") or True)
    result = invoke("serve", *options(tiny_dirs), "--detach", "--open")
    assert result.exit_code == 0, result.output
    assert events == ["started", "not yet", "answers", "opened http://127.0.0.1:8765/"]
    assert "playground http://127.0.0.1:8765/" in result.stderr
