"""Receipts: ULIDs that name records, sortable by creation time, unique within the process.

Knows nothing of storage or HTTP.
"""

from __future__ import annotations

import base64
import re
import secrets
import threading
import time

_B32_TO_CROCKFORD = bytes.maketrans(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567", b"0123456789ABCDEFGHJKMNPQRSTVWXYZ")
_CROCKFORD_TO_INDEX = bytes.maketrans(b"0123456789ABCDEFGHJKMNPQRSTVWXYZ", bytes(range(32)))
_RECEIPT = re.compile(r"[0-7][0-9A-HJKMNP-TV-Z]{25}")
_ulid_lock = threading.Lock()
_ulid_last = (0, 0)


def new_receipt() -> str:
    """A ULID: 48-bit ms timestamp + 80 random bits; later calls sort after earlier ones."""
    global _ulid_last
    with _ulid_lock:
        ms = time.time_ns() // 1_000_000
        last_ms, last_rand = _ulid_last
        if ms > last_ms:
            rand = secrets.randbits(80)
        else:  # same millisecond (or the clock stepped back): count up from the last one
            ms, rand = last_ms, last_rand + 1
            if rand >> 80:
                ms, rand = ms + 1, secrets.randbits(79)
        _ulid_last = (ms, rand)
    # 130 bits (2 leading zeros + 128) are the top of 17 bytes; RFC 4648 base32, then Crockford letters.
    raw = ((ms << 80 | rand) << 6).to_bytes(17, "big")
    return base64.b32encode(raw)[:26].translate(_B32_TO_CROCKFORD).decode()


def is_receipt(value: object) -> bool:
    return isinstance(value, str) and _RECEIPT.fullmatch(value) is not None


def receipt_ms(receipt: str) -> int:
    """The creation time a receipt carries, in ms since the epoch (its top 48 bits)."""
    value = 0
    for char in receipt[:10].encode().translate(_CROCKFORD_TO_INDEX):
        value = value * 32 + char
    return value


def receipt_floor(ms: int) -> str:
    """The smallest receipt of that millisecond: every receipt created at or after `ms` sorts after it."""
    raw = ((max(0, ms) << 80) << 6).to_bytes(17, "big")
    return base64.b32encode(raw)[:26].translate(_B32_TO_CROCKFORD).decode()
