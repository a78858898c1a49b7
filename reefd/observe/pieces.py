"""A record split into pieces stored once: what a session's turns repeat (its transcript, its tools, its system
prompt, its prompt's token ids) is kept a single time, however many records hold it.

Coding agents resend their whole transcript on every turn, so a session's records held it over and over: a
60-turn session stored 43 times its final transcript. Here each message (an element of a list in the record, or
in a dict of it such as the provider's `request`), each long string in such a dict or in such a message (a
tool's output, shared by the forms a message takes: as sent, normalised, a next state), and each aligned chunk of
`prompt_token_ids` is a *piece*, named by the hash of its bytes (content-addressed, so the same message in the
raw request, in the normalised messages and in every later turn is one piece, and a system prompt or a tool list
shared by every session of a scenario is one piece too). A record keeps its small fields as before and, for each
value cut into pieces, the list of its pieces' hashes, itself cut into groups of hashes stored as pieces, so a
turn that extends the last one shares every full group with it: what a record adds is linear in what is new.
Token chunks are aligned from the prompt's start: a prompt that extends the previous turn's shares its chunks.

Why content addresses rather than a delta on the turn a record extends: a read never walks a chain of earlier
records (the last record of a 200-turn session reads as a record of one turn holding the same transcript does);
deleting any record, in any order, leaves the others whole; and what repeats across sessions is shared too.

The store counts each piece's references (reefd/observe/records.py) and deletes a piece with the last record
that needs it. Pure: knows nothing of LMDB; `split` gives the pieces, `join` takes a function that fetches one.
"""

from __future__ import annotations

import array
import hashlib
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from reefd.observe.recordcodec import ARRAYS, arrays_bytes, dumps, pack_arrays, pack_text, unpack_arrays

FORMAT = b"b"  # a record value in pieces (recordcodec's b"a": one whole value)
# A record whose JSON (but its token arrays) is shorter than this is stored whole, unread for pieces: what it
# could share is worth less than a piece costs (a name, a reference count, two LMDB entries), and most records
# served are that short. Within a longer record, a list of fewer bytes of JSON, or a shorter string, stays in it.
SMALL = LIST_MIN = STRING_MIN = 2048
CHUNK = 128  # token ids per piece of prompt_token_ids, aligned from the prompt's start
GROUP = 16  # hashes per group piece
HASH = 16  # bytes of a piece's name (BLAKE2b)
_U32 = struct.Struct("<I")
JSON, IDS, IDS16, HASHES = b"j", b"i", b"I", b"h"  # a piece's kind: its first byte, then its content, deflated
# (but HASHES). IDS: int32 token ids; IDS16: ids that all fit 16 bits, two bytes each (a vocabulary under 65536)
ELEMENT = b"e"  # a list element whose long strings are pieces of their own: their count, names, then its JSON


def name(kind: bytes, content: bytes) -> bytes:
    return hashlib.blake2b(kind + content, digest_size=HASH).digest()


@dataclass
class Split:
    """A record ready to store: its value, and every piece it references with how often (a piece referenced
    twice, say by the request and the normalised messages, counts twice)."""

    value: bytes
    pieces: dict[bytes, bytes]  # name -> stored bytes (kind byte + content; JSON deflated)
    uses: list[bytes]  # the names it references, with repeats


def _piece(split: Split, kind: bytes, content: bytes) -> bytes:
    key = name(kind, content)
    if key not in split.pieces:
        split.pieces[key] = kind + (content if kind == HASHES else zlib.compress(content, 1))
    split.uses.append(key)
    return key


def _element(split: Split, item: Any, part: bytes) -> bytes:
    """A cut list's element: its JSON `part`, or, for a dict holding strings of STRING_MIN or more (a tool's
    output, a long message), those strings as pieces of their own and the rest with them as null. So the same
    text is stored once in the request as sent, in the normalised messages and in a next state, whatever else
    differs between those forms of its message (a tool_call_id, a null content)."""
    long = [k for k, v in item.items() if type(v) is str and len(v) >= STRING_MIN] \
        if type(item) is dict and len(part) >= STRING_MIN else []
    if not long:
        return _piece(split, JSON, part)
    names = b"".join(_piece(split, JSON, orjson.dumps(item[k])) for k in long)
    body = dumps([long, {k: None if k in long else v for k, v in item.items()}])
    key = name(ELEMENT, names + body)
    if key not in split.pieces:
        split.pieces[key] = ELEMENT + _U32.pack(len(long)) + names + zlib.compress(body, 1)
    split.uses.append(key)
    return key


def _names(split: Split, keys: list[bytes]) -> tuple[int, bytes]:
    """A list of piece names as full groups (each a piece) and the rest: (groups, their names + the rest's)."""
    full = len(keys) // GROUP
    groups = [_piece(split, HASHES, b"".join(keys[i * GROUP:(i + 1) * GROUP])) for i in range(full)]
    return full, b"".join(groups + keys[full * GROUP:])


