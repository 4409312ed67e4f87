"""OpenAI's Responses API (`POST /v1/responses`) on the tiny pair, driven by the official
`openai` client: a response is the chat completion its input means, streamed as the Responses
events; what the server cannot do (stored responses, tools, other item types) is refused."""

from __future__ import annotations

import pytest
from test_server import model, pair, raw, sdk, served  # noqa: F401

openai = pytest.importorskip("openai")
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Write a haiku about caches"},
]


def chat_answer(served, sdk, max_tokens: int, messages=MESSAGES):
    return sdk.chat.completions.create(
        model=model(served), messages=messages, max_tokens=max_tokens, temperature=0
    )


def test_a_response_is_the_chat_completion_its_input_means(served, sdk):
    expected = chat_answer(served, sdk, 10)
    given = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Write a haiku "},
                {"type": "input_text", "text": "about caches"},
            ],
        }
    ]
    response = sdk.responses.create(
        model=model(served), instructions="Be brief.", input=given, max_output_tokens=10, temperature=0
    )
    assert response.output_text == expected.choices[0].message.content
    assert response.id.startswith("resp_") and response.output[0].type == "message"
    assert response.usage.input_tokens == expected.usage.prompt_tokens and response.usage.output_tokens == 10
    cut = expected.choices[0].finish_reason == "length"
    assert response.status == ("incomplete" if cut else "completed")
    assert (response.incomplete_details is not None) == cut
    assert response.model_extra["speculative"]["method"] == "lookup-chain"  # the default
    # a plain string input is one user message
    alone = sdk.responses.create(
        model=model(served), input="Write a haiku about caches", max_output_tokens=6, temperature=0
    )
    assert alone.output_text == chat_answer(served, sdk, 6, MESSAGES[1:]).choices[0].message.content


def test_a_streamed_response_sends_the_responses_events(served, sdk):
    answer = chat_answer(served, sdk, 8).choices[0]
    cut = answer.finish_reason == "length"
    stream = sdk.responses.create(
        model=model(served),
        instructions="Be brief.",
        input=MESSAGES[1:],
        max_output_tokens=8,
        temperature=0,
        stream=True,
    )
    events = list(stream)
    kinds = [event.type for event in events]
    ending = "response.incomplete" if cut else "response.completed"  # as OpenAI ends a stream the budget cut
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        ending,
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == answer.message.content and final.usage.output_tokens == 8
    assert (
        final.status
        == events[-2].item.status
        == final.output[0].status
        == ("incomplete" if cut else "completed")
    )


def _asked(served, **body):
    from specgen.serve import responses

    return responses.read(
        {"model": model(served), "input": "hi", **body}, served.state.defaults, {model(served)}
    )


