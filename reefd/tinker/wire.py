"""The Tinker API's protobuf bodies (their messages in messages.py): a `forward_backward` request decoded and
checked, and the two results the SDK takes only as protobuf (ForwardBackwardOutput, SampleResponse) encoded. A
request that cannot be done as sent raises WireError, whose message names the datum and the field (the route
answers it 400).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from reefd.tinker import messages as pb
from reefd.train.loss_table import LOSS_SPECS

_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


class WireError(ValueError):
    """`model_id` and `seq_id`: the request's, once its body parsed (the route lets the model's later requests on)."""

    def __init__(self, message: str, model_id: str | None = None, seq_id: int | None = None) -> None:
        super().__init__(message)
        self.model_id, self.seq_id = model_id, seq_id


@dataclass(frozen=True)
class Datum:
    tokens: list[int]
    inputs: dict[str, list[float] | list[int]]


@dataclass(frozen=True)
class ForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float]
    backward: bool
    data: list[Datum]

    @property
    def tokens(self) -> int:
        return sum(len(d.tokens) for d in self.data)


def forward_backward(body: bytes, vocab_of: Callable[[str], int | None] = lambda _: None) -> ForwardBackward:
    """The request in `body`, checked: a known loss with the inputs it needs, each input one value per position,
    finite, and token ids inside the vocabulary `vocab_of(model_id)` gives (None: not checked)."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise WireError(f"the body is not a ForwardBackwardRequest protobuf ({exc})") from None
    try:
        spec = LOSS_SPECS.get(msg.loss_fn)
        if spec is None:
            raise WireError(f"loss_fn {msg.loss_fn!r} is not one reefd runs; it runs {', '.join(LOSS_SPECS)}")
        config = _config(msg, spec.config)
        if not msg.data:
            raise WireError("data is empty: a forward_backward needs at least one datum")
        vocab_size = vocab_of(msg.model_id)
        data = [_datum(i, d, spec.needs, vocab_size) for i, d in enumerate(msg.data)]
    except WireError as exc:
        raise WireError(str(exc), msg.model_id, int(msg.seq_id)) from None
    return ForwardBackward(msg.model_id, int(msg.seq_id), msg.loss_fn, config, not msg.forward_only, data)


def _config(msg: Any, defaults: dict[str, float]) -> dict[str, float]:
    config = dict(defaults)
    given = {k: v.number for k, v in msg.loss_fn_config_v2.items() if v.WhichOneof("value") == "number"} or \
        dict(msg.loss_fn_config)
    for key, value in given.items():
        if key not in defaults:
            raise WireError(f"loss_fn_config: {msg.loss_fn} takes {', '.join(defaults) or 'no settings'}, "
                            f"not {key!r}")
        if not math.isfinite(value):
            raise WireError(f"loss_fn_config.{key} is {value}; it must be a finite number")
        config[key] = float(value)
    return config


def _datum(i: int, d: Any, needs: tuple[str, ...], vocab_size: int | None) -> Datum:
    where = f"data[{i}]"
    tokens: list[int] = []
    for chunk in d.model_input:
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise WireError(f"{where}.model_input: reefd trains on text; a {chunk.WhichOneof('chunk')} chunk "
                            "cannot be taken")
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
    if not tokens:
        raise WireError(f"{where}.model_input has no tokens")
    missing = [k for k in ("target_tokens", *needs) if k not in d.loss_fn_inputs]
    if missing:
        raise WireError(f"{where}.loss_fn_inputs lacks {', '.join(missing)}")
    inputs: dict[str, list[float] | list[int]] = {}
    for name in ("target_tokens", *needs):
        values = _tensor(f"{where}.loss_fn_inputs.{name}", d.loss_fn_inputs[name], len(tokens))
        inputs[name] = values.astype(np.int64).tolist() if name == "target_tokens" else values.tolist()
    targets = inputs["target_tokens"]
    for what, ids in (("model_input", tokens), ("loss_fn_inputs.target_tokens", targets)):
        bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            raise WireError(f"{where}.{what}: token id {bad[0]} is outside the model's vocabulary "
                            f"(0..{(vocab_size or 0) - 1})")
    return Datum(tokens, inputs)


def _tensor(where: str, t: Any, length: int) -> np.ndarray:
    dtype = _DTYPES.get(t.dtype)
    if dtype is None:
        raise WireError(f"{where}: dtype {pb.DTYPE_NAMES.get(t.dtype, t.dtype)} is not float32, int64 or int32")
    if t.WhichOneof("encoding") != "dense":
        raise WireError(f"{where}: reefd takes dense tensors of shape [N] (one value per position)")
    if len(t.dense) % np.dtype(dtype).itemsize:
        raise WireError(f"{where}: {len(t.dense)} bytes is not a whole number of {np.dtype(dtype).name} values")
    values = np.frombuffer(t.dense, dtype=dtype)
    shape = list(t.shape) or [values.size]
    if len(shape) != 1:
        raise WireError(f"{where}: shape {shape}: reefd takes shape [N] (top-K targets of shape [N, K] are not "
                        "supported)")
    if shape[0] != values.size:
        raise WireError(f"{where}: shape {shape} but {values.size} values were sent")
    if values.size != length:
        raise WireError(f"{where}: {values.size} values for {length} positions of model_input (one per position)")
    if values.dtype.kind == "f" and not np.isfinite(values).all():
        raise WireError(f"{where}: value {values[~np.isfinite(values)][0]} is not finite")
    return values


def forward_backward_output(outputs: list[dict[str, list[float]]], metrics: dict[str, float]) -> bytes:
    """A ForwardBackwardOutput: one record of every datum's per-position fields (float32, concatenated, with
    byte offsets), and metrics named `name:reduction`."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in outputs[0] if outputs else ():
        arrays = [np.asarray(o[name], dtype=np.float32) for o in outputs]
        field = record.fields[name]
        field.dtype = pb.DTYPE_FLOAT32
        field.data = b"".join(a.tobytes() for a in arrays)
        field.offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64).tobytes()
    for key, value in metrics.items():
        out.metrics[key] = float(value)
    return bytes(out.SerializeToString())


@dataclass(frozen=True)
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool  # at a stop sequence or the end of text (else: at max_tokens)


def sample_response(sequences: list[Sequence], prompt_logprobs: list[float] | None = None) -> bytes:
    """A SampleResponse: each sequence's generated ids (int32) and their log-probs (float32); the prompt's
    log-probs when asked (the first position has none: NaN)."""
    out = pb.SampleResponse()
    for seq in sequences:
        out.sequences.add(stop_reason=pb.STOP_REASON_STOP if seq.stopped else pb.STOP_REASON_LENGTH,
                          tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes(),
                          logprobs=np.asarray(seq.logprobs, dtype=np.float32).tobytes())
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return bytes(out.SerializeToString())
