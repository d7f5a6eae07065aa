"""BERT forward passes as ONNX graphs, written as protobuf bytes with no ``onnx`` package.

Owns turning the float32 weights of a BERT checkpoint (a ``model.safetensors`` file and its ``config.json``) into
an in-memory ONNX model; the bytes go straight to ``onnxruntime.InferenceSession`` and are never written to disk,
so nothing is converted at setup and nothing is left behind. Two heads over one encoder:

- :func:`encoder_model`: the last hidden state (batch x tokens x hidden), for sentence embeddings (MiniLM; the
  caller pools);
- :func:`splade_model`: the SPLADE activation of each input, the maximum over the real tokens of
  ``log(1 + relu(MLM logits))``, one row of vocabulary width per input.

Precision ``int8`` stores each linear layer's weights as int8 (7 bits used, see :data:`WEIGHT_LEVELS`) with one
scale per output column, and quantizes its input per token (each row of the activation its own scale,
``round(x / s) + 128`` as uint8) right before an integer ``MatMulInteger``; the int32 result is scaled back to
float32. Per-token scales keep a token's result independent of the other tokens and texts of its batch (padding
included), so a text's output does not depend on what it was batched with. Everything else (embeddings, layer
norms, attention's own products) stays float32. Only standard ONNX operators are used there.

:func:`splade_model` at ``int8`` keeps the encoder float32 (two small layers) and quantizes only the vocabulary
projection, which is about nine tenths of its arithmetic: onnxruntime's fused ``DynamicQuantizeMatMul`` (domain
``com.microsoft``) multiplies uint8 by the same 7-bit int8 weights and writes float32 directly, so the large
``tokens x vocabulary`` product is not rescaled element by element. That kernel takes one scale for its whole
input; to keep a text's result independent of its batch anyway, each token's row is first divided by its largest
magnitude and two constant columns (+1 and -1, with zero weights) pin the input's range to exactly [-1, 1], so the
kernel's scale and zero point are the same for every batch; each output row is multiplied back by its token's
magnitude.

Only the handful of protobuf fields onnxruntime needs are written (``onnx.proto`` field numbers, opset 17, and
version 1 of ``com.microsoft`` when a graph uses it):
ModelProto{ir_version, opset_import, graph}, GraphProto{node, initializer, input, output}, NodeProto, AttributeProto,
TensorProto (raw little-endian data) and ValueInfoProto with symbolic dimensions.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt

OPSET: Final = 17  # LayerNormalization exists from 17; ReduceMax still takes its axes as an attribute
MICROSOFT: Final = "com.microsoft"  # onnxruntime's contrib operators (DynamicQuantizeMatMul), version 1
IR_VERSION: Final = 8
_FLOAT: Final = 1  # TensorProto.DataType
_UINT8: Final = 2
_INT8: Final = 3
_INT64: Final = 7
_TENSOR_TYPES: Final = {np.dtype(np.float32): _FLOAT, np.dtype(np.uint8): _UINT8, np.dtype(np.int8): _INT8,
                        np.dtype(np.int64): _INT64}  # fmt: skip

_INTEGER_BUFFERS: Final = frozenset({"I64", "I32"})  # safetensors dtypes of buffers such as position_ids

Weights = Mapping[str, npt.NDArray[np.float32]]
Precision = Literal["float32", "int8"]
PRECISIONS: Final[tuple[Precision, ...]] = ("float32", "int8")


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
    kind = _TENSOR_TYPES.get(array.dtype)
    if kind is None:
        raise TypeError(f"unsupported initializer type {array.dtype}")
    dims = b"".join(_int(1, d) for d in array.shape)
    raw = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
    return b"".join((dims, _int(2, kind), _str(8, name), _key(9, 2), _varint(len(raw)), raw))


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
        self.domains: set[str] = set()
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

    def op(
        self, op_type: str, inputs: Sequence[str], output: str | None = None, *, domain: str = "", **attrs: Any
    ) -> str:
        self._count += 1
        out = output or f"n{self._count}"
        node = b"".join(_str(1, i) for i in inputs) + _str(2, out) + _str(3, out) + _str(4, op_type)
        node += b"".join(_bytes(5, _attribute(k, v)) for k, v in attrs.items())
        if domain:
            node += _str(7, domain)
            self.domains.add(domain)
        self.nodes.append(node)
        return out

    def model(self, name: str, inputs: Sequence[bytes], outputs: Sequence[bytes]) -> bytes:
        # Joined once at the end: the initializers are tens of megabytes, and each concatenation would copy them.
        graph = [_bytes(1, n) for n in self.nodes] + [_str(2, name)]
        for tensor in self.initializers:
            graph += [_key(5, 2), _varint(len(tensor)), tensor]
        graph += [_bytes(11, v) for v in inputs] + [_bytes(12, v) for v in outputs]
        opsets = [_bytes(8, _str(1, "") + _int(2, OPSET))]
        opsets += [_bytes(8, _str(1, domain) + _int(2, 1)) for domain in sorted(self.domains)]
        head = _int(1, IR_VERSION) + _str(2, "ibex-harness") + _key(7, 2) + _varint(sum(map(len, graph)))
        return b"".join([head, *graph, *opsets])


# -- the model -----------------------------------------------------------------------------------------------------


def read_safetensors(path: Path) -> dict[str, npt.NDArray[np.float32]]:
    """Every float32 tensor of a ``.safetensors`` file (an 8-byte header length, a JSON header, raw data).

    Integer tensors are buffers, not weights (``embeddings.position_ids`` is ``0..n-1``), and are left out; any
    other type of weight (half precision) is an error."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    body = memoryview(data)[8 + length :]
    tensors: dict[str, npt.NDArray[np.float32]] = {}
    for name, info in header.items():
        if name == "__metadata__" or info["dtype"] in _INTEGER_BUFFERS:
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


