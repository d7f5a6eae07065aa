"""The four custom resources of group ``ibex.dev/v1alpha1`` as pydantic models (architecture section 4).

These models are the single source of truth: they validate local manifests (``ibex dev``), they are what the
reconcile functions take, and the CRD schemas in ``crds/`` and the Helm chart are generated from them. Field names
are snake_case in Python and camelCase on the wire, exactly as Kubernetes users write them.
"""

from __future__ import annotations

import enum
from datetime import datetime
from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel

GROUP = "ibex.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
MODEL_GLOB = r"^[A-Za-z0-9_.:/*?\-\[\]]{1,128}$"
USD_AMOUNT = r"^[0-9]{1,12}(\.[0-9]{1,6})?$"

ResourceName = Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)]
ModelName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:/\-]{1,128}$")]
ModelGlob = Annotated[str, Field(min_length=1, max_length=128, pattern=MODEL_GLOB)]


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True, use_enum_values=False
    )


class ObjectRef(_Model):
    """A reference by name to another resource of the same namespace."""

    name: ResourceName


class Limits(_Model):
    requests_per_minute: int | None = Field(default=None, ge=1, le=10_000_000)
    tokens_per_minute: int | None = Field(default=None, ge=1, le=10_000_000_000)


class Enforcement(enum.StrEnum):
    HARD_CAP = "HardCap"
    ALERT_ONLY = "AlertOnly"


def _usd(value: Any) -> Any:
    # Amounts are strings on the wire ("100.00") so YAML floats never round them; accept plain numbers too.
    if isinstance(value, int | float) and not isinstance(value, bool):
        return format(Decimal(str(value)), "f")
    return value


class OrganizationBudget(_Model):
    monthly_limit_usd: str = Field(alias="monthlyLimitUSD", pattern=USD_AMOUNT, description="Monthly limit in USD.")
    enforcement: Enforcement = Enforcement.HARD_CAP

    _coerce = field_validator("monthly_limit_usd", mode="before")(_usd)

    @property
    def limit(self) -> Decimal:
        return Decimal(self.monthly_limit_usd)


class AgentBudget(_Model):
    monthly_limit_usd: str = Field(alias="monthlyLimitUSD", pattern=USD_AMOUNT, description="Monthly limit in USD.")

    _coerce = field_validator("monthly_limit_usd", mode="before")(_usd)

    @property
    def limit(self) -> Decimal:
        return Decimal(self.monthly_limit_usd)


class ModelPolicy(_Model):
    allow: list[ModelGlob] = Field(default_factory=list, max_length=100, description="Globs; empty allows all.")
    deny: list[ModelGlob] = Field(default_factory=list, max_length=100, description="Globs; deny wins.")
    default: ModelName | None = None


class OrganizationSpec(_Model):
    display_name: str = Field(default="", max_length=200)
    suspended: bool = False
    limits: Limits = Field(default_factory=Limits)
    budget: OrganizationBudget | None = None
    models: ModelPolicy = Field(default_factory=ModelPolicy)


class AgentMemory(_Model):
    enabled: bool = True
    context_tokens: int = Field(default=2000, ge=0, le=1_000_000)


class AgentSpec(_Model):
    organization_ref: ObjectRef
    display_name: str = Field(default="", max_length=200)
    suspended: bool = False
    default_model: ModelName | None = None
    limits: Limits = Field(default_factory=Limits)
    budget: AgentBudget | None = None
    memory: AgentMemory = Field(default_factory=AgentMemory)


class InjectionMode(enum.StrEnum):
    SYSTEM_FIRST = "SystemFirst"
    SYSTEM_APPEND = "SystemAppend"
    USER_PREPEND = "UserPrepend"


class DirectiveSpec(_Model):
    agent_ref: ObjectRef
    content: str = Field(min_length=1, max_length=65536)
    injection_mode: InjectionMode = InjectionMode.SYSTEM_FIRST


class Scope(enum.StrEnum):
    CHAT = "chat"
    MEMORY_READ = "memory:read"
    MEMORY_WRITE = "memory:write"
    MEMORY_DELETE = "memory:delete"
    USAGE_READ = "usage:read"


class ApiKeySpec(_Model):
    organization_ref: ObjectRef
    agent_refs: list[ObjectRef] = Field(min_length=1, max_length=100)
    scopes: list[Scope] = Field(min_length=1, max_length=len(Scope))
    expires_at: datetime | None = None
    revoked: bool = False
    secret_name: ResourceName
    rotation: int = Field(
        default=0, ge=0, description="Increment to rotate the key's secret; the key id stays the same."
    )

    @field_validator("scopes")
    @classmethod
    def _unique_scopes(cls, v: list[Scope]) -> list[Scope]:
        if len(set(v)) != len(v):
            raise ValueError("scopes must not repeat")
        return v

    @field_validator("agent_refs")
    @classmethod
    def _unique_agents(cls, v: list[ObjectRef]) -> list[ObjectRef]:
        names = [r.name for r in v]
        if len(set(names)) != len(names):
            raise ValueError("agentRefs must not repeat")
        return v

    @field_validator("expires_at")
    @classmethod
    def _aware(cls, v: datetime | None) -> datetime | None:
        if v is not None and v.tzinfo is None:
            raise ValueError("expiresAt needs a time zone (for example 2027-06-30T00:00:00Z)")
        return v


class ObjectMeta(BaseModel):
    """The part of Kubernetes metadata a manifest must carry (the rest is accepted and ignored)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)]
    namespace: Annotated[str, Field(min_length=1, max_length=63, pattern=DNS_LABEL)] = "default"
    generation: int = 1


class _Resource(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore", frozen=True)

    api_version: Literal["ibex.dev/v1alpha1"] = Field(alias="apiVersion")
    metadata: ObjectMeta


class Organization(_Resource):
    kind: Literal["Organization"]
    spec: OrganizationSpec


class Agent(_Resource):
    kind: Literal["Agent"]
    spec: AgentSpec


class Directive(_Resource):
    kind: Literal["Directive"]
    spec: DirectiveSpec


class ApiKey(_Resource):
    kind: Literal["ApiKey"]
    spec: ApiKeySpec


Resource = Annotated[Organization | Agent | Directive | ApiKey, Field(discriminator="kind")]

# The order in which kinds must be applied so references resolve on the first pass.
KIND_ORDER: tuple[str, ...] = ("Organization", "Agent", "Directive", "ApiKey")
SPEC_MODELS: dict[str, type[_Model]] = {
    "Organization": OrganizationSpec,
    "Agent": AgentSpec,
    "Directive": DirectiveSpec,
    "ApiKey": ApiKeySpec,
}
PLURALS: dict[str, str] = {
    "Organization": "organizations",
    "Agent": "agents",
    "Directive": "directives",
    "ApiKey": "apikeys",
}
