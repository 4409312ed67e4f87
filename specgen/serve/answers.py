"""The OpenAI wire format of answers: a whole response, stream chunks, the usage chunk, each
choice's `logprobs`, specgen's `speculative` summary, and the answers of n choices merged into
one. Requests are read in reading.py. No torch here.
"""

from __future__ import annotations

import functools

from specgen.decoding.stats import Stats
from specgen.serve.api import ApiRequest


def finish_reason(stop: str | None) -> str:
    """OpenAI's finish_reason for an engine stop: a stop string or EOS is "stop", a budget "length"."""
    return "length" if stop in ("length", "context") else "stop"


def usage(prompt_tokens: int, completion_tokens: int, stats) -> dict:
    """OpenAI's usage; `cached_tokens`: prompt tokens whose K/V came from an earlier request
    (a kept row or the prefix store) instead of a prefill."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.reused_tokens},
    }


def speculative_summary(stats) -> dict:
    """The `speculative` field of a response: what the drafting did for this request (a Stats)."""
    data = stats.as_dict()
    keys = (
        "drafted",
        "accepted",
        "acceptance_rate",
        "target_forwards",
        "tokens_per_target_forward",
        "accepted_length_histogram",
        "time_to_first_token",
        "decode_tokens_per_second",
        "tokens_per_second",  # its old name, kept for one release
    )
    return {"method": stats.method, **{k: data[k] for k in keys}}


def logprobs_field(request: ApiRequest, entries: list[dict], offsets: list[int]) -> dict | None:
    """A choice's `logprobs` in OpenAI's shape for `entries` (views.logprob_entries: each token's
    text, exact bytes, log-probability and alternatives) starting at `offsets` in the answer, or
    None when the request did not ask. Chat: `content` with each token's bytes; completions:
    the legacy parallel lists with `text_offset`."""
    if request.config.sampling.logprobs is None:
        return None

    def number(value: float | None) -> float | None:
        return None if value is None else max(value, -9999.0)  # OpenAI's floor (JSON has no -inf)

    def item(entry: dict) -> dict:
        return {"token": entry["token"], "logprob": number(entry["logprob"]), "bytes": entry["bytes"]}

    if request.kind == "chat":
        return {
            "content": [{**item(e), "top_logprobs": [item(t) for t in e["top"]]} for e in entries],
            "refusal": None,
        }
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [number(e["logprob"]) for e in entries],
        "top_logprobs": [
            None if e["top"] is None else {t["token"]: number(t["logprob"]) for t in e["top"]}
            for e in entries
        ],
        "text_offset": offsets,
    }


def response(
    request: ApiRequest,
    text: str,
    reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    stats,
    logprobs: dict | None = None,
) -> dict:
    """A whole (non-streamed) answer."""
    if request.kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": reason,
            "logprobs": logprobs,
        }
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": logprobs}
        kind = "text_completion"
    return {
        "id": request.id,
        "object": kind,
        "created": request.created,
        "model": request.model,
        "choices": [choice],
        "usage": usage(prompt_tokens, completion_tokens, stats),
        "speculative": speculative_summary(stats),
    }


def chunk(
    request: ApiRequest,
    text: str | None,
    reason: str | None = None,
    extra: dict | None = None,
    first: bool = False,
    logprobs: dict | None = None,
) -> dict:
    """One streamed piece: new text (or only a finish reason), its tokens' `logprobs` when asked,
    and specgen's extension."""
    if request.kind == "chat":
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
        kind = "text_completion"
    out = {
        "id": request.id,
        "object": kind,
        "created": request.created,
        "model": request.model,
        "choices": [choice],
    }
    if extra:
        out["speculative"] = extra
    return out


def usage_chunk(request: ApiRequest, prompt_tokens: int, completion_tokens: int, stats) -> dict:
    """The last chunk with stream_options.include_usage: no choices, the usage."""
    kind = "chat.completion.chunk" if request.kind == "chat" else "text_completion"
    return {
        "id": request.id,
        "object": kind,
        "created": request.created,
        "model": request.model,
        "choices": [],
        "usage": usage(prompt_tokens, completion_tokens, stats),
        "speculative": speculative_summary(stats),
    }


def merged(request: ApiRequest, answers: list[dict]) -> dict:
    """One answer of n choices from the n choices' answers: their choices in order (each with
    its own `speculative` summary), usage summed over the choices (the prompt counted once),
    the speculation's totals (the choices' Stats merged)."""
    if len(answers) == 1:
        return answers[0]
    out = dict(answers[0])
    out["choices"] = [
        {**a["choices"][0], "index": i, "speculative": a["speculative"]} for i, a in enumerate(answers)
    ]
    out["usage"] = _summed_usage([a["usage"] for a in answers], request.n)
    total = functools.reduce(Stats.merge, map(_counted, answers))
    out["speculative"] = {
        "method": answers[0]["speculative"]["method"],
        "drafted": total.drafted,
        "accepted": total.accepted,
        "acceptance_rate": total.acceptance_rate,
        "target_forwards": total.target_forwards,
        "tokens_per_target_forward": total.tokens_per_target_forward,
    }
    return out


def _counted(answer: dict) -> Stats:
    """What a choice's answer counts of its Stats: tokens, drafts and target forwards (as rounds:
    the replays are among them)."""
    summary = answer["speculative"]
    return Stats(
        method=summary["method"],
        new_tokens=answer["usage"]["completion_tokens"],
        drafted=summary["drafted"],
        accepted=summary["accepted"],
        rounds=summary["target_forwards"],
    )


def merged_usage(chunks: list[dict], n: int = 1) -> dict:
    """The one usage chunk of a streamed request of n choices per prompt, from each choice's (in order)."""
    out = dict(chunks[0])
    out["usage"] = _summed_usage([c["usage"] for c in chunks], n)
    out.pop("speculative", None)  # per choice: on each choice's last chunk
    return out


def _summed_usage(usages: list[dict], n: int = 1) -> dict:
    """Each prompt once (the first choice of each group of `n`; cached tokens as the first choice
    found them), the choices' tokens summed."""
    completion = sum(u["completion_tokens"] for u in usages)
    prompt = sum(u["prompt_tokens"] for u in usages[:: max(n, 1)])
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": usages[0]["prompt_tokens_details"],
    }
