"""The in-process all-MiniLM-L6-v2 embedder, run for real on the packaged model (no mocks)."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer

from ibex_dataplane.embedding import Embedder, EmbeddingError
from ibex_dataplane.embedding.onnx import (
    OnnxMiniLMEmbedder,
    packaged_model,
    packaged_model_dir,
    packaged_tokenizer_path,
)
from ibex_dataplane.embedding.onnx_graph import WEIGHT_LEVELS, _quantized, encoder_model, read_safetensors
from tests.support import bert_reference

SENTENCES = [
    "The cat sits on the mat",
    "A cat is sitting on a rug",
    "Quarterly revenue grew 8%",
    "",
    "ok",
    "The user prefers window seats on long-haul flights and always asks for a vegetarian meal.",
    "Deploys happen on Tuesdays; the staging cluster is rebuilt every night at 02:00 UTC.",
]


@pytest.fixture(scope="module")
def embedder() -> Iterator[OnnxMiniLMEmbedder]:
    with OnnxMiniLMEmbedder.from_installed_packages() as instance:
        yield instance


@pytest.fixture(scope="module")
def reference() -> list[np.ndarray[Any, Any]]:
    """The float64 numpy forward pass of the packaged checkpoint, one vector per sentence."""
    directory = packaged_model_dir()
    weights = bert_reference.tensors(directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(packaged_tokenizer_path()))
    tokenizer.no_padding()
    return [bert_reference.sentence_vector(tokenizer.encode(text).ids, weights, config) for text in SENTENCES]


def test_the_float32_graph_matches_a_numpy_forward_pass(reference: list[np.ndarray[Any, Any]]) -> None:
    with OnnxMiniLMEmbedder.from_installed_packages(precision="float32", coalesce_window_s=None) as exact:
        vectors = exact.embed_sync(SENTENCES)  # one batch of mixed lengths: padding must not change any row
    for got, expected in zip(vectors, reference, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-5)


def test_the_int8_graph_stays_within_quantization_error_of_the_checkpoint(
    embedder: OnnxMiniLMEmbedder, reference: list[np.ndarray[Any, Any]]
) -> None:
    vectors = embedder.embed_sync(SENTENCES)
    cosines = [float(got @ expected) for got, expected in zip(vectors, reference, strict=True)]
    # The shortest texts ("", "ok": two or three tokens) lose the most: 0.978 and 0.983 with 7-bit weights.
    assert min(cosines) > 0.97, cosines
    assert float(np.mean(cosines)) > 0.99, cosines
    assert max(cosines) < 1 - 1e-7  # really quantized: the float32 graph matches to about 1e-7


def _pairwise_saturated(u: np.ndarray[Any, Any], q: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``u @ q`` the way an x86 CPU without VNNI multiplies uint8 by int8: each pair of neighbouring products is
    added in int16 and saturates there, then the pairs are summed in int32."""
    u, q = u.astype(np.int64), q.astype(np.int64)
    pairs = u[:, 0::2, None] * q[None, 0::2, :] + u[:, 1::2, None] * q[None, 1::2, :]
    return np.asarray(np.clip(pairs, -32768, 32767).sum(axis=1))


def test_the_int8_weights_give_the_same_integers_on_cpus_with_and_without_vnni() -> None:
    weights = read_safetensors(packaged_model_dir() / "model.safetensors")
    q, _ = _quantized(weights["encoder.layer.0.intermediate.dense.weight"].T)
    assert int(np.abs(q).max()) == WEIGHT_LEVELS
    rng = np.random.default_rng(7)
    u = rng.choice(np.array([0, 1, 254, 255]), size=(16, q.shape[0]))  # the extremes a token's scale allows
    np.testing.assert_array_equal(_pairwise_saturated(u, q), u.astype(np.int64) @ q.astype(np.int64))
    # Full-range int8 weights would not: the same products saturate.
    full = np.clip(q.astype(np.int64) * 2 + 1, -127, 127)
    assert not np.array_equal(_pairwise_saturated(u, full), u.astype(np.int64) @ full)


