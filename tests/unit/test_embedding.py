"""The in-process all-MiniLM-L6-v2 embedder, run for real on the packaged model (no mocks)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ibex_dataplane.embedding import Embedder, EmbeddingError
from ibex_dataplane.embedding.onnx import (
    OnnxMiniLMEmbedder,
    packaged_model_path,
    packaged_tokenizer_path,
)

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


def test_the_embedder_satisfies_the_protocol(embedder: OnnxMiniLMEmbedder) -> None:
    seam: Embedder = embedder
    assert seam.dimensions == 384
    assert seam.model_name == "all-MiniLM-L6-v2"


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
    shutil.copyfile(packaged_model_path(), tmp_path / "model.onnx")
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
        OnnxMiniLMEmbedder(packaged_model_path(), corrupt)


async def test_a_closed_embedder_raises_embedding_error() -> None:
    embedder = OnnxMiniLMEmbedder.from_installed_packages()
    embedder.close()
    with pytest.raises(EmbeddingError):
        embedder.embed_sync(["too late"])
    with pytest.raises(EmbeddingError):
        await embedder.embed(["too late"])
