"""Train the memory search ranker (``dataplane/ibex_dataplane/memory/ranker.json``) on a LoCoMo-format file.

Two steps, so the slow one runs once:

    .venv/bin/python bench/train_ranker.py record PATH/TO/locomo-dev5.json --out /tmp/candidates.pkl
    .venv/bin/python bench/train_ranker.py train /tmp/candidates.pkl --out dataplane/ibex_dataplane/memory/ranker.json

``record`` runs the real ``ibex eval locomo`` (fresh embedded stores, every turn written and every question asked
over HTTP through the proxy) with the memory stage in this process, and keeps what each search's three legs
returned (``MemorySearch.candidates``, the production pools) with the question it answered. A candidate is
labelled relevant when it holds one of the question's evidence turns: its ``metadata.dia_id``, or the same content
as an evidence turn (an exact duplicate holds every turn it absorbed).

``train`` fits ``w`` of ``w . (x - mean) / scale`` (:mod:`ibex_dataplane.memory.ranker`) by stochastic gradient
descent on a pairwise logistic loss: for each question, every relevant candidate against every other one, a pair
weighing more when swapping it would change recall@10. It first
reports evidence recall@k leave one conversation out (trained on the other conversations, scored on the held-out
one, with the floor and the composite order of the real search), then fits on everything and writes the weights
with their provenance. Deterministic for a given file and seed. Tune on the development split only.
"""

from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from ibex_dataplane.evaluation.dataset import Question, load_locomo
from ibex_dataplane.evaluation.locomo import recall_at
from ibex_dataplane.memory.evidence import names_in, periods_named
from ibex_dataplane.memory.ranker import FEATURES, Ranker, features
from ibex_dataplane.memory.repository import SearchRow
from ibex_dataplane.memory.search import rank
from ibex_dataplane.memory.tuning import SearchTuning

KS = (1, 5, 10, 20)
LIMIT = 20  # what `ibex eval locomo` asks for with its default cut-offs


@dataclass
class Example:
    conversation: int
    question: Question
    query: str
    rows: list[SearchRow]
    relevant: set[int]  # indexes into rows
    holds: dict[str, set[str]]  # memory id -> turns it holds


def record(data: Path, out: Path) -> int:
    from ibex_dataplane import cli
    from ibex_dataplane.memory.search import MemorySearch

    searches: list[tuple[str, str, list[SearchRow]]] = []  # agent id, query, candidates
    candidates = MemorySearch.candidates

    async def recording(self: MemorySearch, tenant: Any, query: Any) -> tuple[str, list[SearchRow]]:
        masked, rows = await candidates(self, tenant, query)
        searches.append((str(tenant.agent_id), masked, list(rows)))
        return masked, rows

    MemorySearch.candidates = recording  # type: ignore[method-assign]
    rc = cli.main(["eval", "locomo", str(data), "--json"])
    if rc != 0:
        return rc
    conversations = load_locomo(data)
    agents: list[str] = []
    for agent, _, _ in searches:
        if agent not in agents:
            agents.append(agent)
    if len(agents) != len(conversations):
        print(f"expected {len(conversations)} agents, saw {len(agents)}", file=sys.stderr)
        return 1
    examples: list[Example] = []
    for c, (conversation, agent) in enumerate(zip(conversations, agents, strict=True)):
        asked = [q for q in conversation.questions if q.category in (1, 2, 3, 4) and q.evidence]
        mine = [(query, rows) for a, query, rows in searches if a == agent]
        if len(mine) != len(asked):
            print(f"{conversation.sample_id}: {len(asked)} questions, {len(mine)} searches", file=sys.stderr)
            return 1
        by_content: dict[str, set[str]] = defaultdict(set)
        for turn in conversation.turns:
            by_content[turn.content].add(turn.dia_id)
        for question, (query, rows) in zip(asked, mine, strict=True):
            holds = {
                str(r.memory.id): {str(r.memory.metadata.get("dia_id"))} | by_content.get(r.memory.content or "", set())
                for r in rows
            }
            evidence = set(question.evidence)
            relevant = {i for i, r in enumerate(rows) if holds[str(r.memory.id)] & evidence}
            examples.append(Example(c, question, query, rows, relevant, holds))
    with out.open("wb") as f:
        pickle.dump({"data": data.name, "examples": examples}, f)
    print(f"recorded {len(examples)} questions into {out}")
    return 0


# -- training --------------------------------------------------------------------------------------------------------


Matrix = np.ndarray[Any, Any]


def design(examples: Sequence[Example], tuning: SearchTuning) -> list[tuple[Matrix, Matrix]]:
    out = []
    for ex in examples:
        x = features(ex.rows, tuning, periods_named(ex.query), names_in(ex.query))
        y = np.array([1.0 if i in ex.relevant else 0.0 for i in range(len(ex.rows))])
        out.append((x, y))
    return out


