"""Every knob of memory search in one value: candidate pools, the evidence scales and lifts, the floor, the
composite weights. Pure data; :mod:`~ibex_dataplane.memory.evidence` and :mod:`~ibex_dataplane.memory.search` read
it, the memory app builds it from the settings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ScoreWeights:
    relevance: float = 0.40
    recency: float = 0.25
    usefulness: float = 0.20
    confidence: float = 0.10
    frequency: float = 0.05


@dataclass(frozen=True, slots=True)
class SearchTuning:
    """Every knob of retrieval; the defaults are calibrated on the LoCoMo development split for MiniLM."""

    min_similarity: float = 0.20  # ANN cutoff, before hydration (kept low: weak hits can still be lifted)
    relevance_floor: float = 0.30  # drop candidates below this relevance before scoring
    recency_half_life_days: float = 30.0
    frequency_half_saturation: float = 5.0  # retrieval_count at which the frequency component reaches 0.5
    ann_candidates: int = 40
    text_candidates: int = 60
    text_term_rows: int = 400  # memories read per query term for BM25 document frequencies
    text_population: int = 20000  # memories counted for BM25 idf
    vector_weight: float = 0.30
    text_weight: float = 0.70
    agreement_bonus: float = 0.0  # both legs found it (measured: no gain on top of the weighted sum)
    similarity_zero: float = 0.30  # cosine that is no evidence at all for MiniLM (unrelated sentences)
    similarity_full: float = 0.80  # cosine that is full evidence
    text_half: float = 12.0  # BM25 score plus the weighted SPLADE dot product that is half evidence (6 before it)
    sparse_weight: float = 0.2  # SPLADE dot product added to the BM25 score, in BM25 units (0: no sparse leg)
    sparse_candidates: int = 60
    sparse_term_rows: int = 400  # postings read per query token (the highest weights)
    sparse_query_tokens: int = 12  # the query's strongest SPLADE tokens the sparse leg reads (0: all)
    name_weight: float = 0.10  # lift for a memory holding a name the query mentions (see names_in)
    time_weight: float = 0.10  # lift for memories valid from inside a period the query names
    neighbour_weight: float = 0.35  # share of a neighbour's evidence lent to a memory observed close to it
    neighbour_seconds: float = 120.0  # how close (observed_at, same session) counts as a neighbour
    session_weight: float = 0.20  # share of the best evidence in a session lent to all of its memories
    weights: ScoreWeights = ScoreWeights()

    def __post_init__(self) -> None:
        if not 0 <= self.relevance_floor < 1:
            raise ValueError("the relevance floor must be in [0, 1)")
        if not self.similarity_zero < self.similarity_full:
            raise ValueError("similarity_zero must be below similarity_full")
