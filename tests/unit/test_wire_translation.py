"""The pure translators between wire formats: Chat Completions <-> Anthropic Messages (both directions, as a
provider and as an edge) and the Responses API -> Chat Completions."""

from __future__ import annotations

import orjson
import pytest

from ibex_dataplane.providers.anthropic import anthropic_to_chat, chat_to_anthropic
from ibex_dataplane.providers.base import Usage
from ibex_dataplane.proxy.edge import RenderContext
from ibex_dataplane.proxy.edge_messages import MessagesEncoder, chat_to_message, messages_to_chat
from ibex_dataplane.proxy.edge_responses import ResponsesEncoder, responses_to_chat
from ibex_dataplane.shared.errors import ApiError

CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}
CTX = RenderContext(request_id="r1", model="m", created=1, prompt_tokens=5, client_body={})


def test_every_system_message_is_folded_in_order_and_tool_results_share_one_user_turn() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "directive"},
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "a"},
            {"role": "tool", "tool_call_id": "call_2", "content": "b"},
            {"role": "system", "content": [{"type": "text", "text": "memories"}]},
        ],
        "tool_choice": "required", "parallel_tool_calls": False, "stop": "END",
        "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}],
    }  # fmt: skip
    sent = chat_to_anthropic(body, "claude", 99)
    assert sent["system"] == "directive\n\nmemories" and sent["max_tokens"] == 99
    assert [t["role"] for t in sent["messages"]] == ["user", "assistant", "user"]
    assert [b["tool_use_id"] for b in sent["messages"][2]["content"]] == ["call_1", "call_2"]
    assert sent["messages"][1]["content"][0] == {"type": "tool_use", "id": "call_1", "name": "lookup",
                                                 "input": {"q": "x"}}  # fmt: skip
    assert sent["tool_choice"] == {"type": "any", "disable_parallel_tool_use": True}
    assert sent["stop_sequences"] == ["END"]


@pytest.mark.parametrize(
    ("stop_reason", "finish"),
    [("end_turn", "stop"), ("max_tokens", "length"), ("tool_use", "tool_calls"), ("refusal", "content_filter")],
)
def test_anthropic_answers_become_chat_completions_with_cache_tokens_in_the_prompt(
    stop_reason: str, finish: str
) -> None:
    message = {
        "id": "msg_1", "type": "message", "role": "assistant", "stop_reason": stop_reason,
        "content": [{"type": "text", "text": "hi"}, {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}],
        "usage": {"input_tokens": 10, "output_tokens": 3, "cache_read_input_tokens": 4,
                  "cache_creation_input_tokens": 2},
    }  # fmt: skip
    body, usage = anthropic_to_chat(message, "claude")
    assert usage == Usage(16, 3, estimated=False)
    choice = body["choices"][0]
    assert choice["finish_reason"] == finish and choice["message"]["content"] == "hi"
    assert orjson.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"a": 1}
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 4


def test_a_messages_body_becomes_chat_and_its_answer_a_message() -> None:
    chat = messages_to_chat({
        "model": "m", "max_tokens": 10, "system": [{"type": "text", "text": "sys"}],
        "messages": [
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": "AAA"}}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]},
        ],
    })  # fmt: skip
    assert chat["messages"][0] == {"role": "system", "content": "sys"}
    assert chat["messages"][1]["content"][0]["image_url"]["url"] == "data:image/png;base64,AAA"
    assert chat["messages"][2]["tool_calls"][0]["id"] == "t1" and chat["messages"][3]["role"] == "tool"
    completion = {"choices": [{"message": {"content": "x", "tool_calls": [CALL]}, "finish_reason": "tool_calls"}],
                  "usage": {"prompt_tokens_details": {"cached_tokens": 2}}}  # fmt: skip
    message = chat_to_message(completion, Usage(7, 1, estimated=False), CTX)
    assert message["stop_reason"] == "tool_use" and message["content"][1]["input"] == {"q": "x"}
    assert message["usage"]["input_tokens"] == 5 and message["usage"]["cache_read_input_tokens"] == 2


def test_a_chat_stream_becomes_the_messages_event_sequence() -> None:
    encoder = MessagesEncoder(CTX)
    frames: list[bytes] = []
    for delta in ({"role": "assistant", "content": ""}, {"content": "he"}, {"content": "y"},
                  {"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": "{}"}}]}):  # fmt: skip
        frames += encoder.chunk(orjson.dumps({"choices": [{"index": 0, "delta": delta}]}))
    frames += encoder.finish(Usage(5, 2, estimated=False), "tool_calls")
    events = [orjson.loads(f.split(b"data: ", 1)[1]) for f in frames]
    kinds = [e["type"] for e in events]
    assert kinds == ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]  # fmt: skip
    assert events[-2]["delta"]["stop_reason"] == "tool_use" and events[-2]["usage"]["output_tokens"] == 2


def test_responses_input_items_become_chat_and_unsupported_fields_are_refused() -> None:
    chat = responses_to_chat({
        "instructions": "be brief", "max_output_tokens": 5,
        "input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                  {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "r"}],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
    })  # fmt: skip
    assert chat["messages"][0] == {"role": "system", "content": "be brief"}
    assert [c["id"] for c in chat["messages"][1]["tool_calls"]] == ["c1", "c2"]  # consecutive calls share a turn
    assert chat["max_completion_tokens"] == 5 and chat["response_format"]["type"] == "json_schema"
    with pytest.raises(ApiError) as refused:
        responses_to_chat({"input": "x", "previous_response_id": "resp_1", "tools": [{"type": "web_search"}]})
    assert {e["field"] for e in refused.value.field_errors or []} == {"previous_response_id", "tools[0]"}


def test_a_cut_chat_stream_becomes_an_incomplete_response() -> None:
    encoder = ResponsesEncoder(CTX)
    frames = encoder.chunk(orjson.dumps({"choices": [{"index": 0, "delta": {"content": "abc"}}]}))
    frames += encoder.finish(Usage(5, 1, estimated=True), "length")
    kinds = [orjson.loads(f.split(b"data: ", 1)[1])["type"] for f in frames]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    final = encoder.final()
    assert final is not None and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["content"][0]["text"] == "abc"
    assert [f["sequence_number"] for f in map(lambda f: orjson.loads(f.split(b"data: ", 1)[1]), frames)] == list(
        range(len(frames)))  # fmt: skip
