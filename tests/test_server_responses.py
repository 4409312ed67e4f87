"""OpenAI's Responses API (`POST /v1/responses`) on the tiny pair, driven by the official
`openai` client: a response is the chat completion its input means, streamed as the Responses
events; what the server cannot do (stored responses, tools, other item types) is refused."""

from __future__ import annotations

import pytest

from test_server import model, pair, raw, sdk, served  # noqa: F401

openai = pytest.importorskip("openai")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a haiku about caches"}]


def chat_answer(served, sdk, max_tokens: int, messages=MESSAGES):
    return sdk.chat.completions.create(model=model(served), messages=messages, max_tokens=max_tokens, temperature=0)


def test_a_response_is_the_chat_completion_its_input_means(served, sdk):
    expected = chat_answer(served, sdk, 10)
    given = [{"role": "user", "content": [{"type": "input_text", "text": "Write a haiku "},
                                          {"type": "input_text", "text": "about caches"}]}]
    response = sdk.responses.create(model=model(served), instructions="Be brief.", input=given,
                                    max_output_tokens=10, temperature=0)
    assert response.output_text == expected.choices[0].message.content
    assert response.id.startswith("resp_") and response.output[0].type == "message"
    assert response.usage.input_tokens == expected.usage.prompt_tokens and response.usage.output_tokens == 10
    cut = expected.choices[0].finish_reason == "length"
    assert response.status == ("incomplete" if cut else "completed")
    assert (response.incomplete_details is not None) == cut
    assert response.model_extra["speculative"]["method"] == "chain"
    # a plain string input is one user message
    alone = sdk.responses.create(model=model(served), input="Write a haiku about caches", max_output_tokens=6,
                                 temperature=0)
    assert alone.output_text == chat_answer(served, sdk, 6, MESSAGES[1:]).choices[0].message.content


def test_a_streamed_response_sends_the_responses_events(served, sdk):
    expected = chat_answer(served, sdk, 8).choices[0].message.content
    with sdk.responses.stream(model=model(served), instructions="Be brief.", input=MESSAGES[1:],
                              max_output_tokens=8, temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert final.output_text == expected and final.usage.output_tokens == 8


@pytest.mark.parametrize("extra, param, fragment", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
    ({"tools": [{"type": "web_search"}]}, "tools", "not supported"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input[0]", "only message items"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content",
     "only text"),
    ({"input": []}, "input", "non-empty"),
    ({"max_output_tokens": 0}, "max_output_tokens", "'max_output_tokens' must be an integer"),
    ({"input": "x" * 400}, "input", "context holds"),
    ({"frobnicate": 1}, "frobnicate", "unknown parameter"),
])
def test_what_the_server_cannot_do_is_refused(served, extra, param, fragment):
    status, body, _ = raw(served, "POST", "/v1/responses", {"model": model(served), "input": "hi", **extra})
    assert status == 400 and body["error"]["param"] == param and fragment in body["error"]["message"], body


def test_responses_count_under_their_own_endpoint(served, sdk):
    sdk.responses.create(model=model(served), input="hi", max_output_tokens=2)
    text = raw(served, "GET", "/metrics")[1]
    assert 'specgen_requests_total{endpoint="responses",status="length"}' in text \
        or 'specgen_requests_total{endpoint="responses",status="stop"}' in text
