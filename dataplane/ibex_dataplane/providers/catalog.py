"""The model catalog: what each model is, who serves it and what it costs.

Owns per-model facts (provider, context window, max output, tokenizer family, prices per million tokens) and the
cost arithmetic built on them. The proxy calls ``worst_case_cost`` for the budget hold and ``cost`` to settle;
the context stage reads windows and tokenizer families; the registry routes by ``ModelInfo.provider``.

Built in: the offline ``echo`` model (priced by the caller, 1.00 / 2.00 USD per million by default, so budgets
are real offline), a few OpenAI models routed to the ``openai`` provider and a few Claude models routed to the
``anthropic`` provider. Configuration adds or replaces
entries with the JSON shape ``{"models": [{...}], "providers": {...}}`` (``providers`` is read by the registry;
here it only tells which provider names exist).
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ibex_dataplane.providers.errors import UnknownModel
from ibex_dataplane.providers.tokens import TokenizerFamily

__all__ = [
    "BUILTIN_PROVIDERS",
    "ECHO_MODEL",
    "ECHO_PROVIDER",
    "EMBEDDER_MODEL",
    "EMBEDDER_PROVIDER",
    "OPENAI_PROVIDER",
    "CatalogConfigError",
    "ModelCatalog",
    "ModelInfo",
    "ModelKind",
    "echo_model",
]

ECHO_MODEL: Final = "echo"
ECHO_PROVIDER: Final = "echo"
EMBEDDER_MODEL: Final = "ibex-minilm"
EMBEDDER_PROVIDER: Final = "ibex"  # the built-in, in-process embedder (all-MiniLM-L6-v2)
OPENAI_PROVIDER: Final = "openai"
ANTHROPIC_PROVIDER: Final = "anthropic"
BUILTIN_PROVIDERS: Final = frozenset({ECHO_PROVIDER, OPENAI_PROVIDER, ANTHROPIC_PROVIDER, EMBEDDER_PROVIDER})

_MILLION: Final = Decimal(1_000_000)


class ModelKind(enum.StrEnum):
    """What a model does: generation routes take ``chat`` models, ``/v1/embeddings`` takes ``embedding`` ones."""

    CHAT = "chat"
    EMBEDDING = "embedding"


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Facts about one model. Prices are USD per million tokens. For an embedding model ``context_window`` is
    the longest input it embeds and ``max_output_tokens`` is 1 (it generates nothing)."""

    name: str
    provider: str
    context_window: int
    max_output_tokens: int
    tokenizer_family: TokenizerFamily
    input_price_per_mtok: Decimal
    output_price_per_mtok: Decimal
    kind: ModelKind = ModelKind.CHAT

    def __post_init__(self) -> None:
        if not self.name or not self.provider:
            raise ValueError("model name and provider must be non-empty")
        if self.context_window <= 0 or self.max_output_tokens <= 0:
            raise ValueError(f"{self.name}: context window and max output must be positive")
        if self.max_output_tokens > self.context_window:
            raise ValueError(f"{self.name}: max output exceeds the context window")
        if self.input_price_per_mtok < 0 or self.output_price_per_mtok < 0:
            raise ValueError(f"{self.name}: prices must not be negative")


class CatalogConfigError(ValueError):
    """The catalog configuration is malformed or refers to an unknown provider."""


class _ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    provider: str = Field(min_length=1)
    context_window: int = Field(gt=0)
    max_output_tokens: int = Field(gt=0)
    tokenizer_family: TokenizerFamily = TokenizerFamily.GENERIC
    input_price_per_mtok: Decimal = Field(ge=0)
    output_price_per_mtok: Decimal = Field(ge=0)
    kind: ModelKind = ModelKind.CHAT


