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

    name: ResourceName = Field(description="Name of the referenced resource, in the same namespace.")


class Limits(_Model):
    """Rate limits enforced by the proxy across every replica; unset means unlimited."""

    requests_per_minute: int | None = Field(default=None, ge=1, le=10_000_000, description="Requests per minute.")
    tokens_per_minute: int | None = Field(
        default=None, ge=1, le=2_000_000_000, description="Prompt plus completion tokens per minute."
    )


class Enforcement(enum.StrEnum):
    HARD_CAP = "HardCap"
    ALERT_ONLY = "AlertOnly"


def _usd(value: Any) -> Any:
    # Amounts are strings on the wire ("100.00") so YAML floats never round them; accept plain numbers too.
    if isinstance(value, int | float) and not isinstance(value, bool):
        return format(Decimal(str(value)), "f")
    return value


class OrganizationBudget(_Model):
    """Monthly spend limit of the whole organization."""

    monthly_limit_usd: str = Field(
        alias="monthlyLimitUSD", pattern=USD_AMOUNT, description='Monthly limit in USD, as a string ("100.00").'
    )
    enforcement: Enforcement = Field(
        default=Enforcement.HARD_CAP,
        description="HardCap refuses requests that would exceed the limit; AlertOnly records and never blocks.",
    )

    _coerce = field_validator("monthly_limit_usd", mode="before")(_usd)

    @property
    def limit(self) -> Decimal:
        return Decimal(self.monthly_limit_usd)


class AgentBudget(_Model):
    """Monthly spend limit of one agent, inside its organization's budget."""

    monthly_limit_usd: str = Field(
        alias="monthlyLimitUSD", pattern=USD_AMOUNT, description='Monthly limit in USD, as a string ("10.00").'
    )

    _coerce = field_validator("monthly_limit_usd", mode="before")(_usd)

    @property
    def limit(self) -> Decimal:
        return Decimal(self.monthly_limit_usd)


class ModelPolicy(_Model):
    """Which models the organization's keys may call."""

    allow: list[ModelGlob] = Field(default_factory=list, max_length=100, description="Globs; empty allows all.")
    deny: list[ModelGlob] = Field(default_factory=list, max_length=100, description="Globs; deny wins.")
    default: ModelName | None = Field(default=None, description="Model used when a request names none.")


class OrganizationSpec(_Model):
    """A tenant: its status, limits, budget and model policy."""

    display_name: str = Field(default="", max_length=200, description="Human-readable name.")
    suspended: bool = Field(default=False, description="true: every key of the org gets 403 ORG_SUSPENDED.")
    limits: Limits = Field(default_factory=Limits, description="Organization-wide rate limits.")
    budget: OrganizationBudget | None = Field(default=None, description="Monthly budget; unset means no limit.")
    models: ModelPolicy = Field(default_factory=ModelPolicy, description="Model allow and deny lists.")


class CaptureMode(enum.StrEnum):
    OFF = "off"
    TURNS = "turns"
    FACTS = "facts"


class CaptureRole(enum.StrEnum):
    USER = "user"
    ASSISTANT = "assistant"


class AgentMemory(_Model):
    """Long-term memory of the agent and how much of the context window it may fill."""

    enabled: bool = Field(default=True, description="Assemble memory context and accept memory writes.")
    context_tokens: int = Field(
        default=2000, ge=0, le=1_000_000, description="Token budget for memories injected into a request."
    )
    capture: CaptureMode = Field(
        default=CaptureMode.OFF,
        description="Memories from the agent's chats: off; turns (each captured message becomes a memory); facts"
        " (an extraction model turns the recent messages into facts).",
    )
    capture_roles: list[CaptureRole] = Field(
        default_factory=lambda: [CaptureRole.USER],
        min_length=1,
        max_length=2,
        description="Which messages of a turn are captured: the client's user messages, the model's answer, or both.",
    )
    extraction_model: ModelName | None = Field(
        default=None,
        description="Model that extracts facts (capture: facts); unset: the agent's default model, else the org's.",
    )

    @field_validator("capture_roles")
    @classmethod
    def _unique_roles(cls, v: list[CaptureRole]) -> list[CaptureRole]:
        if len(set(v)) != len(v):
            raise ValueError("roles must be unique")
        return v


