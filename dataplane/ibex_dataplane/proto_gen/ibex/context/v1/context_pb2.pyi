from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BranchStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BRANCH_STATUS_UNSPECIFIED: _ClassVar[BranchStatus]
    SUCCESS: _ClassVar[BranchStatus]
    TIMEOUT: _ClassVar[BranchStatus]
    ERROR: _ClassVar[BranchStatus]
    SKIPPED: _ClassVar[BranchStatus]

class DegradationLevel(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEGRADATION_LEVEL_UNSPECIFIED: _ClassVar[DegradationLevel]
    NONE: _ClassVar[DegradationLevel]
    PARTIAL: _ClassVar[DegradationLevel]
    HISTORY_ONLY: _ClassVar[DegradationLevel]

class PackPath(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PACK_PATH_UNSPECIFIED: _ClassVar[PackPath]
    DP: _ClassVar[PackPath]
    GREEDY: _ClassVar[PackPath]
BRANCH_STATUS_UNSPECIFIED: BranchStatus
SUCCESS: BranchStatus
TIMEOUT: BranchStatus
ERROR: BranchStatus
SKIPPED: BranchStatus
DEGRADATION_LEVEL_UNSPECIFIED: DegradationLevel
NONE: DegradationLevel
PARTIAL: DegradationLevel
HISTORY_ONLY: DegradationLevel
PACK_PATH_UNSPECIFIED: PackPath
DP: PackPath
GREEDY: PackPath

class Message(_message.Message):
    __slots__ = ("role", "json")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    role: str
    json: bytes
    def __init__(self, role: _Optional[str] = ..., json: _Optional[bytes] = ...) -> None: ...

class Directive(_message.Message):
    __slots__ = ("version", "content", "injection_mode")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    INJECTION_MODE_FIELD_NUMBER: _ClassVar[int]
    version: int
    content: str
    injection_mode: str
    def __init__(self, version: _Optional[int] = ..., content: _Optional[str] = ..., injection_mode: _Optional[str] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("context_tokens", "max_output_tokens")
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    context_tokens: int
    max_output_tokens: int
    def __init__(self, context_tokens: _Optional[int] = ..., max_output_tokens: _Optional[int] = ...) -> None: ...

class Options(_message.Message):
    __slots__ = ("skip_memory", "max_memories")
    SKIP_MEMORY_FIELD_NUMBER: _ClassVar[int]
    MAX_MEMORIES_FIELD_NUMBER: _ClassVar[int]
    skip_memory: bool
    max_memories: int
    def __init__(self, skip_memory: _Optional[bool] = ..., max_memories: _Optional[int] = ...) -> None: ...

class AssembleRequest(_message.Message):
    __slots__ = ("model", "messages", "tools_json", "session", "limits", "options", "directive")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    DIRECTIVE_FIELD_NUMBER: _ClassVar[int]
    model: str
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    tools_json: bytes
    session: Session
    limits: Limits
    options: Options
    directive: Directive
    def __init__(self, model: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., tools_json: _Optional[bytes] = ..., session: _Optional[_Union[Session, _Mapping]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., options: _Optional[_Union[Options, _Mapping]] = ..., directive: _Optional[_Union[Directive, _Mapping]] = ...) -> None: ...

class SectionTokens(_message.Message):
    __slots__ = ("directive", "history", "memories", "tools", "formatter", "total", "usable", "estimate_kind", "tokenizer_family")
    DIRECTIVE_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    MEMORIES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    FORMATTER_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    USABLE_FIELD_NUMBER: _ClassVar[int]
    ESTIMATE_KIND_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FAMILY_FIELD_NUMBER: _ClassVar[int]
    directive: int
    history: int
    memories: int
    tools: int
    formatter: int
    total: int
    usable: int
    estimate_kind: str
    tokenizer_family: str
    def __init__(self, directive: _Optional[int] = ..., history: _Optional[int] = ..., memories: _Optional[int] = ..., tools: _Optional[int] = ..., formatter: _Optional[int] = ..., total: _Optional[int] = ..., usable: _Optional[int] = ..., estimate_kind: _Optional[str] = ..., tokenizer_family: _Optional[str] = ...) -> None: ...

class ScoreComponents(_message.Message):
    __slots__ = ("relevance", "recency", "usefulness", "confidence", "frequency")
    RELEVANCE_FIELD_NUMBER: _ClassVar[int]
    RECENCY_FIELD_NUMBER: _ClassVar[int]
    USEFULNESS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_FIELD_NUMBER: _ClassVar[int]
    relevance: float
    recency: float
    usefulness: float
    confidence: float
    frequency: float
    def __init__(self, relevance: _Optional[float] = ..., recency: _Optional[float] = ..., usefulness: _Optional[float] = ..., confidence: _Optional[float] = ..., frequency: _Optional[float] = ...) -> None: ...

class MemoryUsed(_message.Message):
    __slots__ = ("id", "score", "components", "tokens", "source")
    ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    id: str
    score: float
    components: ScoreComponents
    tokens: int
    source: str
    def __init__(self, id: _Optional[str] = ..., score: _Optional[float] = ..., components: _Optional[_Union[ScoreComponents, _Mapping]] = ..., tokens: _Optional[int] = ..., source: _Optional[str] = ...) -> None: ...

class Branch(_message.Message):
    __slots__ = ("name", "status", "latency_ms", "detail")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    name: str
    status: BranchStatus
    latency_ms: float
    detail: str
    def __init__(self, name: _Optional[str] = ..., status: _Optional[_Union[BranchStatus, str]] = ..., latency_ms: _Optional[float] = ..., detail: _Optional[str] = ...) -> None: ...

class PackingReport(_message.Message):
    __slots__ = ("path", "evaluated", "excluded_for_budget", "budget_reached", "constrained")
    PATH_FIELD_NUMBER: _ClassVar[int]
    EVALUATED_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FOR_BUDGET_FIELD_NUMBER: _ClassVar[int]
    BUDGET_REACHED_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINED_FIELD_NUMBER: _ClassVar[int]
    path: PackPath
    evaluated: int
    excluded_for_budget: int
    budget_reached: bool
    constrained: bool
    def __init__(self, path: _Optional[_Union[PackPath, str]] = ..., evaluated: _Optional[int] = ..., excluded_for_budget: _Optional[int] = ..., budget_reached: _Optional[bool] = ..., constrained: _Optional[bool] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("total_ms", "retrieval_ms", "pack_ms", "format_ms")
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    RETRIEVAL_MS_FIELD_NUMBER: _ClassVar[int]
    PACK_MS_FIELD_NUMBER: _ClassVar[int]
    FORMAT_MS_FIELD_NUMBER: _ClassVar[int]
    total_ms: float
    retrieval_ms: float
    pack_ms: float
    format_ms: float
    def __init__(self, total_ms: _Optional[float] = ..., retrieval_ms: _Optional[float] = ..., pack_ms: _Optional[float] = ..., format_ms: _Optional[float] = ...) -> None: ...

class AssembleResponse(_message.Message):
    __slots__ = ("messages", "tokens", "memories", "branches", "degradation", "packing", "timings", "nonce_sha256")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEMORIES_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    DEGRADATION_FIELD_NUMBER: _ClassVar[int]
    PACKING_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    NONCE_SHA256_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    tokens: SectionTokens
    memories: _containers.RepeatedCompositeFieldContainer[MemoryUsed]
    branches: _containers.RepeatedCompositeFieldContainer[Branch]
    degradation: DegradationLevel
    packing: PackingReport
    timings: Timings
    nonce_sha256: str
    def __init__(self, messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., tokens: _Optional[_Union[SectionTokens, _Mapping]] = ..., memories: _Optional[_Iterable[_Union[MemoryUsed, _Mapping]]] = ..., branches: _Optional[_Iterable[_Union[Branch, _Mapping]]] = ..., degradation: _Optional[_Union[DegradationLevel, str]] = ..., packing: _Optional[_Union[PackingReport, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., nonce_sha256: _Optional[str] = ...) -> None: ...