async def _events(asked, chunks) -> list[tuple[str, dict]]:
    import json

    from specgen.serve import responses

    async def given():
        for chunk in chunks:
            yield chunk

    out = []
    async for text in responses.events(asked, given()):
        kind, data = text.split("\n")[:2]
        out.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_a_stream_that_stops_completes_and_one_that_fails_says_so(served):
    import asyncio

    from specgen.serve import api

    usage = {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    piece = {"choices": [{"index": 0, "delta": {"content": "ab"}, "finish_reason": None}]}
    stop = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    done = asyncio.run(_events(_asked(served), [piece, stop, {"choices": [], "usage": usage}]))
    assert done[-1][0] == "response.completed" and done[-1][1]["response"]["status"] == "completed"
    assert done[-1][1]["response"]["output"][0]["status"] == "completed"
    failure = api.ApiError(500, "the engine failed: boom", kind="server_error", code="engine_error")
    failed = asyncio.run(_events(_asked(served), [piece, failure]))
    assert [kind for kind, _ in failed[-3:]] == ["response.output_text.delta", "error", "response.failed"]
    response = failed[-1][1]["response"]
    assert response["status"] == "failed" and response["error"] == {
        "code": "engine_error",
        "message": "the engine failed: boom",
    }
    assert (
        response["output"][0]["content"][0]["text"] == "ab"
        and response["output"][0]["status"] == "incomplete"
    )


def test_a_response_repeats_the_request_as_sent(served, sdk):
    plain = sdk.responses.create(
        model=model(served),
        input=[{"role": "developer", "content": "be kind"}, {"role": "user", "content": "hi"}],
    )
    assert (
        plain.instructions is None and plain.max_output_tokens is None
    )  # a system message is not instructions
    assert plain.metadata == {} and plain.tool_choice == "auto" and plain.parallel_tool_calls is True
    given = sdk.responses.create(
        model=model(served),
        instructions="Be brief.",
        input="hi",
        max_output_tokens=2,
        metadata={"run": "7"},
        tool_choice="none",
        parallel_tool_calls=False,
        temperature=None,
        top_p=None,
    )  # null: the default, as the SDK sends unset options
    assert (
        given.instructions == "Be brief." and given.max_output_tokens == 2 and given.metadata == {"run": "7"}
    )
    assert given.tool_choice == "none" and given.parallel_tool_calls is False and given.temperature == 1.0
    chat = sdk.chat.completions.create(
        model=model(served), messages=MESSAGES, max_tokens=2, temperature=None, top_p=None
    )
    assert chat.choices[0].message.content is not None


@pytest.mark.parametrize(
    "extra, param, fragment",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
        ({"tools": [{"type": "web_search"}]}, "tools", "not supported"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]},
            "input[0]",
            "only message items",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content",
            "only text",
        ),
        ({"input": []}, "input", "non-empty"),
        ({"max_output_tokens": 0}, "max_output_tokens", "'max_output_tokens' must be an integer"),
        ({"input": "x" * 400}, "input", "context holds"),
        ({"frobnicate": 1}, "frobnicate", "unknown parameter"),
        ({"input": "word " * 1000}, "input", "context holds"),  # counted piecewise
        ({"instructions": "\ud800"}, "instructions", "'instructions' is not valid"),
        (
            {"input": [{"role": "user", "content": "hi"}, {"role": "user", "content": "\ud800"}]},
            "input[1].content",
            "'input[1].content' is not valid",
        ),
        ({"input": [{"role": "bogus", "content": "hi"}]}, "input[0].role", "input[0] needs a role"),
        ({"metadata": {"k": 1}}, "metadata", "up to 16 strings"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "not supported"),
        ({"text": {"format": {"type": "json_object"}}}, "text", "not supported"),
        ({"text": {"verbosity": "low"}}, "text", "not supported"),
    ],
)
def test_what_the_server_cannot_do_is_refused(served, extra, param, fragment):
    status, body, _ = raw(served, "POST", "/v1/responses", {"model": model(served), "input": "hi", **extra})
    assert status == 400 and body["error"]["param"] == param and fragment in body["error"]["message"], body


@pytest.mark.parametrize(
    "extra",
    [
        {"reasoning": {"effort": None}},
        {"reasoning": {"effort": None, "summary": None}},
        {"text": {"verbosity": "medium"}},
        {"text": {"format": {"type": "text"}, "verbosity": None}},
    ],
)
def test_the_neutral_settings_of_what_the_server_cannot_do_are_taken(served, extra):
    status, body, _ = raw(
        served,
        "POST",
        "/v1/responses",
        {"model": model(served), "input": "hi", "max_output_tokens": 2, **extra},
    )
    assert status == 200, body


def test_responses_count_under_their_own_endpoint(served, sdk):
    sdk.responses.create(model=model(served), input="hi", max_output_tokens=2)
    text = raw(served, "GET", "/metrics")[1]
    assert (
        'specgen_requests_total{endpoint="responses",status="length"}' in text
        or 'specgen_requests_total{endpoint="responses",status="stop"}' in text
    )
