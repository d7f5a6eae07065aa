"""Chat body validation names the exact field of every problem and lets unknown fields through."""

from __future__ import annotations

from typing import Any

import pytest

from ibex_dataplane.proxy.validation import chat_field_errors

OK: dict[str, Any] = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}


def fields(body: Any) -> set[str]:
    return {e["field"] for e in chat_field_errors(body)}


def test_a_plain_body_and_unknown_fields_are_accepted() -> None:
    assert chat_field_errors(OK) == []
    assert chat_field_errors({**OK, "vendor_extension": {"anything": [1, 2]}, "seed": 7}) == []


@pytest.mark.parametrize(
    ("patch", "expected"),
    [
        ({"messages": []}, {"messages"}),
        ({"messages": "hi"}, {"messages"}),
        ({"messages": [{"role": "robot", "content": "x"}]}, {"messages[0].role"}),
        ({"messages": [{"role": "user"}]}, {"messages[0].content"}),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, {"messages[0].content[0].text"}),
        ({"messages": [{"role": "tool", "content": "r"}]}, {"messages[0].tool_call_id"}),
        ({"max_tokens": 0}, {"max_tokens"}),
        ({"max_tokens": True}, {"max_tokens"}),
        ({"temperature": 2.5}, {"temperature"}),
        ({"stream": "yes"}, {"stream"}),
        ({"stream_options": {"include_usage": True}}, {"stream_options"}),
        ({"stop": ["a", "b", "c", "d", "e"]}, {"stop"}),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, {"tools[0].function.name"}),
        ({"tools": [{"type": "function", "function": {"name": "ok\n"}}]}, {"tools[0].function.name"}),
        ({"n": 2}, {"n"}),
        ({"model": 7}, {"model"}),
    ],
)
def test_each_problem_names_its_field(patch: dict[str, Any], expected: set[str]) -> None:
    assert fields({**OK, **patch}) == expected


def test_assistant_tool_calls_may_have_no_content() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = {**OK, "messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]}
    assert chat_field_errors(body) == []


def test_a_body_that_is_not_an_object_is_reported() -> None:
    assert fields([1, 2]) == {"(body)"}
