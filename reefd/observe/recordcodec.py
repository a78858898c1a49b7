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


def pack(obj: Any) -> bytes:
    arrays = []
    if isinstance(obj, dict):
        for name, code in _ARRAYS:
            arr = _as_array(obj.get(name), code)
            if arr is not None:
                arrays.append((name, arr))
        if arrays:
            obj = {k: v for k, v in obj.items() if k not in dict(arrays)}
    # orjson: ~15x faster than json here; non-finite floats elsewhere in a record become null
    text = zlib.compress(orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS), 1)
    parts = [b"a", _HEAD.pack(len(text)), text]
    for name, arr in arrays:
        parts += [bytes([_ARRAY_INDEX[name]]), _HEAD.pack(len(arr)), arr.tobytes()]
    return b"".join(parts)



def unpack(value: bytes) -> Any:
    if value[:1] != b"a":
        raise ValueError(f"unknown record encoding {value[:1]!r}")
    (size,) = _HEAD.unpack_from(value, 1)
    at = 1 + _HEAD.size + size
    obj = orjson.loads(zlib.decompress(value[1 + _HEAD.size:at]))
    while at < len(value):
        name, code = _ARRAYS[value[at]]
        (count,) = _HEAD.unpack_from(value, at + 1)
        at += 1 + _HEAD.size
        arr = array.array(code)
        arr.frombytes(value[at:at + count * arr.itemsize])
        at += count * arr.itemsize
        obj[name] = arr.tolist()
    return obj
