"""The text the tiny model's BPE tokenizer is trained on: agent prose, tool schemas, code, read from tiny_corpus.txt.

Owns reading that file into its sections (the file's first section says how it is laid out). The text is fixed
(every build trains on the same bytes), so the tokenizer depends on the file's exact bytes. Knows nothing about
tokenizers or models.
"""

from __future__ import annotations

from importlib import resources

_SEPARATOR = "\n<<<reef-corpus-section>>>\n"  # a whole line that no section contains


def corpus() -> list[str]:
    """The training text: whole sections, so newlines and indentation are learned too."""
    data = resources.files("reefd.worker").joinpath("tiny_corpus.txt").read_bytes()  # bytes: no newline translation
    return data.decode("utf-8").split(_SEPARATOR)[1:]  # the first section describes the file
