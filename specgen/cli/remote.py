"""The client side of `specgen serve`: what `specgen run` does when a server with its model
options runs. It speaks the server's OpenAI API (stdlib `http.client`, no torch imported) and
asks for each round's draft pieces (`speculative.live`), so its own renderer (Rich, plain or
JSON) shows the round exactly as a run in its own process would.

Ctrl-C closes the connection: the server ends the row before its next round, and the client
keeps what it was sent (text, token ids, statistics), marked interrupted. The stream is read
back into rounds in cli/received.py.
"""

from __future__ import annotations

import hmac
import http.client
import json
import os
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from specgen.cli.received import Received, read_stream, refusal
from specgen.config import GenerationConfig, ModelSettings
from specgen.decoding.views import Outcome
from specgen.errors import ConfigError, SpecgenError
from specgen.serve import discovery
from specgen.status import note


@dataclass(frozen=True)
class Server:
    """A running server this user may call."""

    url: str
    token: str
    info: dict  # pid, models, since

    def request(
        self, method: str, path: str, body: dict | None = None, timeout: float = 10.0, key: bool = True
    ):
        """(status, response) of one HTTP call; the response is open for reading. `key`: send
        the token (not before the server proved it holds it: `_answering`)."""
        parts = urlsplit(self.url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
        headers = {"Content-Type": "application/json"} | (
            {"Authorization": f"Bearer {self.token}"} if key else {}
        )
        conn.request(
            method, path, body=json.dumps(body).encode() if body is not None else None, headers=headers
        )
        response = conn.getresponse()
        return response.status, response


# a streamed answer's longest silence: the server sends a keep-alive every 15 s (app.KEEPALIVE_SECONDS)
STREAM_TIMEOUT = 120.0


def find(settings: ModelSettings, timeout: float = 2.0) -> Server | None:
    """The running server with these model options, if it answers (None otherwise)."""
    if os.environ.get("SPECGEN_NO_SERVER"):
        return None
    directory = discovery.runtime_dir()
    why = discovery.unsafe(directory) if directory.exists() else None
    if why is not None:  # a server there is not trusted: say why this run loads in its own process
        note(f"specgen: not looking for a server: {why}")
        return None
    path = discovery.record_path(settings)
    return _answering(discovery.read_record(path), timeout, path.stem)


def _answering(record: dict | None, timeout: float, key: str) -> Server | None:
    """The record's server, if what answers at its URL proves it holds the record's token and
    serves the model options `key` names, without being sent the token (discovery.proof of a
    fresh challenge): after a crash, another user could listen on that port and would get the
    token, the prompt, and the answer's say; a record copied under another options' name would
    send a run to a server of other models."""
    if record is None:
        return None
    server = Server(record["url"], record["token"], record)
    challenge = secrets.token_hex(16)
    try:
        status, response = server.request("GET", f"/health?challenge={challenge}", timeout=timeout, key=False)
        body = json.loads(response.read() or b"{}")
    except (OSError, ValueError, http.client.HTTPException):
        return None  # a stale record: its server is gone
    proof = body.get("proof") if isinstance(body, dict) else None
    if (
        status != 200
        or not isinstance(proof, str)
        or not hmac.compare_digest(proof, discovery.proof(record["token"], challenge, key))
    ):
        return None
    return server


def running(timeout: float = 2.0) -> list[dict]:
    """Every server of this user that answers (pid, models, since, url), oldest first."""
    found = []
    for path, record in discovery.records():
        if _answering(record, timeout, path.stem) is not None:
            found.append({**record, "record": str(path)})
    return sorted(found, key=lambda info: info["since"])


def silent(servers: list[dict]) -> list[tuple[str, int]]:
    """(model-options key, pid) of each server that holds its lock but is not among `servers`
    (those that answer): one still loading, or one whose record is lost."""
    answering = {Path(info["record"]).stem for info in servers}
    return [(key, pid) for key, pid in discovery.held() if key not in answering]


def shutdown(settings: ModelSettings, timeout: float = 30.0) -> dict | None:
    """Stop the matching server (SIGTERM to the pid it answered with, or to the `specgen serve`
    holding these options' lock: one still loading, or whose record is lost); what it was, or
    None when none runs. A lock's holder that cannot be proven a server is a ConfigError."""
    server = find(settings)
    lock = discovery.lock_path(settings)
    if server is not None:
        pid, info = server.info["pid"], server.info
    else:
        pid = discovery.holder(lock)
        if pid is None:
            return None
        if not pid or not discovery.is_server(pid, lock):
            shown = f" (pid {pid})" if pid else ""
            raise ConfigError(
                f"the specgen server with these model options is starting or not answering{shown}",
                hint=f"kill {pid} ends it" if pid else "try again in a moment",
            )
        info = {"pid": pid, "models": "not answering yet"}
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (discovery.holder(lock) is not None or find(settings, timeout=0.5)):
        time.sleep(0.2)  # until it has ended (its lock is free), or, one that holds none, stopped answering
    return info


def request_body(
    config: GenerationConfig, model: str, messages: list[dict] | None = None, prompt: str | None = None
) -> dict:
    """Decoding options as an OpenAI request, streamed with each round's pieces: a chat
    (`messages`) or a raw completion (`prompt`)."""
    speculative = {
        "method": config.method.value,
        "branching": list(config.branching),
        "beam_width": config.beam_width,
        "depth": config.depth,
        "deterministic": config.deterministic,
        "verify_window": config.verify_window,
        "draft_schedule": config.schedule.value,
        "live": True,
    }
    if not config.device_draft_tokens:  # a k of the run's own; else the server's device default
        speculative.update(draft_tokens=config.draft_tokens, draft_confidence=config.draft_confidence)
    elif not config.device_confidence:
        speculative["draft_confidence"] = config.draft_confidence
    s = config.sampling
    body = {
        "model": model,
        "max_tokens": config.max_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "stream": True,
        "speculative": speculative,
    }
    if s.seed is not None:
        body["seed"] = s.seed
    if prompt is not None:
        body["prompt"] = prompt
    else:
        body["messages"] = messages
    if s.logprobs is not None:  # the live chunks carry each round's tokens' logprobs (views.logprob_entries)
        body.update(
            {"logprobs": s.logprobs} if prompt is not None else {"logprobs": True, "top_logprobs": s.logprobs}
        )
    return body


def generate_on_server(
    settings: ModelSettings,
    text: str,
    raw: bool,
    system: str | None,
    config: GenerationConfig,
    renderer,
    quiet: bool = False,
) -> Outcome | None:
    """Run one generation on a matching server into `renderer`; its Outcome, or None when no
    server with these model options runs (then the caller loads the pair itself)."""
    server = find(settings)
    if server is None:
        return None
    if not quiet:
        note(f"specgen: generating on the specgen server (pid {server.info['pid']}, {server.info['models']})")
    path = "/v1/completions" if raw else "/v1/chat/completions"
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}
    ]
    body = (
        request_body(config, server.info["model"], prompt=text)
        if raw
        else request_body(config, server.info["model"], messages)
    )
    try:
        status, response = server.request("POST", path, body, timeout=STREAM_TIMEOUT)
    except KeyboardInterrupt:
        # before the answer began: an empty one, marked interrupted, as a local run prints
        outcome = Received(config.method.value).outcome(config)
        with renderer:
            pass
        renderer.finish(outcome)
        return outcome
    except (OSError, http.client.HTTPException):
        note("specgen: the server did not answer; loading the models here")
        return None  # it went away between the check and the request: load here
    if status != 200:
        raise refusal(response)
    return read_stream(response, renderer, config, STREAM_TIMEOUT)


