"""LoCoMo-format conversations read into plain values, and the memory write body for each turn.

Owns the file format (a JSON list of samples with ``conversation`` and ``qa``; see docs/retrieval.md) and the one
decision of how a turn becomes a memory: content ``"<speaker>: <text>"`` (plus the caption of a shared photo),
``valid_from`` the session's date and time, ``observed_at`` that instant plus one minute per turn before it (the
format dates sessions only; turns of a chat come about a minute apart), ``session_id`` the session, and the turn
id in ``metadata.dia_id``. Pure; called by :mod:`ibex_dataplane.evaluation.locomo`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson

QUESTION_CATEGORIES = (1, 2, 3, 4)  # multi-hop, temporal, open-domain, single-hop; 5 (adversarial) has no evidence
CATEGORY_NAMES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}

TURN_SPACING = timedelta(minutes=1)
_SESSION = re.compile(r"^session_(\d+)$")
_DATE_FORMATS = ("%I:%M %p on %d %B, %Y", "%I:%M %p on %d %b, %Y", "%I:%M %p on %B %d, %Y")
_EVIDENCE_SPLIT = re.compile(r"[;,\s]+")


class DatasetError(ValueError):
    """The file is not in the LoCoMo format."""


@dataclass(frozen=True, slots=True)
class Turn:
    dia_id: str
    speaker: str
    text: str
    session: int
    position: int  # 0-based within the session
    said_at: datetime | None
    caption: str | None = None

    @property
    def content(self) -> str:
        content = f"{self.speaker}: {self.text}".strip()
        if self.caption:
            content += f" (shares a photo: {self.caption})"
        return content

    def write_body(self) -> dict[str, Any]:
        """The ``POST /v1/memories:batch`` item a client recording this conversation would send."""
        body: dict[str, Any] = {
            "content": self.content,
            "source": "imported",
            "session_id": f"session-{self.session}",
            "metadata": {"dia_id": self.dia_id, "speaker": self.speaker},
        }
        if self.said_at is not None:
            body["valid_from"] = self.said_at.isoformat()
            body["observed_at"] = (self.said_at + TURN_SPACING * self.position).isoformat()
        return body


@dataclass(frozen=True, slots=True)
class Question:
    text: str
    evidence: tuple[str, ...]  # dia_ids of turns of the same conversation
    category: int


@dataclass(frozen=True, slots=True)
class Conversation:
    sample_id: str
    turns: tuple[Turn, ...]
    questions: tuple[Question, ...]


def parse_session_time(value: str) -> datetime:
    """``"1:56 pm on 8 May, 2023"`` as an aware UTC datetime (the format gives no zone)."""
    text = " ".join(value.split())
    for fmt in _DATE_FORMATS:
        try:
            return datetime.strptime(text, fmt).replace(tzinfo=UTC)
        except ValueError:
            continue
    raise DatasetError(f"unrecognized session date {value!r}")


def parse_evidence(raw: Any) -> tuple[str, ...]:
    """Evidence ids, tolerating the source's occasional ``"D8:6; D9:17"`` in one entry."""
    if not isinstance(raw, list):
        return ()
    ids: list[str] = []
    for entry in raw:
        for part in _EVIDENCE_SPLIT.split(str(entry)):
            if part and part not in ids:
                ids.append(part)
    return tuple(ids)


def _conversation(sample: Any, number: int) -> Conversation:
    if not isinstance(sample, dict) or not isinstance(sample.get("conversation"), dict):
        raise DatasetError(f"sample {number} has no conversation object")
    conv = sample["conversation"]
    sessions = sorted(int(m.group(1)) for k in conv if (m := _SESSION.match(k)) and isinstance(conv[k], list))
    turns: list[Turn] = []
    for n in sessions:
        raw_time = conv.get(f"session_{n}_date_time")
        said_at = parse_session_time(raw_time) if isinstance(raw_time, str) else None
        for position, raw in enumerate(conv[f"session_{n}"]):
            if not isinstance(raw, dict) or not isinstance(raw.get("dia_id"), str):
                raise DatasetError(f"sample {number}, session {n}: a turn without dia_id")
            caption = raw.get("blip_caption")
            turns.append(
                Turn(
                    dia_id=raw["dia_id"].strip(),
                    speaker=str(raw.get("speaker", "")).strip(),
                    text=str(raw.get("text", "")).strip(),
                    session=n,
                    position=position,
                    said_at=said_at,
                    caption=caption.strip() if isinstance(caption, str) and caption.strip() else None,
                )
            )
    known = {t.dia_id for t in turns}
    questions: list[Question] = []
    for raw in sample.get("qa") or []:
        if not isinstance(raw, dict) or not isinstance(raw.get("question"), str):
            continue
        category = raw.get("category")
        if not isinstance(category, int):
            continue
        # Evidence that names no turn of this conversation is a defect of the source; it cannot be retrieved.
        evidence = tuple(e for e in parse_evidence(raw.get("evidence")) if e in known)
        questions.append(Question(raw["question"].strip(), evidence, category))
    return Conversation(str(sample.get("sample_id", f"sample-{number}")), tuple(turns), tuple(questions))


def parse_locomo(data: Any) -> list[Conversation]:
    if not isinstance(data, list):
        raise DatasetError("expected a JSON list of samples")
    return [_conversation(sample, i) for i, sample in enumerate(data)]


def load_locomo(path: Path) -> list[Conversation]:
    try:
        data = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as e:
        raise DatasetError(f"cannot read {path}: {e}") from e
    return parse_locomo(data)