def test_the_int8_graph_multiplies_in_integers() -> None:
    directory = packaged_model_dir()
    config = json.loads((directory / "config.json").read_text())
    weights = read_safetensors(directory / "model.safetensors")
    int8, float32 = encoder_model(weights, config, "int8"), encoder_model(weights, config, "float32")
    # Six layers of six linear layers, each one MatMulInteger; the float32 graph has none.
    assert int8.count(b"MatMulInteger") == 36 and b"MatMulInteger" not in float32
    assert len(int8) < 0.7 * len(float32)  # int8 weights: a quarter of the bytes; embeddings stay float32


def test_the_embedder_satisfies_the_protocol(embedder: OnnxMiniLMEmbedder) -> None:
    seam: Embedder = embedder
    assert seam.dimensions == 384
    assert seam.model_name == "all-MiniLM-L6-v2"
    assert embedder.precision == "int8"  # the default build of the packaged checkpoint


def test_vectors_are_384_wide_float32_and_unit_length(embedder: OnnxMiniLMEmbedder) -> None:
    vectors = embedder.embed_sync(SENTENCES)
    assert vectors.shape == (len(SENTENCES), 384)
    assert vectors.dtype == np.float32
    assert vectors.flags.c_contiguous
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_paraphrases_are_closer_than_unrelated_sentences(embedder: OnnxMiniLMEmbedder) -> None:
    cat, rug_cat, revenue = embedder.embed_sync(SENTENCES[:3])
    paraphrase = float(cat @ rug_cat)
    assert paraphrase > 0.6
    assert paraphrase > float(cat @ revenue) + 0.4
    assert paraphrase > float(rug_cat @ revenue) + 0.4


def test_a_batch_gives_the_same_vectors_as_one_text_at_a_time(embedder: OnnxMiniLMEmbedder) -> None:
    # 40 texts of mixed lengths: two model runs at batch size 32, each padded to its own longest text.
    texts = [f"{SENTENCES[i % len(SENTENCES)]} (note {i})" for i in range(40)]
    together = embedder.embed_sync(texts)
    one_by_one = np.vstack([embedder.embed_sync([text]) for text in texts])
    np.testing.assert_allclose(together, one_by_one, atol=1e-5)


async def test_async_embed_matches_sync_embed(embedder: OnnxMiniLMEmbedder) -> None:
    np.testing.assert_allclose(await embedder.embed(SENTENCES), embedder.embed_sync(SENTENCES), atol=1e-5)


async def test_concurrent_callers_each_get_their_own_rows(embedder: OnnxMiniLMEmbedder) -> None:
    texts = [f"memory number {i} is about {topic}" for i, topic in enumerate(["tea", "chess", "rust"] * 12)]
    results = await asyncio.gather(*(embedder.embed([text]) for text in texts))
    np.testing.assert_allclose(np.vstack(results), embedder.embed_sync(texts), atol=1e-5)


async def test_callers_that_wait_for_company_still_get_their_own_rows() -> None:
    texts = [f"windowed request {i} about {topic}" for i, topic in enumerate(["tea", "chess", "rust"] * 4)]
    with OnnxMiniLMEmbedder.from_installed_packages(coalesce_window_s=0.002, batch_size=8) as windowed:
        results = await asyncio.gather(*(windowed.embed([text]) for text in texts))
        expected = windowed.embed_sync(texts)
    np.testing.assert_allclose(np.vstack(results), expected, atol=1e-5)


async def test_a_cancelled_caller_does_not_break_the_run_it_shared(embedder: OnnxMiniLMEmbedder) -> None:
    texts = [f"shared run member {i}" for i in range(6)]
    tasks = [asyncio.create_task(embedder.embed([text])) for text in texts]
    await asyncio.sleep(0)
    tasks[2].cancel()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(done[2], asyncio.CancelledError)
    expected = embedder.embed_sync(texts)
    for i, result in enumerate(done):
        if i != 2:
            assert isinstance(result, np.ndarray)
            np.testing.assert_allclose(result[0], expected[i], atol=1e-5)