def fit(items: Sequence[tuple[Matrix, Matrix]], epochs: int, lr: float, l2: float, seed: int, k: int = 10) -> Ranker:
    """Pairwise logistic loss, each pair weighted by whether swapping the two would change recall@k (one of them
    in the current top k: weight 1.1, else 0.1), so the fit spends itself where the cut-off is."""
    stacked = np.concatenate([x for x, _ in items])
    mean, scale = stacked.mean(0), stacked.std(0)
    scale = np.where(scale > 1e-9, scale, 1.0)
    w = np.zeros(len(FEATURES))
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        for j in rng.permutation(len(items)):
            x, y = items[j]
            positive, negative = np.where(y > 0)[0], np.where(y == 0)[0]
            if len(positive) == 0 or len(negative) == 0:
                continue
            z = (x - mean) / scale
            s = z @ w
            position = np.empty(len(s))
            position[np.argsort(-s)] = np.arange(len(s))
            top = (position < k).astype(np.float64)
            weight = np.abs(top[positive][:, None] - top[negative][None, :]) + 0.1
            margin = s[positive][:, None] - s[negative][None, :]
            g = -weight / (1.0 + np.exp(margin))  # weight x d(log(1 + e^-margin)) / d margin
            grad = np.zeros(len(y))
            grad[positive] += g.sum(1)
            grad[negative] -= g.sum(0)
            w -= lr * (z.T @ (grad / margin.size) + l2 * w)
    scores = ((stacked - mean) / scale) @ w
    lo, hi = float(np.percentile(scores, 50)), float(np.percentile(scores, 99.9))
    return Ranker(w, mean, scale, lo, hi, {})


def recall(examples: Sequence[Example], tuning: SearchTuning, ranker: Ranker | None) -> dict[str, dict[int, float]]:
    by: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    now = datetime.now(UTC)
    for ex in examples:
        hits = rank(ex.rows, ex.query, LIMIT, now, tuning, ranker)
        ranked = [sorted(ex.holds[str(h.memory.id)]) for h in hits]
        for k in KS:
            r = recall_at(ex.question.evidence, ranked, k)
            by["all"][k].append(r)
            by[str(ex.question.category)][k].append(r)
    return {c: {k: round(sum(v) / len(v), 4) for k, v in d.items()} for c, d in sorted(by.items())}


def show(label: str, result: dict[str, dict[int, float]]) -> None:
    cats = " ".join(f"{c}@10={result[c][10]:.3f}" for c in sorted(result) if c != "all")
    overall = " ".join(f"@{k}={result['all'][k]:.3f}" for k in KS)
    print(f"{label:28s} {overall}  {cats}", flush=True)


def commit() -> str:
    """The checked-out commit, with ``-dirty`` when the working tree has changes (the weights then come from code
    no commit holds)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        status = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")


def train(path: Path, out: Path, epochs: int, lr: float, l2: float, seed: int) -> int:
    with path.open("rb") as f:
        recorded = pickle.load(f)
    examples: list[Example] = recorded["examples"]
    tuning = SearchTuning()
    items = design(examples, tuning)
    conversations = sorted({ex.conversation for ex in examples})
    show("evidence only (no ranker)", recall(examples, tuning, None))
    fold_rankers: dict[int, Ranker] = {}
    for c in conversations:
        train_items = [it for it, ex in zip(items, examples, strict=True) if ex.conversation != c]
        fold_rankers[c] = fit(train_items, epochs, lr, l2, seed)

    def per_fold() -> dict[str, dict[int, float]]:
        merged: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        for c in conversations:
            part = [ex for ex in examples if ex.conversation == c]
            result = recall(part, tuning, fold_rankers[c])
            for cat, d in result.items():
                n = len(part) if cat == "all" else sum(str(ex.question.category) == cat for ex in part)
                for k, v in d.items():
                    merged[cat][k].extend([v] * n)  # weight each fold's mean by its questions
        return {c: {k: round(sum(v) / len(v), 4) for k, v in d.items()} for c, d in sorted(merged.items())}

    cross = per_fold()
    show("leave one conversation out", cross)
    ranker = fit(items, epochs, lr, l2, seed)
    show("fitted on all (optimistic)", recall(examples, tuning, ranker))
    provenance = {
        "trained_on": recorded["data"],
        "questions": len(examples),
        "commit": commit(),
        "loss": "pairwise logistic, pairs weighted by their effect on recall@10",
        "epochs": epochs,
        "learning_rate": lr,
        "l2": l2,
        "seed": seed,
        "leave_one_conversation_out_recall": {str(k): cross["all"][k] for k in KS},
        "leave_one_conversation_out_recall_at_10_by_category": {c: d[10] for c, d in cross.items() if c != "all"},
    }
    shipped = Ranker(ranker.weights, ranker.mean, ranker.scale, ranker.lo, ranker.hi, provenance)
    out.write_text(json.dumps(shipped.to_json(), indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    r = sub.add_parser("record", help="run the real evaluation and keep every search's candidates")
    r.add_argument("data", type=Path)
    r.add_argument("--out", type=Path, required=True)
    t = sub.add_parser("train", help="cross-validate, fit and write the weights")
    t.add_argument("candidates", type=Path)
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--epochs", type=int, default=30)
    t.add_argument("--lr", type=float, default=0.05)
    t.add_argument("--l2", type=float, default=1e-3)
    t.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    step: Callable[[], int]
    if args.step == "record":
        step = lambda: record(args.data, args.out)  # noqa: E731
    else:
        step = lambda: train(args.candidates, args.out, args.epochs, args.lr, args.l2, args.seed)  # noqa: E731
    return step()


if __name__ == "__main__":  # the embedded ClickHouse engine starts processes: spawn needs the guard
    sys.exit(main())
