"""The model catalog: built-in entries, configuration, and exact cost arithmetic."""

from __future__ import annotations

from decimal import Decimal

import pytest

from ibex_dataplane.providers.catalog import CatalogConfigError, ModelCatalog, ModelInfo
from ibex_dataplane.providers.errors import UnknownModel
from ibex_dataplane.providers.tokens import TokenizerFamily


def test_echo_is_built_in_offline_and_priced_one_and_two_dollars_by_default() -> None:
    echo = ModelCatalog.builtin().require("echo")
    assert echo == ModelInfo(
        name="echo",
        provider="echo",
        context_window=128_000,
        max_output_tokens=4096,
        tokenizer_family=TokenizerFamily.GENERIC,
        input_price_per_mtok=Decimal("1.00"),
        output_price_per_mtok=Decimal("2.00"),
    )


def test_echo_prices_come_from_the_caller() -> None:
    catalog = ModelCatalog.builtin(
        echo_input_price_per_mtok=Decimal("0.50"), echo_output_price_per_mtok=Decimal("0.75")
    )
    assert catalog.cost("echo", 2_000_000, 4_000_000) == Decimal("4.00")


def test_well_known_openai_models_route_to_the_openai_provider() -> None:
    catalog = ModelCatalog.builtin()
    for name in ("gpt-4o", "gpt-4o-mini", "gpt-4.1", "gpt-4.1-mini"):
        model = catalog.require(name)
        assert model.provider == "openai"
        assert model.tokenizer_family is TokenizerFamily.OPENAI_O200K
        assert 0 < model.max_output_tokens < model.context_window
        assert model.input_price_per_mtok < model.output_price_per_mtok
    assert catalog.require("gpt-4o-mini").input_price_per_mtok < catalog.require("gpt-4o").input_price_per_mtok


def test_lookup_is_by_exact_name() -> None:
    catalog = ModelCatalog.builtin()
    assert "gpt-4o" in catalog
    assert catalog.get("GPT-4o") is None
    assert catalog.get("gpt-4o-2024-08-06") is None
    with pytest.raises(UnknownModel):
        catalog.require("gpt-4")


def test_cost_is_exact_decimal_per_million_tokens() -> None:
    catalog = ModelCatalog.builtin()
    assert catalog.cost("gpt-4o", 1234, 567) == Decimal("0.003085") + Decimal("0.00567")
    assert catalog.cost("echo", 1, 0) == Decimal("0.000001")
    assert catalog.cost("echo", 0, 0) == 0
    with pytest.raises(ValueError, match="negative"):
        catalog.cost("echo", -1, 0)


def test_worst_case_cost_uses_max_tokens_capped_by_the_models_max_output() -> None:
    catalog = ModelCatalog.builtin()
    assert catalog.worst_case_cost("echo", 1000, 100) == catalog.cost("echo", 1000, 100)
    assert catalog.worst_case_cost("echo", 1000, None) == catalog.cost("echo", 1000, 4096)
    assert catalog.worst_case_cost("echo", 1000, 1_000_000) == catalog.cost("echo", 1000, 4096)
    assert catalog.worst_case_cost("gpt-4o", 0, None) == Decimal("0.16384")


def test_configuration_adds_models_and_overrides_built_ins() -> None:
    config = {
        "models": [
            {
                "name": "llama-3.1-8b",
                "provider": "local-vllm",
                "context_window": 131072,
                "max_output_tokens": 8192,
                "tokenizer_family": "openai_cl100k",
                "input_price_per_mtok": "0",
                "output_price_per_mtok": "0",
            },
            {
                "name": "gpt-4o",
                "provider": "openai",
                "context_window": 128000,
                "max_output_tokens": 16384,
                "tokenizer_family": "openai_o200k",
                "input_price_per_mtok": "2.00",
                "output_price_per_mtok": "8.00",
            },
        ],
        "providers": {"local-vllm": {"type": "openai_compat", "base_url": "http://127.0.0.1:8000/v1"}},
    }
    catalog = ModelCatalog.from_config(config, echo_input_price_per_mtok=Decimal("3"))
    llama = catalog.require("llama-3.1-8b")
    assert llama.provider == "local-vllm"
    assert llama.tokenizer_family is TokenizerFamily.OPENAI_CL100K
    assert catalog.require("gpt-4o").input_price_per_mtok == Decimal("2.00")
    assert catalog.require("echo").input_price_per_mtok == Decimal("3")
    assert "gpt-4.1" in catalog
    only_config = ModelCatalog.from_config(config, include_builtins=False)
    assert only_config.names() == ["gpt-4o", "llama-3.1-8b"]


@pytest.mark.parametrize(
    "entry",
    [
        {"provider": "nowhere"},
        {"context_window": 0},
        {"max_output_tokens": 300_000},
        {"input_price_per_mtok": "-1"},
        {"tokenizer_family": "sentencepiece"},
        {"surprise": True},
    ],
)
def test_invalid_model_entries_are_rejected(entry: dict[str, object]) -> None:
    base: dict[str, object] = {
        "name": "m",
        "provider": "echo",
        "context_window": 1000,
        "max_output_tokens": 100,
        "input_price_per_mtok": "1",
        "output_price_per_mtok": "1",
    }
    with pytest.raises(CatalogConfigError):
        ModelCatalog.from_config({"models": [{**base, **entry}]})
