"""The protobuf messages of the Tinker wire that reefd reads and writes, declared here field by field as the SDK's
`tinker_public.proto` numbers them (tests/e2e/test_tinker.py drives reefd with the pinned SDK, whose own encoder
and decoder check it). Built at import into a descriptor pool of reefd's own, with google.protobuf alone: the
daemon never imports the SDK (which imports torch when it finds it).

Only what reefd needs is declared; a field it does not declare (provenance spans, top-K logprobs) is skipped
when a request is parsed.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

F = descriptor_pb2.FieldDescriptorProto
_PACKAGE = "reef_tinker_wire"
_ENUMS = {
    "DType": ["DTYPE_UNSPECIFIED", "DTYPE_FLOAT32", "DTYPE_INT64", "DTYPE_INT32", "DTYPE_BFLOAT16"],
    "StopReason": ["STOP_REASON_STOP", "STOP_REASON_LENGTH"],
}
_SCALARS = {"string": F.TYPE_STRING, "bytes": F.TYPE_BYTES, "int32": F.TYPE_INT32, "int64": F.TYPE_INT64,
            "uint32": F.TYPE_UINT32, "double": F.TYPE_DOUBLE, "bool": F.TYPE_BOOL}
# message -> [(number, name, type, repeated, oneof)]; a type is a scalar, an enum, a message, or map<string, T>
_MESSAGES: dict[str, list[tuple[int, str, str, bool, str | None]]] = {
    "EncodedTextChunk": [(1, "tokens", "bytes", False, None)],
    "ImageChunk": [(1, "data", "bytes", False, None), (2, "format", "string", False, None)],
    "DmelChunk": [(1, "dmel", "bytes", False, None)],
    "Chunk": [(1, "encoded_text", "EncodedTextChunk", False, "chunk"), (2, "image", "ImageChunk", False, "chunk"),
              (3, "dmel", "DmelChunk", False, "chunk")],
    "SparseCsr": [(1, "values", "bytes", False, None), (2, "crow_indices", "bytes", False, None),
                  (3, "col_indices", "bytes", False, None)],
    "Tensor": [(1, "dense", "bytes", False, "encoding"), (2, "sparse_csr", "SparseCsr", False, "encoding"),
               (3, "dtype", "DType", False, None), (4, "shape", "int64", True, None)],
    "Datum": [(1, "model_input", "Chunk", True, None), (2, "loss_fn_inputs", "map<Tensor>", False, None)],
    "LossConfigValue": [(1, "number", "double", False, "value"), (2, "text", "string", False, "value")],
    "ForwardBackwardRequest": [
        (1, "model_id", "string", False, None), (2, "seq_id", "int32", False, None),
        (3, "data", "Datum", True, None), (4, "loss_fn", "string", False, None),
        (5, "loss_fn_config", "map<double>", False, None), (6, "forward_only", "bool", False, None),
        (7, "loss_fn_config_v2", "map<LossConfigValue>", False, None)],
    "BatchedTensor": [(1, "data", "bytes", False, None), (2, "offsets", "bytes", False, None),
                      (3, "dtype", "DType", False, None), (4, "trailing_shape", "int64", True, None)],
    "ArrayRecord": [(1, "type_tag", "string", False, None), (2, "fields", "map<BatchedTensor>", False, None),
                    (3, "num_datums", "int64", False, None)],
    "ForwardBackwardOutput": [(1, "loss_fn_output_type", "string", False, None),
                              (2, "loss_fn_outputs", "ArrayRecord", True, None),
                              (3, "metrics", "map<double>", False, None)],
    "SampledSequence": [(1, "stop_reason", "StopReason", False, None), (2, "tokens", "bytes", False, None),
                        (3, "logprobs", "bytes", False, None)],
    "SampleResponse": [(1, "sequences", "SampledSequence", True, None), (2, "prompt_logprobs", "bytes", False, None),
                       (4, "prompt_cache_hit_tokens", "int32", False, None)],
}


def _typed(field: Any, kind: str) -> None:
    if kind in _SCALARS:
        field.type = _SCALARS[kind]
    else:
        field.type = F.TYPE_ENUM if kind in _ENUMS else F.TYPE_MESSAGE
        field.type_name = f".{_PACKAGE}.{kind}"


def _message(fdp: descriptor_pb2.FileDescriptorProto, name: str,
             fields: list[tuple[int, str, str, bool, str | None]]) -> None:
    msg = fdp.message_type.add(name=name)
    oneofs: list[str] = []
    for number, field_name, kind, repeated, oneof in fields:
        field = msg.field.add(name=field_name, number=number,
                              label=F.LABEL_REPEATED if repeated or kind.startswith("map<") else F.LABEL_OPTIONAL)
        if kind.startswith("map<"):  # map<string, V>: a nested entry message, as protoc writes one
            entry = msg.nested_type.add(name="".join(p.title() for p in field_name.split("_")) + "Entry")
            entry.options.map_entry = True
            entry.field.add(name="key", number=1, label=F.LABEL_OPTIONAL, type=F.TYPE_STRING)
            _typed(entry.field.add(name="value", number=2, label=F.LABEL_OPTIONAL), kind[4:-1])
            field.type, field.type_name = F.TYPE_MESSAGE, f".{_PACKAGE}.{name}.{entry.name}"
        else:
            _typed(field, kind)
        if oneof is not None:
            if oneof not in oneofs:
                oneofs.append(oneof)
                msg.oneof_decl.add(name=oneof)
            field.oneof_index = oneofs.index(oneof)


def _build() -> dict[str, Any]:
    fdp = descriptor_pb2.FileDescriptorProto(name="reef_tinker_wire.proto", package=_PACKAGE, syntax="proto3")
    for name, values in _ENUMS.items():
        enum = fdp.enum_type.add(name=name)
        for number, value in enumerate(values):
            enum.value.add(name=value, number=number)
    for name, fields in _MESSAGES.items():
        _message(fdp, name, fields)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.{name}"))
            for name in _MESSAGES}


_CLASSES = _build()
ForwardBackwardRequest = _CLASSES["ForwardBackwardRequest"]
ForwardBackwardOutput = _CLASSES["ForwardBackwardOutput"]
SampleResponse = _CLASSES["SampleResponse"]
Datum = _CLASSES["Datum"]
Tensor = _CLASSES["Tensor"]
DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32 = 1, 2, 3
STOP_REASON_STOP, STOP_REASON_LENGTH = 0, 1
DTYPE_NAMES = dict(enumerate(_ENUMS["DType"]))
