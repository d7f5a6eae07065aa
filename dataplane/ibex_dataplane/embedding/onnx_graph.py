"""A BERT masked-language-model forward pass as an ONNX graph, written as protobuf bytes with no ``onnx`` package.

Owns turning the float32 weights of a ``BertForMaskedLM`` checkpoint (a ``model.safetensors`` file and its
``config.json``) into an in-memory ONNX model whose output is the SPLADE activation of each input: the maximum
over the real tokens of ``log(1 + relu(MLM logits))``, one row of vocabulary width per input. Called by
``ibex_dataplane.embedding.splade`` at start-up; the bytes go straight to ``onnxruntime.InferenceSession`` and
are never written to disk, so nothing is converted at setup and nothing is left behind.

Only the handful of protobuf fields onnxruntime needs are written (``onnx.proto`` field numbers, opset 17):
ModelProto{ir_version, opset_import, graph}, GraphProto{node, initializer, input, output}, NodeProto, AttributeProto,
TensorProto (raw little-endian data) and ValueInfoProto with symbolic dimensions.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

OPSET: Final = 17  # LayerNormalization exists from 17; ReduceMax still takes its axes as an attribute
IR_VERSION: Final = 8
_FLOAT: Final = 1  # TensorProto.DataType
_INT64: Final = 7

Weights = Mapping[str, npt.NDArray[np.float32]]


# -- protobuf wire format ----------------------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64 values are ten-byte two's complement
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _int(field: int, value: int) -> bytes:
    return _key(field, 0) + _varint(value)


def _bytes(field: int, value: bytes) -> bytes:
    return _key(field, 2) + _varint(len(value)) + value


def _str(field: int, value: str) -> bytes:
    return _bytes(field, value.encode())


def _float(field: int, value: float) -> bytes:
    return _key(field, 5) + struct.pack("<f", value)


# -- ONNX messages -------------------------------------------------------------------------------------------------


def _tensor(name: str, array: npt.NDArray[Any]) -> bytes:
    if array.dtype == np.float32:
        kind = _FLOAT
    elif array.dtype == np.int64:
        kind = _INT64
    else:
        raise TypeError(f"unsupported initializer type {array.dtype}")
    dims = b"".join(_int(1, d) for d in array.shape)
    raw = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
    return dims + _int(2, kind) + _str(8, name) + _bytes(9, raw)


def _attribute(name: str, value: float | int | Sequence[int]) -> bytes:
    if isinstance(value, float):
        return _str(1, name) + _float(2, value) + _int(20, 1)
    if isinstance(value, int):
        return _str(1, name) + _int(3, value) + _int(20, 2)
    return _str(1, name) + b"".join(_int(8, v) for v in value) + _int(20, 7)


def _value_info(name: str, elem_type: int, dims: Sequence[str | int]) -> bytes:
    shape = b"".join(_bytes(1, _int(1, d) if isinstance(d, int) else _str(2, d)) for d in dims)
    tensor_type = _int(1, elem_type) + _bytes(2, shape)
    return _str(1, name) + _bytes(2, _bytes(1, tensor_type))


class _Graph:
    def __init__(self) -> None:
        self.nodes: list[bytes] = []
        self.initializers: list[bytes] = []
        self._count = 0

    def const(self, name: str, array: npt.NDArray[Any]) -> str:
        self.initializers.append(_tensor(name, array))
        return name

    def scalar(self, value: float) -> str:
        self._count += 1
        return self.const(f"c{self._count}", np.asarray(value, dtype=np.float32))

    def ints(self, values: Sequence[int]) -> str:
        self._count += 1
        return self.const(f"i{self._count}", np.asarray(values, dtype=np.int64))

    def op(self, op_type: str, inputs: Sequence[str], output: str | None = None, **attrs: Any) -> str:
        self._count += 1
        out = output or f"n{self._count}"
        node = b"".join(_str(1, i) for i in inputs) + _str(2, out) + _str(3, out) + _str(4, op_type)
        node += b"".join(_bytes(5, _attribute(k, v)) for k, v in attrs.items())
        self.nodes.append(node)
        return out

    def model(self, inputs: Sequence[bytes], outputs: Sequence[bytes]) -> bytes:
        graph = b"".join(_bytes(1, n) for n in self.nodes) + _str(2, "splade")
        graph += b"".join(_bytes(5, t) for t in self.initializers)
        graph += b"".join(_bytes(11, v) for v in inputs) + b"".join(_bytes(12, v) for v in outputs)
        opset = _str(1, "") + _int(2, OPSET)
        return _int(1, IR_VERSION) + _str(2, "ibex-harness") + _bytes(7, graph) + _bytes(8, opset)


# -- the model -----------------------------------------------------------------------------------------------------


def read_safetensors(path: Path) -> dict[str, npt.NDArray[np.float32]]:
    """Every float32 tensor of a ``.safetensors`` file (an 8-byte header length, a JSON header, raw data)."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    body = memoryview(data)[8 + length :]
    tensors: dict[str, npt.NDArray[np.float32]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] != "F32":
            raise ValueError(f"tensor {name} is {info['dtype']}, expected F32")
        start, end = info["data_offsets"]
        tensors[name] = np.frombuffer(body[start:end], dtype="<f4").reshape(info["shape"]).astype(np.float32)
    return tensors


def _norm_params(w: Weights, prefix: str) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """LayerNorm scale and shift under either naming (``gamma``/``beta`` or ``weight``/``bias``)."""
    scale = w.get(prefix + ".gamma", w.get(prefix + ".weight"))
    shift = w.get(prefix + ".beta", w.get(prefix + ".bias"))
    if scale is None or shift is None:
        raise KeyError(f"no LayerNorm parameters under {prefix}")
    return scale, shift


