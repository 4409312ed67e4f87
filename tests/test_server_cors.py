"""Browsers: `serve --allowed-origins` lets scripts of the pages named call the server (CORS),
still with the key; by default no page may, and an origin a browser could never send is refused
before anything loads."""

from __future__ import annotations

import http.client

import pytest
from test_server import invoke, options, pair, settings_for, start, stop  # noqa: F401

PAGE = "http://localhost:3000"


@pytest.fixture(scope="module")
def served(tiny_dirs, pair):
    running, thread = start(settings_for(tiny_dirs), pair, allowed_origins=(PAGE, "https://app.example.org"))
    yield running
    stop(running, thread)


def _call(running, method: str, path: str, headers: dict):
    host, port = running.state.info["url"].removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request(method, path, headers=headers)
    response = conn.getresponse()
    response.read()
    return response.status, {k.lower(): v for k, v in response.getheaders()}


def test_a_named_page_may_call_with_the_key(served):
    # the browser's preflight carries no key: answered for a named origin
    status, headers = _call(
        served,
        "OPTIONS",
        "/v1/chat/completions",
        {
            "Origin": PAGE,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert status == 200 and headers["access-control-allow-origin"] == PAGE
    assert "authorization" in headers["access-control-allow-headers"].lower()
    # OpenAI's JavaScript SDK sends headers of its own on every call: its preflight passes too
    status, headers = _call(
        served,
        "OPTIONS",
        "/v1/chat/completions",
        {
            "Origin": PAGE,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os,openai-organization",
        },
    )
    assert status == 200 and "x-stainless-os" in headers["access-control-allow-headers"].lower()
    # the call itself still needs the key, and its answer is readable by the page
    status, headers = _call(
        served, "GET", "/v1/models", {"Origin": PAGE, "Authorization": f"Bearer {served.token}"}
    )
    assert status == 200 and headers["access-control-allow-origin"] == PAGE
    assert "retry-after" in headers["access-control-expose-headers"].lower()  # a full queue's 503 says when
    status, headers = _call(served, "GET", "/v1/models", {"Origin": PAGE})
    assert status == 401


def test_another_page_gets_no_permission(served):
    status, headers = _call(
        served,
        "OPTIONS",
        "/v1/chat/completions",
        {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert status == 400 and "access-control-allow-origin" not in headers
    status, headers = _call(
        served,
        "GET",
        "/v1/models",
        {"Origin": "http://evil.example", "Authorization": f"Bearer {served.token}"},
    )
    assert status == 200 and "access-control-allow-origin" not in headers


@pytest.mark.parametrize(
    "origin", ["http://localhost:3000/", "localhost:3000", "", "http://a.example/x", "ftp://a.example"]
)
def test_an_origin_a_browser_never_sends_is_refused_at_once(tiny_dirs, origin):
    result = invoke("serve", *options(tiny_dirs), "--allowed-origins", f"{PAGE},{origin}")
    assert result.exit_code == 1 and "--allowed-origins" in result.stderr and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) <= 2  # the line and its hint


def test_a_detached_server_is_given_the_origins(tiny_dirs, tmp_path, monkeypatch):
    import specgen.cli.serve as serve_cli

    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("SPECGEN_RUNTIME_DIR", str(runtime))
    seen = {}

    class Child:  # the background server as Popen gives it: ends at once
        pid, returncode = 1, 3

        def __init__(self, args, **kwargs):
            seen["args"] = args

        def poll(self):
            return self.returncode

    monkeypatch.setattr(serve_cli.subprocess, "Popen", Child)
    result = invoke("serve", *options(tiny_dirs), "--detach", "--allowed-origins", f"{PAGE}, *")
    assert result.exit_code == 1 and "did not start" in result.stderr
    args = seen["args"]
    assert args[args.index("--allowed-origins") + 1] == f"{PAGE},*"
