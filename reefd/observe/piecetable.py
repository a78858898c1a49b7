"""The record store's pieces in LMDB: `pieces` (name -> stored bytes) and `piece_refs` (name -> how many
references the stored records and links hold), kept in the writer's transaction with the records themselves,
so a piece is written with the first record that needs it and deleted with the last.

A value in recordcodec's whole form (b"a", as every store written before pieces holds) reads and deletes as
before: both forms live side by side, and nothing is migrated.
"""

from __future__ import annotations

import struct
from typing import Any

import lmdb

from reefd.observe import pieces
from reefd.observe.recordcodec import pack, unpack

TABLES = ("pieces", "piece_refs")
_COUNT = struct.Struct("<Q")


def encode(txn: lmdb.Transaction[bytes], dbs: dict[str, Any], obj: dict[str, Any], whole: bool = False) -> bytes:
    """The value to store for `obj`, its pieces written or their counts raised in `txn`; `whole`: recordcodec's
    single value, as stores kept before pieces (for comparisons)."""
    if whole:
        return pack(obj)
    cut = pieces.split(obj)
    refs, table = dbs["piece_refs"], dbs["pieces"]
    for key in cut.uses:
        count = _count(txn, refs, key)
        if count == 0:
            txn.put(key, cut.pieces[key], db=table)
        txn.put(key, _COUNT.pack(count + 1), db=refs)
    return cut.value


def decode(txn: lmdb.Transaction[bytes], dbs: dict[str, Any], value: bytes) -> Any:
    """The object a stored value holds, in either form (a short record is a whole value in both stores)."""
    if value[:1] != pieces.FORMAT:
        return unpack(value)
    table = dbs["pieces"]
    return pieces.join(value, lambda key: txn.get(key, db=table))


def fields(value: bytes) -> Any:
    """What a deletion reads of a stored value (its session, user, turn_kind), without reassembling it."""
    return pieces.fields(value) if value[:1] == pieces.FORMAT else unpack(value)


def _count(txn: lmdb.Transaction[bytes], refs: Any, key: bytes) -> int:
    raw = txn.get(key, db=refs)
    return _COUNT.unpack(raw)[0] if raw is not None else 0


def release(txn: lmdb.Transaction[bytes], dbs: dict[str, Any], value: bytes) -> None:
    """A stored value is being deleted: lower its pieces' counts, deleting those it was the last to need."""
    if value[:1] != pieces.FORMAT:
        return
    refs, table = dbs["piece_refs"], dbs["pieces"]
    for key in pieces.uses(value, lambda k: txn.get(k, db=table)):
        count = _count(txn, refs, key)
        if count <= 1:
            txn.delete(key, db=refs)
            txn.delete(key, db=table)
        else:
            txn.put(key, _COUNT.pack(count - 1), db=refs)