def _extends(lists: dict[int, list[bytes]], elements: list[bytes]) -> int | None:
    """An earlier list cut whose elements this one starts with (and it has a group's worth), or None."""
    for index, earlier in lists.items():
        if GROUP <= len(earlier) <= len(elements) and elements[:len(earlier)] == earlier:
            return index
    return None


def _ids_piece(split: Split, ids: array.array[int]) -> bytes:
    narrow = max(ids) < 65536 and min(ids) >= 0
    return _piece(split, IDS16 if narrow else IDS, array.array("H", ids).tobytes() if narrow else ids.tobytes())


def _cuts(record: dict[str, Any]) -> list[tuple[list[str], Any]]:
    """Where a record may be cut: its lists, and the lists and long strings of its dicts (paths of one or two
    keys). Exact types (JSON's): this runs for every record written, most of which have nothing to cut."""
    found = []
    for key, value in record.items():
        if key in ARRAYS:
            continue
        kind = type(value)
        if kind is list:
            found.append(([key], value))
        elif kind is dict:
            for inner, sub in value.items():
                inner_kind = type(sub)
                if inner_kind is list or (inner_kind is str and len(sub) >= STRING_MIN):
                    found.append(([key, inner], sub))
    return found


def split(record: dict[str, Any]) -> Split:
    """The record's value with its repeated parts as pieces. The value holds the record's JSON with each cut
    value set to null (so that keys keep their order), the cuts, then the token arrays as recordcodec keeps them,
    prompt_token_ids' full chunks as pieces. A record with nothing long enough to cut is one whole value."""
    out = Split(b"", {}, [])
    arrays, rest = pack_arrays(record)
    ids = arrays.get("prompt_token_ids")
    text = None
    if ids is None or len(ids) < CHUNK:
        text = dumps(rest)
        if len(text) < SMALL:  # no list or string in it is long enough to cut: the whole value, at once
            out.value = pack_text(text, arrays)
            return out
    skeleton = rest if rest is not record else dict(record)  # pack_arrays copied it when it took arrays out
    cuts: list[list[Any]] = []  # [path, "str", 0] | [path, "list", groups, count] | [path, "extends", cut, extra]
    lists: dict[int, list[bytes]] = {}  # a list cut's index -> its elements' names
    blob: list[bytes] = []
    for path, value in _cuts(skeleton):
        if isinstance(value, str):
            key = _piece(out, JSON, orjson.dumps(value))
            cuts.append([path, "str", 0])
            blob.append(key)
        else:
            if len(dumps(value)) < LIST_MIN:  # one call: most lists are short
                continue
            parts = [dumps(item) for item in value]
            elements = [_element(out, item, p) for item, p in zip(value, parts, strict=True)]
            base = _extends(lists, elements)
            if base is None:
                groups, keys = _names(out, elements)
                cuts.append([path, "list", groups, len(parts)])
            else:  # the normalised messages: the request's, then the reply
                keys = b"".join(elements[len(lists[base]):])
                cuts.append([path, "extends", base, len(parts) - len(lists[base])])
            lists[len(cuts) - 1] = elements
            blob.append(keys)
        _set(skeleton, path, None, copy=True)
    chunked = None
    if ids is not None and len(ids) >= CHUNK:
        full = len(ids) // CHUNK
        groups, keys = _names(out, [_ids_piece(out, ids[i * CHUNK:(i + 1) * CHUNK]) for i in range(full)])
        chunked = [groups, full]
        blob.append(keys)
        arrays["prompt_token_ids"] = ids[full * CHUNK:]
    if not cuts and chunked is None:  # nothing repeats: the whole value, as recordcodec keeps it
        out.value = pack_text(text if text is not None else dumps(skeleton), arrays)  # skeleton is rest here
        return out
    head = orjson.dumps({"cuts": cuts, "chunked": chunked})
    text = zlib.compress(dumps(skeleton), 1)
    names = b"".join(blob)
    out.value = b"".join([FORMAT, _U32.pack(len(text)), text, _U32.pack(len(head)), head, _U32.pack(len(names)),
                          names, zlib.compress(b"".join(arrays_bytes(arrays)), 1)])
    return out


def _set(obj: dict[str, Any], path: list[str], value: Any, copy: bool = False) -> None:
    if len(path) == 1:
        obj[path[0]] = value
        return
    inner = dict(obj[path[0]]) if copy else obj[path[0]]
    inner[path[1]] = value
    obj[path[0]] = inner


Fetch = Callable[[bytes], bytes | None]
"""(a piece's name) -> its stored bytes, or None when it is missing."""


class MissingPiece(ValueError):
    """A record names a piece the store does not hold."""


class _Reader:
    def __init__(self, value: bytes) -> None:
        self.value, self.at = value, 1

    def block(self) -> bytes:
        (size,) = _U32.unpack_from(self.value, self.at)
        start = self.at + _U32.size
        self.at = start + size
        return self.value[start:self.at]


def _parts(value: bytes) -> tuple[bytes, dict[str, Any], bytes, bytes]:
    """(the deflated JSON with cuts as null, the cuts, the names, the deflated arrays), nothing inflated but
    the cuts."""
    reader = _Reader(value)
    rest = reader.block()
    head = orjson.loads(reader.block())
    names = reader.block()
    return rest, head, names, value[reader.at:]