def splade_model(weights: Weights, config: Mapping[str, Any]) -> bytes:
    """ONNX bytes: inputs ``input_ids`` and ``attention_mask`` (int64, batch x tokens), output ``activation``
    (float32, batch x vocabulary) = max over masked tokens of log(1 + relu(MLM logits))."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    layers = int(config["num_hidden_layers"])
    eps = float(config.get("layer_norm_eps", 1e-12))
    if config.get("hidden_act", "gelu") != "gelu":
        raise ValueError("only BERT's exact (erf) gelu is supported")
    head_dim = hidden // heads
    g = _Graph()

    def linear(x: str, prefix: str) -> str:
        weight = g.const(prefix + ".wT", np.ascontiguousarray(weights[prefix + ".weight"].T))
        return g.op("Add", [g.op("MatMul", [x, weight]), g.const(prefix + ".b", weights[prefix + ".bias"])])

    def norm(x: str, prefix: str) -> str:
        scale, shift = _norm_params(weights, prefix)
        return g.op(
            "LayerNormalization",
            [x, g.const(prefix + ".s", scale), g.const(prefix + ".t", shift)],
            axis=-1,
            epsilon=eps,
        )

    def gelu(x: str) -> str:
        erf = g.op("Erf", [g.op("Div", [x, g.scalar(math.sqrt(2.0))])])
        return g.op("Mul", [g.op("Mul", [x, g.op("Add", [erf, g.scalar(1.0)])]), g.scalar(0.5)])

    word = g.const("word_embeddings", weights["bert.embeddings.word_embeddings.weight"])
    positions = g.const("position_embeddings", weights["bert.embeddings.position_embeddings.weight"])
    token_type = g.const("token_type0", weights["bert.embeddings.token_type_embeddings.weight"][0])
    length = g.op("Slice", [g.op("Shape", ["input_ids"]), g.ints([1]), g.ints([2]), g.ints([0])])
    position = g.op("Slice", [positions, g.ints([0]), length, g.ints([0])])
    x = g.op("Add", [g.op("Add", [g.op("Gather", [word, "input_ids"], axis=0), position]), token_type])
    x = norm(x, "bert.embeddings.LayerNorm")

    mask = g.op("Cast", ["attention_mask"], to=_FLOAT)  # batch x tokens, 1 for real tokens
    bias = g.op("Mul", [g.op("Sub", [g.scalar(1.0), mask]), g.scalar(-10000.0)])
    bias = g.op("Unsqueeze", [bias, g.ints([1, 2])])  # batch x 1 x 1 x tokens
    split = g.ints([0, 0, heads, head_dim])
    joined = g.ints([0, 0, hidden])
    scale = g.scalar(1.0 / math.sqrt(head_dim))
    for layer in range(layers):
        p = f"bert.encoder.layer.{layer}."

        def split_heads(t: str, perm: Sequence[int]) -> str:
            return g.op("Transpose", [g.op("Reshape", [t, split])], perm=list(perm))

        q = split_heads(linear(x, p + "attention.self.query"), (0, 2, 1, 3))
        k = split_heads(linear(x, p + "attention.self.key"), (0, 2, 3, 1))
        v = split_heads(linear(x, p + "attention.self.value"), (0, 2, 1, 3))
        attention = g.op("Softmax", [g.op("Add", [g.op("Mul", [g.op("MatMul", [q, k]), scale]), bias])], axis=-1)
        context = g.op("Reshape", [g.op("Transpose", [g.op("MatMul", [attention, v])], perm=[0, 2, 1, 3]), joined])
        x = norm(g.op("Add", [x, linear(context, p + "attention.output.dense")]), p + "attention.output.LayerNorm")
        inner = gelu(linear(x, p + "intermediate.dense"))
        x = norm(g.op("Add", [x, linear(inner, p + "output.dense")]), p + "output.LayerNorm")

    t = norm(gelu(linear(x, "cls.predictions.transform.dense")), "cls.predictions.transform.LayerNorm")
    decoder = weights.get("cls.predictions.decoder.weight", weights["bert.embeddings.word_embeddings.weight"])
    # The vocabulary bias is the same for every token: it is added after the maximum, on batch x vocabulary.
    logits = g.op("MatMul", [t, g.const("decoder.wT", np.ascontiguousarray(decoder.T))])
    # log(1 + relu(.)) is monotonic, so the maximum over tokens is taken on the logits first (padded tokens pushed
    # far below) and the activation is computed on batch x vocabulary only: the batch x tokens x vocabulary tensor
    # is touched twice (bias, maximum) instead of five times.
    padded = g.op("Unsqueeze", [g.op("Mul", [g.op("Sub", [g.scalar(1.0), mask]), g.scalar(-1e9)]), g.ints([2])])
    best = g.op("ReduceMax", [g.op("Add", [logits, padded])], axes=[1], keepdims=0)
    best = g.op("Add", [best, g.const("decoder.b", weights["cls.predictions.bias"])])
    g.op("Log", [g.op("Add", [g.op("Relu", [best]), g.scalar(1.0)])], "activation")
    vocab = int(decoder.shape[0])
    inputs = [
        _value_info("input_ids", _INT64, ["batch", "tokens"]),
        _value_info("attention_mask", _INT64, ["batch", "tokens"]),
    ]
    return g.model(inputs, [_value_info("activation", _FLOAT, ["batch", vocab])])