class _CatalogSpec(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    models: list[_ModelSpec] = Field(default_factory=list)
    providers: dict[str, Any] = Field(default_factory=dict)


def _openai(name: str, window: int, max_out: int, price_in: str, price_out: str) -> ModelInfo:
    return ModelInfo(
        name=name,
        provider=OPENAI_PROVIDER,
        context_window=window,
        max_output_tokens=max_out,
        tokenizer_family=TokenizerFamily.OPENAI_O200K,
        input_price_per_mtok=Decimal(price_in),
        output_price_per_mtok=Decimal(price_out),
    )


_OPENAI_MODELS: Final = (
    ModelInfo(
        "text-embedding-3-small",
        OPENAI_PROVIDER,
        8191,
        1,
        TokenizerFamily.OPENAI_CL100K,
        Decimal("0.02"),
        Decimal(0),
        ModelKind.EMBEDDING,
    ),
    ModelInfo(
        "text-embedding-3-large",
        OPENAI_PROVIDER,
        8191,
        1,
        TokenizerFamily.OPENAI_CL100K,
        Decimal("0.13"),
        Decimal(0),
        ModelKind.EMBEDDING,
    ),
    _openai("gpt-4o", 128_000, 16_384, "2.50", "10.00"),
    _openai("gpt-4o-mini", 128_000, 16_384, "0.15", "0.60"),
    _openai("gpt-4.1", 1_047_576, 32_768, "2.00", "8.00"),
    _openai("gpt-4.1-mini", 1_047_576, 32_768, "0.40", "1.60"),
)


def _anthropic(name: str, window: int, max_out: int, price_in: str, price_out: str) -> ModelInfo:
    return ModelInfo(
        name=name,
        provider=ANTHROPIC_PROVIDER,
        context_window=window,
        max_output_tokens=max_out,
        tokenizer_family=TokenizerFamily.ANTHROPIC,
        input_price_per_mtok=Decimal(price_in),
        output_price_per_mtok=Decimal(price_out),
    )


_ANTHROPIC_MODELS: Final = (
    _anthropic("claude-sonnet-4-5", 200_000, 64_000, "3.00", "15.00"),
    _anthropic("claude-haiku-4-5", 200_000, 64_000, "1.00", "5.00"),
    _anthropic("claude-opus-4-1", 200_000, 32_000, "15.00", "75.00"),
)


# Inputs longer than 256 tokens are truncated by the model; priced like a small hosted embedding model so that
# budgets count it offline too.
EMBEDDER: Final = ModelInfo(
    EMBEDDER_MODEL, EMBEDDER_PROVIDER, 256, 1, TokenizerFamily.GENERIC, Decimal("0.02"), Decimal(0), ModelKind.EMBEDDING
)


def echo_model(input_price_per_mtok: Decimal, output_price_per_mtok: Decimal) -> ModelInfo:
    """The built-in offline ``echo`` model at the given prices."""
    return ModelInfo(
        name=ECHO_MODEL,
        provider=ECHO_PROVIDER,
        context_window=128_000,
        max_output_tokens=4096,
        tokenizer_family=TokenizerFamily.GENERIC,
        input_price_per_mtok=input_price_per_mtok,
        output_price_per_mtok=output_price_per_mtok,
    )


class ModelCatalog:
    """An immutable set of models, looked up by exact name."""

    def __init__(self, models: Iterable[ModelInfo]) -> None:
        by_name: dict[str, ModelInfo] = {}
        for model in models:
            by_name[model.name] = model  # later entries replace earlier ones: config overrides built-ins
        self._models: Mapping[str, ModelInfo] = by_name

    @classmethod
    def builtin(
        cls,
        *,
        echo_input_price_per_mtok: Decimal = Decimal("1.00"),
        echo_output_price_per_mtok: Decimal = Decimal("2.00"),
    ) -> ModelCatalog:
        """``echo`` at the given prices plus the built-in OpenAI and Anthropic models."""
        return cls(
            (echo_model(echo_input_price_per_mtok, echo_output_price_per_mtok), EMBEDDER, *_OPENAI_MODELS,
             *_ANTHROPIC_MODELS)
        )  # fmt: skip

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        *,
        echo_input_price_per_mtok: Decimal = Decimal("1.00"),
        echo_output_price_per_mtok: Decimal = Decimal("2.00"),
        include_builtins: bool = True,
    ) -> ModelCatalog:
        """Built-ins (unless excluded) plus the ``models`` of ``config``, which replace built-ins of the same name.

        Each model's ``provider`` must be built in (``echo``, ``openai``, ``anthropic``) or a key of
        ``config["providers"]``.
        """
        try:
            spec = _CatalogSpec.model_validate(config)
        except ValidationError as e:
            raise CatalogConfigError(f"invalid model catalog configuration: {e}") from e
        known_providers = BUILTIN_PROVIDERS | spec.providers.keys()
        models: list[ModelInfo] = []
        if include_builtins:
            models.extend(
                cls.builtin(
                    echo_input_price_per_mtok=echo_input_price_per_mtok,
                    echo_output_price_per_mtok=echo_output_price_per_mtok,
                )
            )
        for entry in spec.models:
            if entry.provider not in known_providers:
                raise CatalogConfigError(f"model {entry.name!r} names unknown provider {entry.provider!r}")
            try:
                models.append(ModelInfo(**entry.model_dump()))
            except ValueError as e:
                raise CatalogConfigError(str(e)) from e
        return cls(models)

    def __contains__(self, name: object) -> bool:
        return name in self._models

    def __iter__(self) -> Iterator[ModelInfo]:
        return iter(self._models.values())

    def __len__(self) -> int:
        return len(self._models)

    def get(self, name: str) -> ModelInfo | None:
        """The model called exactly ``name``, or ``None``."""
        return self._models.get(name)

    def require(self, name: str) -> ModelInfo:
        """The model called exactly ``name``; raises ``UnknownModel`` otherwise."""
        model = self._models.get(name)
        if model is None:
            raise UnknownModel(name)
        return model

    def names(self) -> list[str]:
        """Every model name, sorted."""
        return sorted(self._models)

    def _resolve(self, model: str | ModelInfo) -> ModelInfo:
        return model if isinstance(model, ModelInfo) else self.require(model)

    def cost(self, model: str | ModelInfo, prompt_tokens: int, completion_tokens: int) -> Decimal:
        """Exact USD cost of a call (not rounded: the ledger quantizes when it stores)."""
        if prompt_tokens < 0 or completion_tokens < 0:
            raise ValueError("token counts must not be negative")
        info = self._resolve(model)
        return (prompt_tokens * info.input_price_per_mtok + completion_tokens * info.output_price_per_mtok) / _MILLION

    def worst_case_cost(self, model: str | ModelInfo, prompt_tokens: int, max_tokens: int | None) -> Decimal:
        """Cost if the completion runs to ``max_tokens`` (capped by the model's max output), or to max output.

        ``prompt_tokens`` should be a conservative estimate, so this bounds what settling can charge.
        """
        info = self._resolve(model)
        completion = info.max_output_tokens if max_tokens is None else min(max(max_tokens, 0), info.max_output_tokens)
        return self.cost(info, prompt_tokens, completion)