class AgentSpec(_Model):
    """An agent of one organization; API keys act as agents."""

    organization_ref: ObjectRef = Field(description="The Organization this agent belongs to (immutable).")
    display_name: str = Field(default="", max_length=200, description="Human-readable name.")
    suspended: bool = Field(default=False, description="true: requests as this agent get 403 AGENT_SUSPENDED.")
    default_model: ModelName | None = Field(default=None, description="Model used when a request names none.")
    limits: Limits = Field(default_factory=Limits, description="Per-agent rate limits.")
    budget: AgentBudget | None = Field(default=None, description="Monthly budget; unset means no agent limit.")
    memory: AgentMemory = Field(default_factory=AgentMemory, description="Memory settings.")


class InjectionMode(enum.StrEnum):
    SYSTEM_FIRST = "SystemFirst"
    SYSTEM_APPEND = "SystemAppend"
    USER_PREPEND = "UserPrepend"


class DirectiveSpec(_Model):
    """The agent's standing instructions; every edit appends an immutable version and activates it."""

    agent_ref: ObjectRef = Field(description="The Agent this directive applies to (one Directive per Agent).")
    content: str = Field(min_length=1, max_length=65536, description="The directive text.")
    injection_mode: InjectionMode = Field(
        default=InjectionMode.SYSTEM_FIRST,
        description="SystemFirst: first system message; SystemAppend: after the caller's system messages; "
        "UserPrepend: before the first user message.",
    )


class Scope(enum.StrEnum):
    CHAT = "chat"
    MEMORY_READ = "memory:read"
    MEMORY_WRITE = "memory:write"
    MEMORY_DELETE = "memory:delete"
    USAGE_READ = "usage:read"


class ApiKeySpec(_Model):
    """An API key: the operator issues the token into a Secret and stores only its hash."""

    organization_ref: ObjectRef = Field(description="The Organization the key belongs to (immutable).")
    agent_refs: list[ObjectRef] = Field(
        min_length=1,
        max_length=100,
        description="Agents this key may act as (at least one, each once).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    scopes: list[Scope] = Field(
        min_length=1,
        max_length=len(Scope),
        description="What the key may do (each scope once).",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    expires_at: datetime | None = Field(default=None, description="Optional expiry (RFC 3339 with a time zone).")
    revoked: bool = Field(default=False, description="true: the key stops working on every replica within 1 s.")
    secret_name: ResourceName = Field(
        description="Secret (same namespace) the operator writes the token to, key token."
    )
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


# -- status ----------------------------------------------------------------------------------------------------
# Written by the operator only (never validated on input): they describe the status schema in the CRDs, so a field
# the reconcile code records must be declared here or the apiserver prunes it.


class ConditionStatus(enum.StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class StatusCondition(_Model):
    """One observation about the resource, Kubernetes style; Ready is always present."""

    type: str = Field(max_length=316, description="Ready, or one of the conditions behind it.")
    status: ConditionStatus
    reason: str = Field(max_length=1024, description="UpperCamelCase reason for the last transition.")
    message: str = Field(default="", max_length=32768, description="Human-readable details.")
    last_transition_time: datetime = Field(description="When the status last changed.")
    observed_generation: int | None = Field(default=None, ge=0, description="Generation this was computed from.")


class _Status(_Model):
    observed_generation: int | None = Field(default=None, ge=0, description="Generation the status reflects.")
    conditions: list[StatusCondition] = Field(
        default_factory=list,
        description="Ready and the conditions behind it.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


class OrganizationStatus(_Status):
    org_id: str | None = Field(default=None, description="Stable id of the organization in the stores.")


class AgentStatus(_Status):
    agent_id: str | None = Field(default=None, description="Stable id of the agent in the stores.")
    org_id: str | None = Field(default=None, description="Id of the agent's organization.")


class DirectiveStatus(_Status):
    version: int | None = Field(default=None, ge=0, description="Active directive version.")
    content_sha256: str | None = Field(
        default=None, alias="contentSHA256", description="SHA-256 of the active version's content."
    )
    agent_id: str | None = Field(default=None, description="Id of the agent the directive applies to.")


class SecretKeyRef(_Model):
    name: str = Field(description="Secret name.")
    key: str = Field(description="Key inside the Secret.")


class ApiKeyStatus(_Status):
    key_id: str | None = Field(default=None, description="Public key id (the <keyid> in ibex_sk_<keyid>_<secret>).")
    org_id: str | None = Field(default=None, description="Id of the key's organization.")
    secret_ref: SecretKeyRef | None = Field(default=None, description="Where the token is.")
    rotation: int | None = Field(default=None, ge=0, description="spec.rotation last applied.")


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
STATUS_MODELS: dict[str, type[_Model]] = {
    "Organization": OrganizationStatus,
    "Agent": AgentStatus,
    "Directive": DirectiveStatus,
    "ApiKey": ApiKeyStatus,
}
