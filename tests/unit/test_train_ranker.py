"""``bench/train_ranker.py``: the fit learns an order from labelled candidates, and ``train`` writes a weight file the
search loads, with its provenance."""

from __future__ import annotations

import importlib.util
import json
import pickle
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType

import numpy as np

from ibex_dataplane.evaluation.dataset import Question
from ibex_dataplane.memory.ranker import Ranker
from ibex_dataplane.memory.repository import SearchRow
from tests.support.records import stored_memory

ROOT = Path(__file__).resolve().parents[2]
T0 = datetime(2023, 5, 8, 13, 56, tzinfo=UTC)


def trainer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_ranker", ROOT / "bench" / "train_ranker.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_ranker"] = module  # pickled examples name their class by module
    spec.loader.exec_module(module)
    return module


def candidate(content: str, similarity: float, text: float, minute: int, dia_id: str) -> SearchRow:
    at = T0 + timedelta(minutes=minute)
    memory = stored_memory(content, at, session_id=f"s{minute // 30}", metadata={"dia_id": dia_id})
    return SearchRow(memory, similarity, text, 1)


def examples(module: ModuleType, conversation: int, count: int) -> list[object]:
    """Questions whose evidence is the candidate said by the named person, among equally strong distractors that
    only mention her: only the name features separate them."""
    rng = np.random.default_rng(conversation)
    out = []
    for q in range(count):
        rows = []
        for i in range(12):
            strength = float(rng.uniform(0.55, 0.7))
            said = i == q % 12
            text = "Maria: I painted a lake." if said else f"John: Maria told me about lake number {i}."
            rows.append(candidate(text, strength, 8.0 + strength, i * 10, f"D{q}:{i}"))
        evidence = (f"D{q}:{q % 12}",)
        question = Question(text="What did Maria paint?", category=4, evidence=evidence)
        holds = {str(r.memory.id): {str(r.memory.metadata["dia_id"])} for r in rows}
        relevant = {q % 12}
        out.append(module.Example(conversation, question, "What did Maria paint?", rows, relevant, holds))
    return out


def test_the_fit_learns_what_separates_evidence_from_distractors() -> None:
    module = trainer()
    tuning = module.SearchTuning()
    data = examples(module, 0, 24) + examples(module, 1, 24)
    ranker = module.fit(module.design(data, tuning), epochs=20, lr=0.05, l2=1e-3, seed=0)
    assert module.recall(data, tuning, ranker)["all"][1] == 1.0
    assert module.recall(data, tuning, None)["all"][1] < 0.5  # the evidence order cannot tell them apart


def test_train_cross_validates_and_writes_a_weight_file_the_search_loads(tmp_path: Path) -> None:
    module = trainer()
    recorded = tmp_path / "candidates.pkl"
    data = examples(module, 0, 12) + examples(module, 1, 12) + examples(module, 2, 12)
    with recorded.open("wb") as f:
        pickle.dump({"data": "synthetic.json", "examples": data}, f)
    out = tmp_path / "ranker.json"
    assert module.train(recorded, out, epochs=10, lr=0.05, l2=1e-3, seed=0) == 0
    ranker = Ranker.from_json(json.loads(out.read_text()))
    assert ranker.provenance["trained_on"] == "synthetic.json" and ranker.provenance["questions"] == 36
    assert ranker.provenance["leave_one_conversation_out_recall"]["1"] == 1.0
    assert ranker.hi > ranker.lo
