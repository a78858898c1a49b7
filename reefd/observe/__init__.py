"""Observe: durable records and reports (LMDB), receipts, conversations and their next states, retention."""
