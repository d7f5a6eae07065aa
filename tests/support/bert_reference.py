"""A plain numpy (float64) BERT forward pass, written independently of ``ibex_dataplane.embedding.onnx_graph``.

The unit tests of both packaged models compare the ONNX graphs built at start-up against it: the SPLADE
activation (``splade``) and MiniLM's mean-pooled sentence vector (``sentence_vector``).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np

Array = np.ndarray[Any, Any]


def tensors(path: Path) -> dict[str, Array]:
    """The float32 tensors of a ``.safetensors`` file (integer buffers such as ``position_ids`` are skipped)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    return {
        k: np.frombuffer(raw[8 + n + v["data_offsets"][0] : 8 + n + v["data_offsets"][1]], "<f4").reshape(v["shape"])
        for k, v in header.items()
        if k != "__metadata__" and v["dtype"] == "F32"
    }


_erf = np.vectorize(math.erf, otypes=[np.float64])


def gelu(x: Array) -> Array:
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def norm(x: Array, w: dict[str, Array], p: str) -> Array:
    scale = w.get(p + ".gamma", w.get(p + ".weight"))
    shift = w.get(p + ".beta", w.get(p + ".bias"))
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return np.asarray((x - mean) / np.sqrt(var + 1e-12) * scale + shift)


def encode(ids: list[int], w: dict[str, Array], config: dict[str, Any], prefix: str) -> Array:
    """The last hidden state (tokens x hidden) of one text, no padding."""
    t, hidden, heads = len(ids), int(config["hidden_size"]), int(config["num_attention_heads"])
    head = hidden // heads
    x = (
        w[prefix + "embeddings.word_embeddings.weight"][ids]
        + w[prefix + "embeddings.position_embeddings.weight"][:t]
        + w[prefix + "embeddings.token_type_embeddings.weight"][0]
    ).astype(np.float64)
    x = norm(x, w, prefix + "embeddings.LayerNorm")
    for layer in range(int(config["num_hidden_layers"])):
        p = f"{prefix}encoder.layer.{layer}."

        def lin(v: Array, name: str, p: str = p) -> Array:
            return np.asarray(v @ w[p + name + ".weight"].T + w[p + name + ".bias"])

        q, k, v = (
            lin(x, f"attention.self.{n}").reshape(t, heads, head).transpose(1, 0, 2) for n in ("query", "key", "value")
        )
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(head)
        attn = np.exp(scores - scores.max(-1, keepdims=True))
        attn /= attn.sum(-1, keepdims=True)
        context = (attn @ v).transpose(1, 0, 2).reshape(t, hidden)
        x = norm(x + lin(context, "attention.output.dense"), w, p + "attention.output.LayerNorm")
        x = norm(x + lin(gelu(lin(x, "intermediate.dense")), "output.dense"), w, p + "output.LayerNorm")
    return x


def splade(ids: list[int], w: dict[str, Array], config: dict[str, Any]) -> Array:
    """BERT with its MLM head, then the maximum over tokens of log(1 + relu(logits))."""
    x = encode(ids, w, config, "bert.")
    h = gelu(x @ w["cls.predictions.transform.dense.weight"].T + w["cls.predictions.transform.dense.bias"])
    h = norm(h, w, "cls.predictions.transform.LayerNorm")
    logits = h @ w["bert.embeddings.word_embeddings.weight"].T + w["cls.predictions.bias"]
    return np.asarray(np.log1p(np.maximum(logits, 0.0)).max(axis=0))


def sentence_vector(ids: list[int], w: dict[str, Array], config: dict[str, Any]) -> Array:
    """The mean of the last hidden state over the tokens, L2-normalised (sentence-transformers' pooling)."""
    pooled = encode(ids, w, config, "").mean(axis=0)
    return np.asarray(pooled / np.linalg.norm(pooled))
