"""gRPC <-> service for ``ibex.context.v1.ContextAssembly/Assemble``: principal check, decode, encode.

The tenant comes only from the signed internal principal in the metadata key ``x-ibex-principal``, signed for this
very method: missing, malformed, forged, expired or signed for another call is ``UNAUTHENTICATED`` before
anything is decoded or retrieved. The caller's gRPC deadline bounds the assembly. Bad requests (messages that are
not JSON objects, an unknown model) are ``INVALID_ARGUMENT`` / ``NOT_FOUND``; nothing a caller sends is an
``INTERNAL`` error. Called by grpc.aio; built by :mod:`ibex_dataplane.context.app`.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc
import orjson

from ibex_dataplane.context.metrics import ContextMetrics
from ibex_dataplane.context.packer import PackPath
from ibex_dataplane.context.service import (
    Assembly,
    AssemblyRequest,
    BranchStatus,
    ContextService,
    Degradation,
    Directive,
)
from ibex_dataplane.proto_gen.ibex.context.v1 import context_pb2 as pb
from ibex_dataplane.proto_gen.ibex.context.v1 import context_pb2_grpc as pb_grpc
from ibex_dataplane.security.principal import (
    ASSEMBLE_METHOD,
    GRPC_METADATA,
    Principal,
    PrincipalError,
    PrincipalSigner,
    grpc_target,
)
from ibex_dataplane.shared.errors import NotFound, ServiceError

log = logging.getLogger(__name__)

TARGET = grpc_target(ASSEMBLE_METHOD)

_BRANCH = {
    BranchStatus.SUCCESS: pb.SUCCESS,
    BranchStatus.TIMEOUT: pb.TIMEOUT,
    BranchStatus.ERROR: pb.ERROR,
    BranchStatus.SKIPPED: pb.SKIPPED,
}
_DEGRADATION = {Degradation.NONE: pb.NONE, Degradation.PARTIAL: pb.PARTIAL, Degradation.HISTORY_ONLY: pb.HISTORY_ONLY}
_PATH = {PackPath.DP: pb.DP, PackPath.GREEDY: pb.GREEDY}


class BadRequest(ValueError):
    """The request cannot be decoded into an assembly request."""


def _json_object(raw: bytes, what: str) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"{what} is not valid JSON") from e


def decode_request(request: pb.AssembleRequest) -> AssemblyRequest:
    if not request.model:
        raise BadRequest("model is required")
    messages: list[dict[str, Any]] = []
    for i, message in enumerate(request.messages):
        value = _json_object(message.json, f"messages[{i}]")
        if not isinstance(value, dict) or not isinstance(value.get("role"), str):
            raise BadRequest(f"messages[{i}] must be a JSON object with a role")
        messages.append(value)
    tools = None
    if request.tools_json:
        tools = _json_object(request.tools_json, "tools")
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise BadRequest("tools must be a JSON array of objects")
    directive = None
    if request.HasField("directive"):
        d = request.directive
        directive = Directive(d.version, d.content, d.injection_mode or "SystemFirst")
    return AssemblyRequest(
        model=request.model,
        messages=messages,
        tools=tools,
        session_id=request.session.id,
        context_tokens=request.limits.context_tokens,
        max_output_tokens=request.limits.max_output_tokens,
        skip_memory=request.options.skip_memory,
        max_memories=request.options.max_memories,
        directive=directive,
    )


def encode_response(assembly: Assembly) -> pb.AssembleResponse:
    t = assembly.tokens
    p = assembly.packing
    return pb.AssembleResponse(
        messages=[pb.Message(role=str(m.get("role", "")), json=orjson.dumps(m)) for m in assembly.messages],
        tokens=pb.SectionTokens(
            directive=t.directive,
            history=t.history,
            memories=t.memories,
            tools=t.tools,
            formatter=t.formatter,
            total=t.total,
            usable=t.usable,
            estimate_kind=t.estimate_kind,
            tokenizer_family=t.tokenizer_family,
        ),
        memories=[
            pb.MemoryUsed(
                id=u.id,
                score=u.score,
                tokens=u.tokens,
                source=u.source,
                components=pb.ScoreComponents(**{k: float(u.components.get(k, 0.0)) for k in _COMPONENTS}),
            )
            for u in assembly.used
        ],
        branches=[
            pb.Branch(name=b.name, status=_BRANCH[b.status], latency_ms=b.latency_ms, detail=b.detail)
            for b in assembly.branches
        ],
        degradation=_DEGRADATION[assembly.degradation],
        packing=pb.PackingReport(
            path=_PATH[p.path],
            evaluated=p.evaluated,
            excluded_for_budget=p.excluded_for_budget,
            budget_reached=p.budget_reached,
            constrained=assembly.constrained,
        ),
        timings=pb.Timings(
            total_ms=assembly.timings_ms.get("total", 0.0),
            retrieval_ms=assembly.timings_ms.get("retrieval", 0.0),
            pack_ms=assembly.timings_ms.get("pack", 0.0),
            format_ms=assembly.timings_ms.get("format", 0.0),
        ),
        nonce_sha256=assembly.nonce_sha256,
    )


_COMPONENTS = ("relevance", "recency", "usefulness", "confidence", "frequency")


class ContextServicer(pb_grpc.ContextAssemblyServicer):
    def __init__(self, service: ContextService, signer: PrincipalSigner, metrics: ContextMetrics) -> None:
        self._service = service
        self._signer = signer
        self._metrics = metrics

    def _principal(self, context: grpc.aio.ServicerContext[Any, Any]) -> Principal | None:
        token = None
        for key, value in context.invocation_metadata() or ():
            if key == GRPC_METADATA:
                token = value if isinstance(value, str) else value.decode("ascii", "replace")
        try:
            return self._signer.verify(token, target=TARGET)
        except PrincipalError as e:
            self._metrics.rejections.inc()
            log.info("context call refused: %s", e)
            return None

    async def Assemble(
        self, request: pb.AssembleRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.AssembleResponse:
        principal = self._principal(context)
        if principal is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid internal principal is required")
        assert principal is not None
        try:
            decoded = decode_request(request)
        except BadRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            assembly = await self._service.assemble(principal, decoded, timeout=context.time_remaining())
        except NotFound as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, e.message)
        except ServiceError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, e.message)
        return encode_response(assembly)
