"""One request's answer, built from its row's engine events: the text (stop strings cut,
deterministic mode's unverified tokens held back), stream chunks, the whole response.

Runs on the engine thread; what it returns is plain data that the HTTP layer sends. Text is
pushed token by token through an incremental `TextStream`, never re-decoded as a whole. While
streaming, a tail that could be the start of a stop string is held back until it cannot.
"""

from __future__ import annotations

from specgen.decoding.events import Finished, Joined, ReplayResult, RoundResult, StopReason, TokenLogprob
from specgen.decoding.stats import Stats
from specgen.decoding.views import logprob_entries, replay_text, round_text
from specgen.serve import answers, api
from specgen.text import TextStream, TokenBytes


class Output:
    """Turns one row's events into chunks (streaming) or one response (at the end): a choice of
    `request`, which decodes `prompt`."""

    def __init__(
        self,
        request: api.ApiRequest,
        prompt: api.Prompt,
        tokenizer,
        prompt_tokens: int,
        prompt_ids: list[int] = (),
    ):
        self.request, self.prompt = request, prompt
        self.tokenizer, self.prompt_tokens = tokenizer, prompt_tokens
        self.prompt_ids = list(prompt_ids)
        self.floor = 0  # characters of `text` that are the echoed prompt (never searched for stops)
        self.prompt_logprobs: tuple = ()  # the prompt's tokens 2.. under the target, when asked
        self.stream = TextStream(tokenizer)
        self.text = ""  # final text so far (verified, stop strings cut)
        self.sent = 0  # characters of `text` already streamed
        self.pending: list[str] = []  # deterministic mode: pieces waiting for their replay
        self.stopped = False  # a stop string ended the answer
        self.started = False  # the first chunk (with the role) went out
        self.hold = max((len(s) for s in request.stops), default=1) - 1
        # logprobs asked: each token's (start, end) in the text before any stop cut, id, TokenLogprob
        self.tokens: list[tuple[int, int, int, TokenLogprob]] = []
        self.chars = 0  # characters pushed so far, before any stop cut
        self.reported = 0  # tokens whose logprobs went out
        self.ended_at = -1  # index in `tokens` of the stop token that ended the row adding no text (-1: none)
        self.bytes_of = TokenBytes(tokenizer)

    # -- events ---------------------------------------------------------------------------------
    def add(self, event, stats: Stats) -> list[dict]:
        """The chunks an event produces (nothing after a stop string)."""
        if isinstance(event, Joined):
            self.prompt_logprobs = event.prompt_logprobs
            if self.request.echo_prompt:
                return self._echo(event, stats)
        if self.stopped or isinstance(event, (Joined, Finished)) or self.request.max_zero:
            return []
        if isinstance(event, RoundResult):
            event = round_text(
                event, self.stream, pending=self.request.config.deterministic, drafts=self.request.live
            )
            for token, piece, logprob in zip(event.emitted, event.pieces, event.logprobs):
                self.tokens.append((self.chars, self.chars + len(piece), token, logprob))
                self.chars += len(piece)
            if event.stop == StopReason.EOS and event.pieces and not event.pieces[-1]:
                self.ended_at = len(self.tokens) - 1  # the stop token that ended it, with no text: no entry
            self._attribute(event.tail)
            if event.pending:  # a piece per token: a replay's rollback counts tokens
                self.pending.extend(event.pieces)
            else:
                self._extend("".join(event.pieces) + event.tail)
            live = self._live_round(event, stats) if self.request.live else {}
        else:
            event = replay_text(event, self.stream)
            keep = len(self.pending) - len(event.rolled_back)
            self._attribute(event.tail)
            self._extend("".join(self.pending[:keep]) + (event.correction_text or "") + event.tail)
            self.pending = []
            live = self._live_replay(event) if self.request.live else {}
        return self._chunks(live, stats, final=False)

    def _live_round(self, event: RoundResult, stats: Stats) -> dict:
        """A round as the live view draws it (`speculative.live`), and whole in ids: a specgen
        client rebuilds the same RoundResult from it (cli/remote.py)."""
        live = {
            "round": stats.rounds,
            "ids": event.emitted,
            "accepted": list(event.accepted_pieces),
            "target": event.target_piece,
            "rejected": list(event.rejected_texts),
            "pending": event.pending,
            "tail": event.tail,
            "tree": None
            if event.is_chain
            else {
                "texts": list(event.node_texts),
                "parents": list(event.parents),
                "accepted": sorted(event.path),
                "tried": sorted(event.tried),
            },
            "draft_ids": list(event.draft_tokens),
            "origin": event.origin.value,  # where the draft came from: model, text, memory
            "path": list(event.path),
            "tried": list(event.tried),
            "root": event.root,
            "target_id": event.target_token,
            "stop": event.stop,
        }
        if event.logprobs:  # `specgen run --logprobs` on the server
            live["logprobs"] = logprob_entries(event.emitted, event.logprobs, self.bytes_of)
        return live

    @staticmethod
    def _live_replay(event: ReplayResult) -> dict:
        """A replay as the live view draws it, and whole in ids (cli/remote.py)."""
        return {
            "replay": {
                "rolled_back": list(event.rolled_back_texts),
                "correction": event.correction_text,
                "tail": event.tail,
                "dropped": len(event.rolled_back),
                "correction_id": event.correction,
                "window_start": event.window_start,
                "checked": event.checked,
                "verified": event.verified,
                "seconds": event.seconds,
                "stop": event.stop,
            }
        }

    def _attribute(self, tail: str) -> None:
        """The text the stream released at the end belongs to the last token that is not special
        (the bytes it completes): its logprobs span grows, and the special ones after it move."""
        if not tail:
            return
        specials = self.bytes_of.specials
        owner = next(
            (i for i in range(len(self.tokens) - 1, -1, -1) if self.tokens[i][2] not in specials), None
        )
        if owner is None:
            return
        self.tokens[owner:] = [
            (start + (i > 0) * len(tail), end + len(tail), token, logprob)
            for i, (start, end, token, logprob) in enumerate(self.tokens[owner:])
        ]
        self.chars += len(tail)

    def finish(self, stats: Stats, token_ids: list[int], stop: str | None) -> list[dict]:
        """The last chunks: what was held back, the finish reason, usage and the statistics."""
        if not self.stopped and not self.request.max_zero and not self.pending:
            tail = self.stream.flush()  # what the stream holds back, if the last round did not flush it
            self._attribute(tail)
            self._extend(tail)
        reason = "stop" if self.stopped else answers.finish_reason(stop)
        out = self._chunks({}, stats, final=True)
        extra = answers.speculative_summary(stats)
        if self.request.live:  # the specgen client rebuilds its outcome from these
            extra.update(stats=stats.as_dict(), token_ids=self._kept_ids(token_ids), text=self.text)
        logprobs = self._logprobs(len(self.text), final=True) if self.request.stream else None
        out.append(
            answers.chunk(self.request, None, reason, extra, first=not self.started, logprobs=logprobs)
        )
        if self.request.include_usage:
            out.append(
                answers.usage_chunk(self.request, self.prompt_tokens, self._completion_tokens(stats), stats)
            )
        self.reason = reason
        return out

    def response(self, stats: Stats, token_ids: list[int], stop: str | None) -> dict:
        """The whole answer of a request that did not stream."""
        self.finish(stats, token_ids, stop)
        answer = answers.response(
            self.request,
            self.text,
            self.reason,
            self.prompt_tokens,
            self._completion_tokens(stats),
            stats,
            self._logprobs(len(self.text), final=True),
        )
        if self.request.prompt_logprobs is not None:
            answer["choices"][0]["prompt_logprobs"] = self._prompt_entries()
        return answer

    def _prompt_entries(self) -> list:
        """vLLM's `prompt_logprobs`: null for the first prompt token, then per token a map of token
        id to its logprob, rank and text, for the token itself and the N most likely."""
        entries: list = [None]
        for token, logprob in zip(self.prompt_ids[1:], self.prompt_logprobs):
            shown = {token: (logprob.logprob, logprob.rank)}
            for rank, (other, value) in enumerate(logprob.top[: self.request.prompt_logprobs], 1):
                shown.setdefault(other, (value, rank))
            entries.append(
                {
                    str(t): {
                        "logprob": max(v, -9999.0),
                        "rank": r,
                        "decoded_token": self.tokenizer.decode([t]),
                    }
                    for t, (v, r) in shown.items()
                }
            )
        return entries

    def _completion_tokens(self, stats: Stats) -> int:
        return 0 if self.request.max_zero else stats.new_tokens

    def _echo(self, joined: Joined, stats: Stats) -> list[dict]:
        """The prompt, first in the answer (as sent when it was text), with its tokens' logprobs
        from the prefill: none for the first token, which nothing predicts."""
        ids = self.prompt_ids
        text = self.prompt.text
        prompt = text if isinstance(text, str) else self.tokenizer.decode(ids)
        if joined.prompt_logprobs:  # each token's text, incrementally (no re-decoding of the prefix)
            stream, end = TextStream(self.tokenizer), 0
            for i, token in enumerate(ids):
                start, end = end, end + len(stream.push(token))
                self.tokens.append((start, end, token, joined.prompt_logprobs[i - 1] if i else None))
        self.text, self.chars, self.floor = prompt, len(prompt), len(prompt)
        return self._chunks({}, stats, final=False)

    # -- text -------------------------------------------------------------------------------------
    def _extend(self, piece: str) -> None:
        """Append final text; cut it at the first stop string, which ends the answer."""
        if not piece or self.stopped:
            return
        start = max(self.floor, len(self.text) - self.hold)
        self.text += piece
        found = [(i, -len(s)) for s in self.request.stops if (i := self.text.find(s, start)) >= 0]
        if found:  # the earliest, and the longest there; kept with include_stop_str_in_output
            at, minus = min(found)
            self.text = self.text[: at - minus if self.request.include_stop else at]
            self.stopped = True

    def _chunks(self, live: dict, stats: Stats, final: bool) -> list[dict]:
        if not self.request.stream:
            return []
        end = len(self.text) if final or self.stopped else max(self.sent, len(self.text) - self.hold)
        text = self.text[self.sent : end]
        self.sent = end
        extra = {**live, "stats": stats.as_dict()} if self.request.live and live else None
        if not text and extra is None and self.started:
            return []
        first = not self.started
        self.started = True
        return [
            answers.chunk(
                self.request, text, None, extra, first=first, logprobs=self._logprobs(end, final=False)
            )
        ]

    def _logprobs(self, end: int, final: bool) -> dict | None:
        """The `logprobs` of the tokens not yet reported whose text ends by character `end` of
        the answer; at the end, every token that starts inside the (stop-cut) answer. Special
        tokens decoded mid-answer have entries; the stop token that ended the row has none when
        it adds no text (an EOS, as in OpenAI's answers), one when it does (a request's stop id
        that is an ordinary token, as vLLM keeps it)."""
        if self.request.config.sampling.logprobs is None:
            return None
        cut = len(self.text)
        chosen = []
        for start, stop, token, logprob in self.tokens[self.reported :]:
            if not final and stop > end:
                break
            self.reported += 1
            if self.reported - 1 == self.ended_at or (final and self.stopped and start >= cut):
                continue
            chosen.append((start, token, logprob))
        entries = logprob_entries(
            [token for _, token, _ in chosen], [lp for _, _, lp in chosen], self.bytes_of
        )
        return answers.logprobs_field(self.request, entries, [start for start, _, _ in chosen])

    def _kept_ids(self, token_ids: list[int]) -> list[int]:
        """The token ids behind the final text (all of them unless a stop string cut it)."""
        if not self.stopped:
            return token_ids
        decode = self.tokenizer.decode
        low, high = 0, len(token_ids)  # the shortest prefix whose text is as long as the answer
        while low < high:
            middle = (low + high) // 2
            if len(decode(token_ids[:middle], skip_special_tokens=True)) >= len(self.text):
                high = middle
            else:
                low = middle + 1
        return token_ids[:low]