async def test_a_bulk_request_does_not_hold_a_query_behind_all_of_its_batches(
    embedder: OnnxMiniLMEmbedder,
) -> None:
    bulk = asyncio.create_task(embedder.embed([f"imported memory {i}" for i in range(320)]))  # 10 batches
    await asyncio.sleep(0)  # the bulk request queues its first batch
    query = await embedder.embed(["what does the user drink in the morning?"])
    assert query.shape == (1, 384)
    assert not bulk.done()
    assert (await bulk).shape == (320, 384)


async def test_an_empty_list_gives_zero_rows_without_running_the_model(embedder: OnnxMiniLMEmbedder) -> None:
    assert embedder.embed_sync([]).shape == (0, 384)
    assert (await embedder.embed([])).shape == (0, 384)


def test_text_beyond_256_tokens_is_truncated(embedder: OnnxMiniLMEmbedder) -> None:
    long_text = " ".join(["harbour"] * 300)
    longer, extended, short = embedder.embed_sync(
        [long_text, long_text + " but the quarterly revenue report says otherwise", "harbour harbour"]
    )
    np.testing.assert_allclose(longer, extended, atol=1e-6)
    assert float(longer @ short) < 0.999


def test_a_single_string_is_rejected_rather_than_embedded_per_character(embedder: OnnxMiniLMEmbedder) -> None:
    with pytest.raises(TypeError):
        embedder.embed_sync("The cat sits on the mat")


def test_a_mounted_model_directory_can_replace_the_packages(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(packaged_model())
    shutil.copyfile(packaged_tokenizer_path(), tmp_path / "tokenizer.json")
    with OnnxMiniLMEmbedder.from_directory(tmp_path, coalesce_window_s=None, batch_size=4) as mounted:
        vectors = mounted.embed_sync(SENTENCES)
    with OnnxMiniLMEmbedder.from_installed_packages(coalesce_window_s=None) as packaged:
        np.testing.assert_allclose(vectors, packaged.embed_sync(SENTENCES), atol=1e-5)


def test_a_corrupt_model_file_raises_embedding_error(tmp_path: Path) -> None:
    corrupt = tmp_path / "model.onnx"
    corrupt.write_bytes(b"\x08\x07this is not an onnx protobuf" * 64)
    with pytest.raises(EmbeddingError) as caught:
        OnnxMiniLMEmbedder(corrupt, packaged_tokenizer_path())
    assert caught.value.__cause__ is not None


def test_a_missing_model_file_raises_embedding_error(tmp_path: Path) -> None:
    with pytest.raises(EmbeddingError):
        OnnxMiniLMEmbedder(tmp_path / "absent.onnx", packaged_tokenizer_path())


def test_a_corrupt_tokenizer_file_raises_embedding_error(tmp_path: Path) -> None:
    corrupt = tmp_path / "tokenizer.json"
    corrupt.write_text('{"version": "1.0", "model": ')
    with pytest.raises(EmbeddingError):
        OnnxMiniLMEmbedder(packaged_model(), corrupt)


async def test_a_closed_embedder_raises_embedding_error() -> None:
    embedder = OnnxMiniLMEmbedder.from_installed_packages()
    embedder.close()
    with pytest.raises(EmbeddingError):
        embedder.embed_sync(["too late"])
    with pytest.raises(EmbeddingError):
        await embedder.embed(["too late"])


def test_the_precision_setting_reaches_the_proxys_embedder(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    from ibex_dataplane.proxy.app import _load_embedder
    from ibex_dataplane.settings import Settings

    monkeypatch.setenv("IBEX_MEMORY_EMBEDDING_PRECISION", "float32")
    chosen = Settings().memory_embedding_precision
    embedder = _load_embedder(chosen)
    try:
        assert isinstance(embedder, OnnxMiniLMEmbedder) and embedder.precision == "float32"
    finally:
        embedder.close()
    monkeypatch.delenv("IBEX_MEMORY_EMBEDDING_PRECISION")
    assert Settings().memory_embedding_precision == "int8"
    monkeypatch.setenv("IBEX_MEMORY_EMBEDDING_PRECISION", "fp16")
    with pytest.raises(ValidationError):
        Settings()