def fields(value: bytes) -> dict[str, Any]:
    """A stored value's own fields, without fetching a piece: its top-level strings and numbers (session, user,
    turn_kind, ...) are never cut; what was cut reads as null."""
    result: dict[str, Any] = orjson.loads(zlib.decompress(_parts(value)[0]))
    return result


def _fetch(fetch: Fetch, key: bytes) -> bytes:
    stored = fetch(key)
    if stored is None:
        raise MissingPiece(f"piece {key.hex()} is missing")
    return stored


def _strings(stored: bytes) -> tuple[list[bytes], int]:
    """An ELEMENT piece's string pieces' names, and where its JSON starts."""
    (count,) = _U32.unpack_from(stored, 1)
    at = 1 + _U32.size
    return [stored[at + i * HASH:at + (i + 1) * HASH] for i in range(count)], at + count * HASH


def _item(fetch: Fetch, key: bytes) -> Any:
    """A cut list's element, as `split` was given it."""
    stored = _fetch(fetch, key)
    if stored[:1] != ELEMENT:
        return orjson.loads(_content(stored))
    strings, at = _strings(stored)
    long, item = orjson.loads(zlib.decompress(stored[at:]))
    for k, string in zip(long, strings, strict=True):
        item[k] = orjson.loads(_load(fetch, string))
    return item


def _load(fetch: Fetch, key: bytes) -> bytes:
    return _content(_fetch(fetch, key))


def _content(stored: bytes) -> bytes:
    """A piece's content (IDS16 widened to int32 ids, as the record's array holds them)."""
    kind, content = stored[:1], stored[1:]
    if kind == HASHES:
        return content
    if kind == IDS16:
        return array.array("i", array.array("H", zlib.decompress(content))).tobytes()
    return zlib.decompress(content)


def _expand(fetch: Fetch, names: bytes, at: int, groups: int, count: int) -> tuple[list[bytes], int, list[bytes]]:
    """The `count` names a cut lists, from `groups` group pieces then single names at `at`; the offset after
    them; the group pieces' own names."""
    group_keys = [names[at + i * HASH:at + (i + 1) * HASH] for i in range(groups)]
    at += groups * HASH
    keys: list[bytes] = []
    for g in group_keys:
        content = _load(fetch, g)
        keys += [content[i:i + HASH] for i in range(0, len(content), HASH)]
    tail = count - len(keys)
    keys += [names[at + i * HASH:at + (i + 1) * HASH] for i in range(tail)]
    return keys, at + tail * HASH, group_keys


def _walk(head: dict[str, Any], names: bytes,
          fetch: Fetch) -> Iterator[tuple[list[str] | None, str, list[bytes], list[bytes]]]:
    """Each cut of a stored value: (path or None for the token chunks, kind, its pieces' names, its groups')."""
    at = 0
    listed: dict[int, list[bytes]] = {}
    for index, cut in enumerate(head["cuts"]):
        path, kind = cut[0], cut[1]
        if kind == "str":
            yield path, kind, [names[at:at + HASH]], []
            at += HASH
            continue
        if kind == "extends":
            extra = [names[at + i * HASH:at + (i + 1) * HASH] for i in range(cut[3])]
            at += cut[3] * HASH
            listed[index] = keys = listed[cut[2]] + extra
            yield path, "list", keys, []
            continue
        keys, at, groups = _expand(fetch, names, at, cut[2], cut[3])
        listed[index] = keys
        yield path, kind, keys, groups
    if head["chunked"] is not None:
        keys, at, groups = _expand(fetch, names, at, *head["chunked"])
        yield None, "ids", keys, groups


def join(value: bytes, fetch: Fetch) -> dict[str, Any]:
    """The record `split` was given, exactly (key order, values, arrays), from its value and its pieces."""
    text, head, names, arrays = _parts(value)
    rest = orjson.loads(zlib.decompress(text))
    chunks = b""
    for path, kind, keys, _ in _walk(head, names, fetch):
        if path is None:
            chunks = b"".join(_load(fetch, k) for k in keys)
        elif kind == "str":
            _set(rest, path, orjson.loads(_load(fetch, keys[0])))
        else:
            _set(rest, path, [_item(fetch, k) for k in keys])
    unpack_arrays(rest, zlib.decompress(arrays), prefix={"prompt_token_ids": chunks} if chunks else None)
    result: dict[str, Any] = rest
    return result


def uses(value: bytes, fetch: Fetch) -> list[bytes]:
    """Every piece name a stored value references, with repeats, as `split` counted them (for its deletion)."""
    _, head, names, _ = _parts(value)
    out: list[bytes] = []
    for _, kind, keys, groups in _walk(head, names, fetch):
        out += keys + groups
        if kind == "list":  # an element's own string pieces count once for each use of it
            for key in keys:
                if (stored := _fetch(fetch, key))[:1] == ELEMENT:
                    out += _strings(stored)[0]
    return out
