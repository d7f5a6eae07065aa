"""Directive injection modes: where the directive lands, and that the client's list is never changed in place."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from ibex_dataplane.proxy.repository import DirectiveRow
from ibex_dataplane.shared.directives import inject_directive


def directive(mode: str, text: str = "RULES") -> DirectiveRow:
    return DirectiveRow(version=1, content=text, sha256="x", injection_mode=mode)


CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "client system"},
    {"role": "user", "content": "question"},
]


def test_system_first_goes_before_everything_the_client_sent() -> None:
    out = inject_directive(CHAT, directive("SystemFirst"))
    assert out == [{"role": "system", "content": "RULES"}, *CHAT]


def test_system_append_extends_the_clients_system_message() -> None:
    out = inject_directive(CHAT, directive("SystemAppend"))
    assert out == [{"role": "system", "content": "client system\n\nRULES"}, CHAT[1]]
    no_system = inject_directive([CHAT[1]], directive("SystemAppend"))
    assert no_system == [{"role": "system", "content": "RULES"}, CHAT[1]]


def test_user_prepend_goes_before_the_first_user_text() -> None:
    out = inject_directive(CHAT, directive("UserPrepend"))
    assert out == [CHAT[0], {"role": "user", "content": "RULES\n\nquestion"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "q"}]}]
    assert inject_directive(parts, directive("UserPrepend"))[0]["content"] == [
        {"type": "text", "text": "RULES"},
        {"type": "text", "text": "q"},
    ]


@pytest.mark.parametrize("mode", ["SystemFirst", "SystemAppend", "UserPrepend"])
def test_the_callers_messages_are_not_mutated(mode: str) -> None:
    original = copy.deepcopy(CHAT)
    inject_directive(CHAT, directive(mode))
    assert original == CHAT


def test_no_directive_means_an_unchanged_copy() -> None:
    out = inject_directive(CHAT, None)
    assert out == CHAT
    assert out is not CHAT