# Weights use 7 of int8's bits. On x86 CPUs without VNNI, onnxruntime multiplies uint8 by int8 with an
# instruction that adds each pair of neighbouring products in int16 and saturates (255 * 127 * 2 > 32767), so a
# full-range int8 weight gives different, less accurate results there than on a VNNI CPU. With |q| <= 63 no pair
# can pass 255 * 63 * 2 = 32130: every CPU computes the same integers, and a vector does not depend on the host.
WEIGHT_LEVELS: Final = 63


def _quantized(weight: npt.NDArray[np.float32]) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float32]]:
    """``weight`` (in x out) as int8 in [-WEIGHT_LEVELS, WEIGHT_LEVELS] with one symmetric scale per output column:
    ``weight ~ q * scale``."""
    scale = (np.maximum(np.abs(weight).max(axis=0), 1e-12) / WEIGHT_LEVELS).astype(np.float32)
    q = np.clip(np.rint(weight / scale), -WEIGHT_LEVELS, WEIGHT_LEVELS).astype(np.int8)
    return q, scale


class _Bert:
    """The encoder's operators on one graph: embeddings, ``layers`` transformer blocks, and the pieces the heads
    reuse (``linear``, ``norm``, ``gelu``). ``prefix`` is the checkpoint's name for the encoder (``bert.`` in a
    masked-language-model checkpoint, empty in a bare encoder's)."""

    def __init__(self, weights: Weights, config: Mapping[str, Any], prefix: str, precision: Precision) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}")
        if config.get("hidden_act", "gelu") != "gelu":
            raise ValueError("only BERT's exact (erf) gelu is supported")
        self.g = _Graph()
        self.w = weights
        self.prefix = prefix
        self.precision = precision
        self.hidden = int(config["hidden_size"])
        self.heads = int(config["num_attention_heads"])
        self.layers = int(config["num_hidden_layers"])
        self.eps = float(config.get("layer_norm_eps", 1e-12))

    def matmul(self, x: str, weight: npt.NDArray[np.float32], name: str) -> str:
        """``x @ weight`` (``weight`` in x out) at the graph's precision."""
        g = self.g
        if self.precision == "float32":
            return g.op("MatMul", [x, g.const(name + ".w", np.ascontiguousarray(weight))])
        q, column_scale = _quantized(weight)
        # One scale per token: the largest magnitude of its row maps to 127; shifted by 128 into uint8.
        row_max = g.op("Max", [g.op("ReduceMax", [g.op("Abs", [x])], axes=[-1], keepdims=1), g.scalar(1e-12)])
        row_scale = g.op("Div", [row_max, g.scalar(127.0)])
        shifted = g.op("Add", [g.op("Round", [g.op("Div", [x, row_scale])]), g.scalar(128.0)])
        zero = g.const(name + ".zp", np.asarray(128, dtype=np.uint8))
        product = g.op("MatMulInteger", [g.op("Cast", [shifted], to=_UINT8), g.const(name + ".q", q), zero])
        return g.op("Mul", [g.op("Mul", [g.op("Cast", [product], to=_FLOAT), row_scale]),
                            g.const(name + ".s", column_scale)])  # fmt: skip

    def linear(self, x: str, prefix: str) -> str:
        product = self.matmul(x, self.w[prefix + ".weight"].T, prefix)  # stored out x in
        return self.g.op("Add", [product, self.g.const(prefix + ".b", self.w[prefix + ".bias"])])

    def norm(self, x: str, prefix: str) -> str:
        scale, shift = _norm_params(self.w, prefix)
        g = self.g
        return g.op(
            "LayerNormalization",
            [x, g.const(prefix + ".s", scale), g.const(prefix + ".t", shift)],
            axis=-1,
            epsilon=self.eps,
        )

    def gelu(self, x: str) -> str:
        g = self.g
        erf = g.op("Erf", [g.op("Div", [x, g.scalar(math.sqrt(2.0))])])
        return g.op("Mul", [g.op("Mul", [x, g.op("Add", [erf, g.scalar(1.0)])]), g.scalar(0.5)])

    def encode(self, mask: str) -> str:
        """The last hidden state of ``input_ids`` under ``mask`` (float32, 1 for real tokens)."""
        g, w, p0 = self.g, self.w, self.prefix
        word = g.const("word_embeddings", w[p0 + "embeddings.word_embeddings.weight"])
        positions = g.const("position_embeddings", w[p0 + "embeddings.position_embeddings.weight"])
        token_type = g.const("token_type0", w[p0 + "embeddings.token_type_embeddings.weight"][0])
        length = g.op("Slice", [g.op("Shape", ["input_ids"]), g.ints([1]), g.ints([2]), g.ints([0])])
        position = g.op("Slice", [positions, g.ints([0]), length, g.ints([0])])
        x = g.op("Add", [g.op("Add", [g.op("Gather", [word, "input_ids"], axis=0), position]), token_type])
        x = self.norm(x, p0 + "embeddings.LayerNorm")

        bias = g.op("Mul", [g.op("Sub", [g.scalar(1.0), mask]), g.scalar(-10000.0)])
        bias = g.op("Unsqueeze", [bias, g.ints([1, 2])])  # batch x 1 x 1 x tokens
        head_dim = self.hidden // self.heads
        split = g.ints([0, 0, self.heads, head_dim])
        joined = g.ints([0, 0, self.hidden])
        scale = g.scalar(1.0 / math.sqrt(head_dim))

        def split_heads(t: str, perm: Sequence[int]) -> str:
            return g.op("Transpose", [g.op("Reshape", [t, split])], perm=list(perm))

        for layer in range(self.layers):
            p = f"{p0}encoder.layer.{layer}."
            q = split_heads(self.linear(x, p + "attention.self.query"), (0, 2, 1, 3))
            k = split_heads(self.linear(x, p + "attention.self.key"), (0, 2, 3, 1))
            v = split_heads(self.linear(x, p + "attention.self.value"), (0, 2, 1, 3))
            scores = g.op("Add", [g.op("Mul", [g.op("MatMul", [q, k]), scale]), bias])
            attention = g.op("Softmax", [scores], axis=-1)
            context = g.op("Transpose", [g.op("MatMul", [attention, v])], perm=[0, 2, 1, 3])
            attended = self.linear(g.op("Reshape", [context, joined]), p + "attention.output.dense")
            x = self.norm(g.op("Add", [x, attended]), p + "attention.output.LayerNorm")
            inner = self.gelu(self.linear(x, p + "intermediate.dense"))
            x = self.norm(g.op("Add", [x, self.linear(inner, p + "output.dense")]), p + "output.LayerNorm")
        return x


