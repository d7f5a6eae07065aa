"""Provider API keys in the providers file: by value, from an environment variable, or from a file; a key that
cannot be found stops the process at start with a message naming what is missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ibex_dataplane.cli import _providers_problem, main
from ibex_dataplane.providers.catalog import CatalogConfigError, ModelCatalog, load_provider_config
from ibex_dataplane.providers.registry import ProviderRegistry
from ibex_dataplane.settings import Settings

MODEL = {"name": "llama-local", "provider": "local", "context_window": 8192, "max_output_tokens": 1024,
         "input_price_per_mtok": "0", "output_price_per_mtok": "0"}  # fmt: skip


def providers_file(tmp_path: Path, **entry: object) -> Path:
    path = tmp_path / "providers.json"
    config = {"models": [MODEL], "providers": {"local": {"type": "openai_compat", **entry}}}
    path.write_text(json.dumps(config))
    return path


def key_of(config: dict[str, object]) -> object:
    return config["providers"]["local"].get("api_key")  # type: ignore[index]


def test_api_key_env_is_read_from_the_environment_at_load(tmp_path: Path) -> None:
    path = providers_file(tmp_path, api_key_env="LOCAL_LLM_KEY")
    config = load_provider_config(path, environ={"LOCAL_LLM_KEY": " sk-from-env \n"})
    assert key_of(config) == "sk-from-env"
    assert "api_key_env" not in config["providers"]["local"]
    ProviderRegistry.check_config(config, ModelCatalog.from_config(config))  # what the registry accepts


def test_a_missing_variable_is_a_configuration_error_that_names_it(tmp_path: Path) -> None:
    path = providers_file(tmp_path, api_key_env="LOCAL_LLM_KEY")
    for environ in ({}, {"LOCAL_LLM_KEY": "  "}):
        with pytest.raises(CatalogConfigError, match=r"'local'.*environment variable LOCAL_LLM_KEY \(api_key_env\)"):
            load_provider_config(path, environ=environ)


def test_api_key_file_is_read_relative_to_the_providers_file(tmp_path: Path) -> None:
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "local").write_text("sk-from-file\n")
    config = load_provider_config(providers_file(tmp_path, api_key_file="keys/local"), environ={})
    assert key_of(config) == "sk-from-file"
    absolute = load_provider_config(providers_file(tmp_path, api_key_file=str(tmp_path / "keys" / "local")))
    assert key_of(absolute) == "sk-from-file"


def test_a_missing_or_empty_key_file_is_a_configuration_error_that_names_it(tmp_path: Path) -> None:
    with pytest.raises(CatalogConfigError, match=r"file .*keys/absent \(api_key_file\), which cannot be read"):
        load_provider_config(providers_file(tmp_path, api_key_file="keys/absent"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(CatalogConfigError, match=r"empty"):
        load_provider_config(providers_file(tmp_path, api_key_file="empty"))


def test_only_one_way_of_naming_the_key_is_accepted(tmp_path: Path) -> None:
    path = providers_file(tmp_path, api_key="sk-inline", api_key_env="LOCAL_LLM_KEY")
    with pytest.raises(CatalogConfigError, match="give one of api_key, api_key_env, api_key_file"):
        load_provider_config(path, environ={"LOCAL_LLM_KEY": "x"})


def test_a_plaintext_key_still_works(tmp_path: Path) -> None:
    assert key_of(load_provider_config(providers_file(tmp_path, api_key="sk-inline"), environ={})) == "sk-inline"


def test_the_catalog_alone_never_needs_the_key(tmp_path: Path) -> None:
    """The context stage reads windows and prices from the same file and must start without the proxy's keys."""
    path = providers_file(tmp_path, api_key_env="LOCAL_LLM_KEY")
    config = load_provider_config(path, resolve_keys=False)
    assert "llama-local" in ModelCatalog.from_config(config)
    settings = Settings(_env_file=None, providers_file=path)  # type: ignore[call-arg]
    assert _providers_problem(settings, keys=False) is None
    assert "LOCAL_LLM_KEY" in (_providers_problem(settings, keys=True) or "")


@pytest.mark.parametrize("command", [["proxy"], ["dev", "--data-dir"]])
def test_the_cli_stops_at_start_naming_the_variable_and_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    monkeypatch.setenv("IBEX_PROVIDERS_FILE", str(providers_file(tmp_path, api_key_env="IBEX_TEST_ABSENT_KEY")))
    monkeypatch.delenv("IBEX_TEST_ABSENT_KEY", raising=False)
    if command[0] == "dev":
        command = [*command, str(tmp_path / "data")]
    assert main(command) == 2
    err = capsys.readouterr().err
    assert f"ibex {command[0]}: invalid providers file (IBEX_PROVIDERS_FILE=" in err
    assert "environment variable IBEX_TEST_ABSENT_KEY (api_key_env), which is not set" in err
    assert not (tmp_path / "data").exists()  # nothing was started


def test_a_malformed_entry_stops_the_proxy_at_start_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("IBEX_PROVIDERS_FILE", str(providers_file(tmp_path, api_key="k", base_urll="typo")))
    assert main(["proxy"]) == 2
    assert "base_urll" in capsys.readouterr().err


def test_a_fallback_that_may_cost_more_stops_the_proxy_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "providers.json"
    path.write_text(json.dumps({"providers": {"openai": {"api_key": "k"}}, "fallbacks": {"gpt-4o-mini": ["gpt-4o"]}}))
    monkeypatch.setenv("IBEX_PROVIDERS_FILE", str(path))
    assert main(["proxy"]) == 2
    assert "may cost more" in capsys.readouterr().err
