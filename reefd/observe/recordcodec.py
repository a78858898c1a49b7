"""How a record or report becomes bytes in LMDB, and back.

Knows nothing of keys, indexes or transactions.
"""

from __future__ import annotations

import array
import struct
import zlib
from typing import Any

import orjson

# --- values: compact JSON, deflated; token ids and logprobs as raw arrays beside it ---
# Token arrays are most of a record's JSON and compress poorly, so they are stored as int32 /
# float64 arrays (exact, and non-finite logprobs survive) after the deflated JSON of the rest. A top-K capture is
# two flat arrays, K entries per token: int32 ids and float32 logprobs (8 bytes per entry).

_ARRAYS = (("prompt_token_ids", "i"), ("completion_token_ids", "i"), ("completion_logprobs", "d"),
           ("completion_top_ids", "i"), ("completion_top_logprobs", "f"))
_ARRAY_INDEX = {name: i for i, (name, _) in enumerate(_ARRAYS)}
_HEAD = struct.Struct("<I")


def _as_array(values: Any, code: str) -> array.array[Any] | None:
    """The list as a typed array, or None when it does not fit one (then it stays in the JSON)."""
    if not isinstance(values, list):
        return None
    try:
        return array.array(code, values)
    except (TypeError, OverflowError):
        return None


ARRAYS = frozenset(name for name, _ in _ARRAYS)


def pack_arrays(obj: Any) -> tuple[dict[str, array.array[Any]], Any]:
    """The token arrays of a record that fit typed arrays, in their stored order, and the record without them."""
    arrays: dict[str, array.array[Any]] = {}
    if isinstance(obj, dict):
        for name, code in _ARRAYS:
            arr = _as_array(obj.get(name), code)
            if arr is not None:
                arrays[name] = arr
        if arrays:
            obj = {k: v for k, v in obj.items() if k not in arrays}
    return arrays, obj


def arrays_bytes(arrays: dict[str, array.array[Any]]) -> list[bytes]:
    parts = []
    for name, arr in arrays.items():
        parts += [bytes([_ARRAY_INDEX[name]]), _HEAD.pack(len(arr)), arr.tobytes()]
    return parts


def unpack_arrays(obj: dict[str, Any], value: bytes, prefix: dict[str, bytes] | None = None) -> None:
    """Put back the arrays `arrays_bytes` wrote (`prefix`: raw items that go before an array's own)."""
    at = 0
    while at < len(value):
        name, code = _ARRAYS[value[at]]
        (count,) = _HEAD.unpack_from(value, at + 1)
        at += 1 + _HEAD.size
        arr = array.array(code)
        if prefix and name in prefix:
            arr.frombytes(prefix[name])
        arr.frombytes(value[at:at + count * arr.itemsize])
        at += count * arr.itemsize
        obj[name] = arr.tolist()


def pack(obj: Any) -> bytes:
    arrays, rest = pack_arrays(obj)
    return pack_text(dumps(rest), arrays)


def dumps(obj: Any) -> bytes:
    """A record's JSON as stored (orjson: ~15x faster than json here; non-finite floats outside the arrays
    become null)."""
    return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)


def pack_text(text: bytes, arrays: dict[str, array.array[Any]]) -> bytes:
    """`pack` of a record given as `dumps` of all but its arrays, and the arrays `pack_arrays` took out."""
    deflated = zlib.compress(text, 1)
    return b"".join([b"a", _HEAD.pack(len(deflated)), deflated, *arrays_bytes(arrays)])


def unpack(value: bytes) -> Any:
    if value[:1] != b"a":
        raise ValueError(f"unknown record encoding {value[:1]!r}")
    (size,) = _HEAD.unpack_from(value, 1)
    at = 1 + _HEAD.size + size
    obj = orjson.loads(zlib.decompress(value[1 + _HEAD.size:at]))
    unpack_arrays(obj, value[at:])
    return obj