KEY_FIELDS: Final = ("api_key", "api_key_env", "api_key_file")


def load_provider_config(
    path: Path, *, resolve_keys: bool = True, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The providers file: ``{"models": [...], "providers": {...}, "fallbacks": {...}}`` (validated by the registry).

    A provider entry names its upstream key in one of three ways: ``api_key`` (the key itself), ``api_key_env``
    (an environment variable holding it, e.g. set from a Kubernetes Secret) or ``api_key_file`` (a file holding
    it, e.g. a mounted Secret; relative to the providers file). With ``resolve_keys`` the last two are read here,
    once, at start, into ``api_key``; a variable that is not set or a file that cannot be read is a
    :class:`CatalogConfigError` naming it. Stages that only need the catalog (the context stage) pass
    ``resolve_keys=False`` and never see a key."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CatalogConfigError(f"cannot read providers file {path}: {e}") from e
    if not isinstance(data, dict):
        raise CatalogConfigError(f"providers file {path} must hold a JSON object")
    if not resolve_keys:
        return data
    return resolve_provider_keys(data, os.environ if environ is None else environ, base=path.parent)


def resolve_provider_keys(config: dict[str, Any], environ: Mapping[str, str], *, base: Path) -> dict[str, Any]:
    """``config`` with every provider's ``api_key_env`` / ``api_key_file`` replaced by the ``api_key`` it names."""
    providers = config.get("providers")
    if not isinstance(providers, Mapping):
        return config
    resolved: dict[str, Any] = {}
    for name, entry in providers.items():
        if not isinstance(entry, Mapping):
            resolved[name] = entry  # the registry reports the shape
            continue
        given = [field for field in KEY_FIELDS if field in entry]
        if len(given) > 1:
            raise CatalogConfigError(
                f"provider {name!r}: give one of {', '.join(KEY_FIELDS)}, not {' and '.join(given)}"
            )
        entry = dict(entry)
        if "api_key_env" in entry:
            variable = entry.pop("api_key_env")
            if not isinstance(variable, str) or not variable:
                raise CatalogConfigError(f"provider {name!r}: api_key_env must name an environment variable")
            value = environ.get(variable, "").strip()
            if not value:
                raise CatalogConfigError(
                    f"provider {name!r} takes its API key from the environment variable {variable} (api_key_env),"
                    " which is not set"
                )
            entry["api_key"] = value
        elif "api_key_file" in entry:
            raw = entry.pop("api_key_file")
            if not isinstance(raw, str) or not raw:
                raise CatalogConfigError(f"provider {name!r}: api_key_file must be a path")
            file = Path(raw) if Path(raw).is_absolute() else base / raw
            try:
                value = file.read_text().strip()
            except OSError as e:
                raise CatalogConfigError(
                    f"provider {name!r} takes its API key from the file {file} (api_key_file), which cannot be"
                    f" read: {e.strerror or type(e).__name__}"
                ) from e
            if not value:
                raise CatalogConfigError(f"provider {name!r}: the API key file {file} (api_key_file) is empty")
            entry["api_key"] = value
        resolved[name] = entry
    return {**config, "providers": resolved}


def catalog_for(providers_file: Path | None, *, echo_input_price: Decimal, echo_output_price: Decimal) -> ModelCatalog:
    """The catalog every stage uses: built-in models plus those of the providers file (the proxy and the context
    stage must agree on windows, output limits and tokenizer families)."""
    config = load_provider_config(providers_file, resolve_keys=False) if providers_file is not None else {}
    return ModelCatalog.from_config(
        config, echo_input_price_per_mtok=echo_input_price, echo_output_price_per_mtok=echo_output_price
    )


def configured_providers(config: Mapping[str, Any]) -> frozenset[str]:
    """Providers a deployment can call: the built-in echo plus every ``providers`` entry of the providers file.
    A catalogued model whose provider is not among them cannot be served here (a configuration gap, not an
    outage)."""
    providers = config.get("providers") if isinstance(config, Mapping) else None
    return frozenset({ECHO_PROVIDER, EMBEDDER_PROVIDER, *(providers.keys() if isinstance(providers, Mapping) else ())})
