"""Clients that send their request too slowly (slowloris): each connection has REQUEST_TIMEOUT
seconds to deliver a whole request, from opening or from its last answer's end; past that the
server closes it, while every other client is answered. An arrived request is never timed: a
long streamed answer and a kept-alive connection between requests are left alone."""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest
from test_server import model, pair, raw, served, settings_for, slow_rounds, start, stop  # noqa: F401

from specgen.serve import protocol

LIMIT = 0.5  # seconds: REQUEST_TIMEOUT for these tests


@pytest.fixture
def short_limit(monkeypatch):
    monkeypatch.setattr(protocol, "REQUEST_TIMEOUT", LIMIT)


def _connect(served) -> socket.socket:
    host, port = served.state.info["url"].removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closes the connection (EOF or a reset) within the socket's timeout."""
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


@pytest.mark.parametrize(
    "sent",
    [
        b"",  # connects and says nothing
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n",  # half a head, never finished
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Authorization: Bearer {token}\r\nContent-Length: 1000\r\n\r\n{"mess',  # a body a tenth sent
    ],
    ids=["nothing", "half-a-head", "part-of-a-body"],
)
def test_a_request_that_does_not_arrive_in_time_loses_its_connection(served, short_limit, sent):
    sock = _connect(served)
    try:
        sock.sendall(sent.replace(b"{token}", served.token.encode()))
        started = time.monotonic()
        assert _closed_by_server(sock)
        assert time.monotonic() - started >= LIMIT * 0.8
    finally:
        sock.close()
    status, body, _ = raw(served, "GET", "/health")  # and the server goes on answering
    assert status == 200, body


def test_a_body_the_timer_cut_is_logged_and_counted_as_a_timeout(served, short_limit):
    """Not as a client that left (499): an operator can tell a slow client from one that gave up."""
    before = raw(served, "GET", "/metrics")[1]
    sock = _connect(served)
    try:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + served.token.encode() + b"\r\nContent-Length: 100\r\n\r\n{"
        )
        assert _closed_by_server(sock)
    finally:
        sock.close()
    line = 'specgen_requests_total{endpoint="chat",status="408"}'
    deadline = time.monotonic() + 10
    while _count(raw(served, "GET", "/metrics")[1], line) <= _count(before, line):
        assert time.monotonic() < deadline, "the cut request was not counted as a 408"
        time.sleep(0.05)
    assert "error 408: the request did not arrive within" in served.log.getvalue()


def _count(metrics: str, line: str) -> float:
    return next((float(row.split()[-1]) for row in metrics.splitlines() if row.startswith(line)), 0.0)


def test_slow_clients_do_not_hold_up_the_others(served, short_limit):
    stalled = [_connect(served) for _ in range(20)]
    try:
        for sock in stalled:
            sock.sendall(b"GET /health HTTP/1.1\r\n")
        status, body, _ = raw(
            served,
            "POST",
            "/v1/chat/completions",
            {"model": model(served), "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert status == 200, body
        assert all(_closed_by_server(sock) for sock in stalled)
    finally:
        for sock in stalled:
            sock.close()


def test_an_answer_longer_than_the_limit_and_a_kept_alive_connection_are_not_cut(
    served, short_limit, monkeypatch
):
    slow_rounds(monkeypatch, LIMIT * 1.5)  # one round alone outlasts the limit
    host, port = served.state.info["url"].removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    headers = {"Authorization": f"Bearer {served.token}", "Content-Type": "application/json"}
    body = {
        "model": model(served),
        "max_tokens": 4,
        "stream": True,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Write a long story"}],
    }
    started = time.monotonic()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(), headers=headers)
    response = conn.getresponse()
    text = response.read().decode()
    assert response.status == 200 and text.rstrip().endswith("data: [DONE]")
    assert time.monotonic() - started > LIMIT
    time.sleep(LIMIT * 0.5)  # the same connection again, within the limit: still open
    conn.request("GET", "/health", headers=headers)
    assert conn.getresponse().status == 200
