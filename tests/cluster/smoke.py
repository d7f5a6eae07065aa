"""The smoke test of an installed release, from a client outside the cluster: a chat whose echo carries the example
agent's directive, a memory written through the proxy, and the next chat that gets it injected.

Used by tests/cluster/test_chart_on_cluster.py, and by examples/kind/kind.sh as a command (from the repository root,
with the venv of .ci/setup, which has the OpenAI SDK):

    .venv/bin/python -m tests.cluster.smoke --proxy http://127.0.0.1:8080 --token-file support-bot.key
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.request
from collections.abc import Sequence

from openai import OpenAI

AGENT = "support-bot"  # examples/tenants
DIRECTIVE = "support assistant for Acme"
FACT = "The customer prefers email over phone calls."
QUESTION = "How should we contact the customer?"


def chat(proxy: str, token: str, agent: str, content: str) -> tuple[str, dict[str, str]]:
    with OpenAI(base_url=proxy + "/v1", api_key=token, max_retries=0, default_headers={"X-IBEX-Agent-ID": agent}) as ai:
        raw = ai.chat.completions.with_raw_response.create(
            model="echo", messages=[{"role": "user", "content": content}]
        )
        return raw.parse().choices[0].message.content or "", dict(raw.headers)


def directed_chat(proxy: str, token: str, agent: str, directive: str, timeout: float = 60.0) -> str:
    """A chat whose echo carries the agent's directive: the reconciled Directive reaches the proxy's cache through
    its invalidation event, so the first chats after ``Ready`` may still see the agent without it."""
    deadline = time.monotonic() + timeout
    while True:
        echoed, _ = chat(proxy, token, agent, "hello")
        if directive in echoed or time.monotonic() > deadline:
            return echoed
        time.sleep(0.2)  # polling for a condition under a deadline


def write_memory(proxy: str, token: str, agent: str, fact: str) -> None:
    request = urllib.request.Request(
        proxy + "/v1/memories",
        data=json.dumps({"content": fact}).encode(),
        headers={"Authorization": f"Bearer {token}", "X-IBEX-Agent-ID": agent, "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        assert resp.status == 201, resp.status


def recalled(proxy: str, token: str, agent: str = AGENT, fact: str = FACT) -> bool:
    """Whether the next chat gets ``fact`` injected as a memory."""
    echoed, headers = chat(proxy, token, agent, QUESTION)
    return headers.get("x-ibex-memories-injected") == "1" and fact in echoed


def first_chat_and_memory(proxy: str, token: str, agent: str = AGENT, fact: str = FACT) -> None:
    """The directive reaches the agent's chats; a memory written through the proxy is injected, fenced, into the
    next chat. Raises AssertionError saying what did not happen."""
    echoed = directed_chat(proxy, token, agent, DIRECTIVE)
    assert DIRECTIVE in json.loads(echoed)[0]["content"], f"the directive never reached the chat: {echoed[:500]}"
    write_memory(proxy, token, agent, fact)
    echoed, headers = chat(proxy, token, agent, QUESTION)
    assert headers.get("x-ibex-memories-injected") == "1", headers
    memory_message = json.loads(echoed)[-1]["content"]
    assert re.search(r'<memory nonce="[a-p]{16}" id="[0-9a-f-]{36}">' + re.escape(fact), memory_message), (
        memory_message[:500]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="smoke-test an installed IBEX release through its proxy")
    parser.add_argument("--proxy", required=True, help="the proxy's base URL, e.g. http://127.0.0.1:8080")
    parser.add_argument("--token-file", required=True, help=f"a file holding the API key of {AGENT}")
    args = parser.parse_args(argv)
    with open(args.token_file) as f:
        token = f.read().strip()
    try:
        first_chat_and_memory(args.proxy, token)
    except AssertionError as e:
        print(f"smoke test failed: {e}", file=sys.stderr)
        return 1
    print("smoke test passed: the directive, a memory written and recalled through the proxy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