_INPUTS: Final = (
    _value_info("input_ids", _INT64, ["batch", "tokens"]),
    _value_info("attention_mask", _INT64, ["batch", "tokens"]),
)


def encoder_model(weights: Weights, config: Mapping[str, Any], precision: Precision = "float32") -> bytes:
    """ONNX bytes: inputs ``input_ids`` and ``attention_mask`` (int64, batch x tokens), output
    ``last_hidden_state`` (float32, batch x tokens x hidden) of a bare BERT encoder checkpoint."""
    bert = _Bert(weights, config, "", precision)
    g = bert.g
    g.op("Identity", [bert.encode(g.op("Cast", ["attention_mask"], to=_FLOAT))], "last_hidden_state")
    output = _value_info("last_hidden_state", _FLOAT, ["batch", "tokens", bert.hidden])
    return g.model("encoder", _INPUTS, [output])


def splade_model(weights: Weights, config: Mapping[str, Any], precision: Precision = "float32") -> bytes:
    """ONNX bytes: inputs ``input_ids`` and ``attention_mask`` (int64, batch x tokens), output ``activation``
    (float32, batch x vocabulary) = max over masked tokens of log(1 + relu(MLM logits)) of a ``BertForMaskedLM``
    checkpoint. At ``int8`` only the vocabulary projection is quantized (see the module's note)."""
    bert = _Bert(weights, config, "bert.", "float32")
    g = bert.g
    mask = g.op("Cast", ["attention_mask"], to=_FLOAT)  # batch x tokens, 1 for real tokens
    x = bert.encode(mask)
    t = bert.norm(bert.gelu(bert.linear(x, "cls.predictions.transform.dense")), "cls.predictions.transform.LayerNorm")
    # log(1 + relu(.)) is monotonic, so the maximum over tokens is taken on the logits first and the activation is
    # computed on batch x vocabulary only. A padded token's row is replaced by its text's first token ([CLS], a real
    # one) before the projection: it repeats a row the maximum already sees, so the batch x tokens x vocabulary
    # tensor needs no mask and is touched once, by the maximum.
    real = g.op("Unsqueeze", [mask, g.ints([2])])  # batch x tokens x 1
    first = g.op("Slice", [t, g.ints([0]), g.ints([1]), g.ints([1])])  # batch x 1 x hidden
    t = g.op("Add", [g.op("Mul", [t, real]), g.op("Mul", [first, g.op("Sub", [g.scalar(1.0), real])])])
    decoder = weights.get("cls.predictions.decoder.weight", weights["bert.embeddings.word_embeddings.weight"])
    if precision == "float32":
        logits = bert.matmul(t, decoder.T, "decoder")
    elif precision == "int8":
        logits = _dynamic_int8_matmul(g, t, decoder.T, "decoder")
    else:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}")
    # The vocabulary bias is the same for every token: it is added after the maximum, on batch x vocabulary.
    best = g.op("ReduceMax", [logits], axes=[1], keepdims=0)
    best = g.op("Add", [best, g.const("decoder.b", weights["cls.predictions.bias"])])
    g.op("Log", [g.op("Add", [g.op("Relu", [best]), g.scalar(1.0)])], "activation")
    vocab = int(decoder.shape[0])
    return g.model("splade", _INPUTS, [_value_info("activation", _FLOAT, ["batch", vocab])])


def _dynamic_int8_matmul(g: _Graph, x: str, weight: npt.NDArray[np.float32], name: str) -> str:
    """``x @ weight`` through onnxruntime's fused ``DynamicQuantizeMatMul``, independent of the batch: each row of
    ``x`` scaled to a largest magnitude of 1, two constant columns (+1, -1; zero weights) so that every input spans
    exactly [-1, 1] (one scale and zero point for all batches), and each output row scaled back."""
    q, column_scale = _quantized(weight)
    q = np.concatenate([q, np.zeros((2, q.shape[1]), dtype=np.int8)])
    magnitude = g.op("Max", [g.op("ReduceMax", [g.op("Abs", [x])], axes=[-1], keepdims=1), g.scalar(1e-12)])
    one = g.op("Div", [magnitude, magnitude])
    unit = g.op("Concat", [g.op("Div", [x, magnitude]), one, g.op("Neg", [one])], axis=-1)
    product = g.op("DynamicQuantizeMatMul", [unit, g.const(name + ".q", q), g.const(name + ".s", column_scale)],
                   domain=MICROSOFT)  # fmt: skip
    return g.op("Mul", [product, magnitude])
