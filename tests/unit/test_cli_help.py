"""`ibex --help` lists every command the parser has, one line each, and each listed command has its own help."""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import pytest

from ibex_dataplane.cli import build_parser
from tests.support.processes import IBEX, REPO


def runnable(parser: argparse.ArgumentParser, prefix: str = "") -> list[tuple[str, str]]:
    """The parser's runnable commands (walked here, not with the CLI's own helper) and their descriptions."""
    found: list[tuple[str, str]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                nested = runnable(child, f"{prefix}{name} ")
                found += nested or [(f"{prefix}{name}", child.description or "")]
    return found


def listed(help_text: str) -> list[tuple[str, str]]:
    section = help_text.split("commands (add --help after one for its flags):\n", 1)[1]
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^  (\S+(?: \S+)?)\s{2,}(.+)$", section, re.MULTILINE)]


def test_help_lists_every_command_of_the_parser_on_one_line_each() -> None:
    done = subprocess.run([*IBEX, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: ibex [-h] COMMAND ...")
    commands = runnable(build_parser())
    assert {"dev", "proxy", "memory", "context", "keys issue", "eval locomo", "migrate", "operator"} <= {
        c for c, _ in commands
    }
    assert listed(done.stdout) == commands
    assert all(summary for _, summary in commands)
    section = done.stdout.split("commands (", 1)[1].splitlines()[1:]
    assert len(section) == len(commands) and all(len(line) <= 100 for line in section)  # no wrapped lines


@pytest.mark.parametrize("command", [c for c, _ in runnable(build_parser())])
def test_each_listed_command_has_its_own_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*command.split(), "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: ibex {command} ")
    assert dict(runnable(build_parser()))[command] in out


def test_a_command_group_without_its_subcommand_lists_them(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["keys", "--help"])
    assert listed(capsys.readouterr().out) == [("issue", "issue a key for agents of an organization (local stores)")]


def test_the_readme_mentions_every_command() -> None:
    readme = (Path(REPO) / "README.md").read_text()
    assert [c for c, _ in runnable(build_parser()) if f"`ibex {c}" not in readme] == []


def test_the_welcome_uses_the_agents_default_model_and_says_when_no_key_may_chat() -> None:
    from ibex_dataplane.cli import DevKey, _default_models, dev_welcome
    from ibex_operator.manifests import load_manifests

    models = _default_models([m.resource for m in load_manifests(Path(REPO) / "examples" / "tenants")])
    assert models[("tenants", "support-bot")] == "echo"
    memory_only = DevKey("t/k", "ibex_sk_a_b", "acme", ("bot",), ("memory:read",), "echo")
    text = dev_welcome("http://127.0.0.1:1", [memory_only], Path("keys.json"), python="python")
    assert "scopes memory:read" in text and "No key has the chat scope" in text and "curl" not in text
    chat = DevKey("t/c", "ibex_sk_c_d", "acme", ("bot",), ("chat",), "llama3.1:8b")
    text = dev_welcome("http://127.0.0.1:1", [memory_only, chat], Path("keys.json"), python="python")
    assert '"model": "llama3.1:8b"' in text and 'model="llama3.1:8b"' in text and "Bearer ibex_sk_c_d" in text