class ServerChat:
    """A chat's replies from a running server (the Backend of chat/conversation.py). The
    server parks the conversation's row after each reply and resumes it for the next turn,
    which shares its prefix: a turn prefills only its new tokens, as a local chat does."""

    def __init__(self, server: Server, settings: ModelSettings | None = None):
        self.server, self.settings = server, settings  # settings: to find the server again once restarted
        self.target_name = server.info["model"]
        self.draft_name = server.info.get("draft")
        self.context_length = 0
        self.context_length = self._tokenize([{"role": "user", "content": "hi"}])["max_model_len"]

    def _request(self, path: str, body: dict, timeout: float):
        """One request; when the server does not answer, a server started again with the same
        model options (a new record) takes the conversation on."""
        try:
            return self.server.request("POST", path, body, timeout=timeout)
        except (OSError, http.client.HTTPException):
            fresh = find(self.settings) if self.settings is not None else None
            if fresh is None or fresh.url == self.server.url and fresh.token == self.server.token:
                raise
            self.server = fresh
            note(f"specgen: chatting on the specgen server started again (pid {fresh.info['pid']})")
            return self.server.request("POST", path, body, timeout=timeout)

    def _tokenize(self, messages: list[dict]) -> dict:
        try:
            status, response = self._request("/tokenize", {"messages": messages}, timeout=60)
            if status != 200:
                error = refusal(response)
                if error.code == "context_length_exceeded":  # far past the context: counted no further
                    return {"count": self.context_length + 1}
                raise error
            return json.loads(response.read())
        except (OSError, ValueError, http.client.HTTPException) as exc:
            raise SpecgenError(
                f"the specgen server did not answer: {exc}",
                hint="is it still running? `specgen serve --list`",
            ) from None

    def count(self, messages: list[dict]) -> int:
        return int(self._tokenize(messages)["count"])

    def reply(self, messages: list[dict], config: GenerationConfig, renderer) -> tuple[Outcome, int]:
        try:
            status, response = self._request(
                "/v1/chat/completions", request_body(config, self.target_name, messages), STREAM_TIMEOUT
            )
        except (OSError, http.client.HTTPException) as exc:
            raise SpecgenError(
                f"the specgen server did not answer: {exc}",
                hint="is it still running? `specgen serve --list`",
            ) from None
        if status != 200:
            raise refusal(response)
        outcome = read_stream(response, renderer, config, STREAM_TIMEOUT)
        return outcome, outcome.stats.reused_tokens

    def configure(self, config: GenerationConfig) -> None:
        """Nothing to prepare: each request carries its settings (the server checks them, and
        chooses a draft length left to the device). A method its models cannot run (eagle
        without a head) is refused here, as a local chat refuses it, not at every message."""
        methods = self.server.info.get("methods")
        if isinstance(methods, list) and config.method.value not in methods:
            raise ConfigError(
                f"the specgen server's models cannot run method {config.method.value}; "
                f"it runs {', '.join(map(str, methods))}"
            )
