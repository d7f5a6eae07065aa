"""The SPLADE encoder on the packaged model against a plain numpy forward pass of the same checkpoint (no mocks)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from ibex_dataplane.embedding import EmbeddingError, SparseEncoder, SparseVector
from ibex_dataplane.embedding.onnx_graph import _varint
from ibex_dataplane.embedding.splade import OnnxSpladeEncoder, packaged_model_dir, sparse_of
from tests.support import bert_reference

TEXTS = [
    "What activities has Melanie done with her family?",
    "Caroline: I went to a LGBTQ support group yesterday and it was so powerful.",
    "ok",
    "Deploys happen on Tuesdays; the staging cluster is rebuilt every night at 02:00 UTC.",
]


@pytest.fixture(scope="module")
def encoder() -> Iterator[OnnxSpladeEncoder]:
    """The default: the vocabulary projection in int8."""
    instance = OnnxSpladeEncoder.from_installed_packages()
    yield instance
    instance.close()


@pytest.fixture(scope="module")
def exact() -> Iterator[OnnxSpladeEncoder]:
    instance = OnnxSpladeEncoder.from_installed_packages(precision="float32")
    yield instance
    instance.close()


def _reference(texts: list[str]) -> list[np.ndarray]:
    directory = packaged_model_dir()
    weights = bert_reference.tensors(directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    return [bert_reference.splade(tokenizer.encode(text).ids, weights, config) for text in texts]


def test_the_onnx_graph_matches_a_numpy_forward_pass(exact: OnnxSpladeEncoder) -> None:
    # One batch of texts of different lengths: padding must not change any row.
    got = exact.activations(TEXTS)
    assert exact.precision == "float32" and got.shape == (len(TEXTS), 30522)
    for row, expected in enumerate(_reference(TEXTS)):
        np.testing.assert_allclose(got[row], expected, atol=2e-4, rtol=1e-3)
        assert (expected > 0.5).sum() >= 3  # a real activation, not an all-zero row that matches trivially


def test_the_int8_projection_stays_close_to_the_forward_pass(encoder: OnnxSpladeEncoder) -> None:
    got = encoder.activations(TEXTS)
    assert encoder.precision == "int8"
    for row, expected in enumerate(_reference(TEXTS)):
        cosine = float(got[row] @ expected / np.linalg.norm(got[row]) / np.linalg.norm(expected))
        assert 0.995 <= cosine < 1 - 1e-7  # close, and not float32 arithmetic under another name
        kept, reference = set(np.flatnonzero(got[row] >= 0.05)), set(np.flatnonzero(expected >= 0.05))
        assert len(kept & reference) >= 0.8 * len(kept | reference)
        strongest = set(np.argsort(-expected)[:10].tolist())
        assert len(strongest & set(np.argsort(-got[row])[:10].tolist())) >= 8


def test_an_unknown_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="precision"):
        OnnxSpladeEncoder.from_installed_packages(precision="fp16")


def test_sparse_vectors_keep_the_strongest_tokens_in_token_order(encoder: OnnxSpladeEncoder) -> None:
    dense = encoder.activations(TEXTS[:1])[0]
    vector = encoder.encode_sync(TEXTS[:1])[0]
    assert vector.tokens.dtype == np.int32 and vector.weights.dtype == np.float32
    assert np.all(np.diff(vector.tokens) > 0)
    np.testing.assert_allclose(vector.weights, dense[vector.tokens], rtol=1e-6)
    assert np.all(vector.weights >= 0.05)
    assert set(vector.tokens.tolist()) == set(np.flatnonzero(dense >= 0.05).tolist())
    assert "family" in {encoder._tokenizer.id_to_token(int(t)) for t in vector.tokens}


@pytest.mark.parametrize("precision", ["int8", "float32"])
def test_a_batch_gives_what_one_text_at_a_time_gives(
    precision: str, encoder: OnnxSpladeEncoder, exact: OnnxSpladeEncoder
) -> None:
    chosen = encoder if precision == "int8" else exact
    texts = [TEXTS[i % len(TEXTS)] + " " + "more words" * (i % 5) for i in range(37)]  # three model runs
    together = chosen.encode_sync(texts)
    for text, vector in zip(texts, together, strict=True):
        (alone,) = chosen.encode_sync([text])
        np.testing.assert_array_equal(alone.tokens, vector.tokens)
        np.testing.assert_allclose(alone.weights, vector.weights, atol=1e-5)


def test_related_texts_score_higher_than_unrelated_ones(encoder: OnnxSpladeEncoder) -> None:
    question, answer, unrelated = asyncio.run(
        _encode(encoder, ["Which team did Gina sign with?", "Gina signed with the Minnesota Wolves team.", "ok"])
    )
    assert question.dot(answer) > 5 * max(question.dot(unrelated), 0.1)


async def _encode(encoder: SparseEncoder, texts: list[str]) -> list[SparseVector]:
    return await encoder.encode(texts)


def test_sparse_of_caps_the_number_of_terms() -> None:
    activation = np.zeros(100, dtype=np.float32)
    activation[[3, 10, 50, 70]] = [0.5, 2.0, 0.01, 1.0]
    kept = sparse_of(activation, min_weight=0.05, max_terms=2)
    assert kept.tokens.tolist() == [10, 70]
    assert kept.weights.tolist() == [2.0, 1.0]
    everything = sparse_of(activation, min_weight=0.05, max_terms=10)
    assert everything.tokens.tolist() == [3, 10, 70]


def test_dot_sums_over_shared_tokens_only() -> None:
    a = SparseVector(np.array([1, 4, 9], np.int32), np.array([1.0, 2.0, 3.0], np.float32))
    b = SparseVector(np.array([4, 9, 12], np.int32), np.array([0.5, 1.0, 7.0], np.float32))
    assert a.dot(b) == pytest.approx(2.0 * 0.5 + 3.0 * 1.0)


def test_strongest_keeps_the_largest_weights_in_token_order() -> None:
    v = SparseVector(np.array([2, 5, 8, 11, 30], np.int32), np.array([0.3, 1.5, 0.3, 2.0, 0.9], np.float32))
    top = v.strongest(3)
    assert top.tokens.tolist() == [5, 11, 30]
    assert top.weights.tolist() == pytest.approx([1.5, 2.0, 0.9])
    assert v.strongest(2).tokens.tolist() == [5, 11]
    assert v.strongest(4).tokens.tolist() == [2, 5, 11, 30]  # a tie goes to the lower token id
    assert v.strongest(0) is v and v.strongest(5) is v and v.strongest(9) is v


def test_protobuf_varints_encode_negative_int64_as_ten_bytes() -> None:
    assert _varint(1) == b"\x01"
    assert _varint(300) == b"\xac\x02"
    assert len(_varint(-1)) == 10


def test_a_closed_encoder_refuses_work() -> None:
    instance = OnnxSpladeEncoder.from_installed_packages()
    instance.close()
    with pytest.raises(EmbeddingError):
        instance.encode_sync(["anything"])


def test_a_missing_model_directory_is_an_embedding_error(tmp_path: Path) -> None:
    with pytest.raises(EmbeddingError):
        OnnxSpladeEncoder(tmp_path)
