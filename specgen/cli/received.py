"""A specgen server's answer, read back on the client: its server-sent events turned into the
rounds and replays a local run's renderer shows, the outcome (also of an interrupted or broken
stream), and a refusal's message and code. Stdlib and specgen's torch-free modules only."""

from __future__ import annotations

import http.client
import json

from specgen.config import GenerationConfig
from specgen.decoding.events import Origin, ReplayResult, RoundResult
from specgen.decoding.stats import Stats, from_dict
from specgen.decoding.views import Outcome
from specgen.errors import PartialReply, SpecgenError


class Refused(SpecgenError):
    """The server's answer to a request it refused: its message, and its error code."""

    def __init__(self, message: str, code: str | None):
        super().__init__(f"the specgen server refused the request: {message}")
        self.code = code


def refusal(response) -> Refused:
    """The server's refusal, from its JSON error body (or its HTTP status when that is unreadable)."""
    try:
        error = json.loads(response.read())["error"]
        message, code = str(error["message"]), error.get("code")
    except (ValueError, KeyError, TypeError, AttributeError, OSError):
        message, code = f"HTTP {response.status}", None
    return Refused(message, code)


class Received:
    """What the stream brought so far: enough for the outcome of an interrupted run."""

    def __init__(self, method: str):
        self.pieces: list[str] = []
        self.pending: list[str] = []  # pieces not yet verified (deterministic mode)
        self.ids: list[int] = []
        self.logprobs: list[dict] = []  # each token's, when the run asked for them
        self.stats = Stats(method=method)

    def round(self, live: dict) -> RoundResult:
        """The round the live chunk describes, in ids and text, as the server's engine gave it."""
        self.stats = from_dict(live["stats"], self.stats.method)
        ids, accepted, drafts = list(live["ids"]), list(live["accepted"]), list(live["draft_ids"])
        tree = live["tree"]
        if tree is None:  # a chain: node j's parent is node j - 1
            shape = {"parents": tuple(range(len(drafts)))}
        else:
            shape = {"parents": tuple(tree["parents"]), "node_texts": tuple(tree["texts"])}
        target = (live["target"],) if len(ids) > len(accepted) else ()
        result = RoundResult(
            drafts,
            origin=next((o for o in Origin if o.value == live.get("origin")), Origin.MODEL),
            path=tuple(live["path"]),
            tried=tuple(live["tried"]),
            target_token=live["target_id"],
            root=live["root"],
            stop=live["stop"],
            emitted=ids,
            pieces=tuple(accepted) + target,
            rejected_texts=tuple(live["rejected"]),
            pending=live["pending"],
            tail=live["tail"],
            **shape,
        )
        self.ids.extend(ids)
        self.logprobs.extend(live.get("logprobs", ()))
        if result.pending:  # a piece per token: a replay's rollback counts tokens
            self.pending.extend(result.pieces)
        else:
            self.pieces.extend(result.pieces + (result.tail,))
        return result

    def replay(self, live: dict) -> ReplayResult:
        """The replay the live chunk describes, in ids and text, as the server's engine gave it."""
        self.stats = from_dict(live["stats"], self.stats.method)
        replay = live["replay"]
        start = max(0, len(self.ids) - replay["dropped"])
        dropped = tuple(self.ids[start:])
        del self.ids[start:]
        if replay["correction_id"] is not None:
            self.ids.append(replay["correction_id"])
        keep = len(self.pending) - len(replay["rolled_back"])
        tail = replay["tail"]
        self.pieces.extend(
            self.pending[:keep] + ([replay["correction"]] if replay["correction"] else []) + [tail]
        )
        self.pending = []
        return ReplayResult(
            replay["window_start"],
            replay["checked"],
            dropped,
            replay["correction_id"],
            replay["verified"],
            replay["seconds"],
            replay["stop"],
            rolled_back_texts=tuple(replay["rolled_back"]),
            correction_text=replay["correction"],
            tail=tail,
        )

    def outcome(self, config: GenerationConfig) -> Outcome:
        ids = self.ids if not config.deterministic else self.ids[: len(self.ids) - len(self.pending)]
        self.stats.interrupted = 1
        return Outcome("".join(self.pieces), ids, self.stats, interrupted=True, extra=self.extra(config, ids))

    def extra(self, config: GenerationConfig, ids: list[int]) -> dict:
        """The outcome's `logprobs`, as a run in its own process gives them, when asked for."""
        return {} if config.sampling.logprobs is None else {"logprobs": self.logprobs[: len(ids)]}


def read_stream(response, renderer, config: GenerationConfig, timeout: float) -> Outcome:
    """A streamed answer into `renderer`, round by round; its Outcome. Ctrl-C closes the
    connection and keeps what came, marked interrupted; a broken or silent stream (nothing for
    `timeout` seconds: the request's socket timeout) shows what came, then raises PartialReply."""
    received = Received(config.method.value)
    outcome, failed = None, None
    with renderer:
        try:
            for chunk in _chunks(response):
                if "error" in chunk:  # the server's engine failed mid-answer: what came is kept, as below
                    failed = f"the specgen server failed: {str(chunk['error'].get('message'))[:300]}"
                    break
                live = chunk.get("speculative") or {}
                if "stats" in live and "round" in live:
                    renderer.on_round(received.round(live), received.stats)
                elif "stats" in live and "replay" in live:
                    renderer.on_replay(received.replay(live), received.stats)
                elif "token_ids" in live:  # the last chunk: the whole outcome
                    stats = from_dict(live["stats"], live.get("method"))
                    outcome = Outcome(
                        live["text"],
                        live["token_ids"],
                        stats,
                        extra=received.extra(config, live["token_ids"]),
                    )
        except KeyboardInterrupt:
            response.close()  # the server ends the row before its next round
            outcome = received.outcome(config)
        except TimeoutError:  # no chunk, not even a keep-alive, for `timeout` seconds
            response.close()
            failed = f"the specgen server stopped answering: nothing came for {timeout:.0f} s"
        except (OSError, http.client.HTTPException, ValueError, AttributeError, TypeError, KeyError):
            pass  # the connection broke, or a chunk was not what the server sends: an early end
    if outcome is None:  # the server went away or failed mid-answer: what came is shown, then the error
        partial = received.outcome(config)
        renderer.finish(partial)
        raise PartialReply(
            failed or "the specgen server closed the connection before the generation finished",
            "the text received was shown and kept, marked interrupted"
            if failed
            else "was it stopped? the text received was shown and kept, marked interrupted",
            partial,
        )
    renderer.finish(outcome)
    return outcome


def _chunks(response):
    """The JSON objects of a server-sent event stream, up to `data: [DONE]`."""
    while True:
        line = response.readline()
        if not line:
            return
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)
