"""Where tokens come from, and how they are compared."""

from __future__ import annotations

import stat
from pathlib import Path

from reefd.auth import load_tokens, matches


def test_env_tokens_allow_rotation(tmp_path: Path) -> None:
    assert load_tokens(tmp_path, {"REEF_TOKEN": "new, old"}) == ["new", "old"]
    assert not (tmp_path / "token").exists()


def test_systemd_credential_is_used(tmp_path: Path) -> None:
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "token").write_text("from-cred\n")
    assert load_tokens(tmp_path / "state", {"CREDENTIALS_DIRECTORY": str(creds)}) == ["from-cred"]


def test_generated_once_then_reused_mode_0600(tmp_path: Path) -> None:
    first = load_tokens(tmp_path, {})
    assert stat.S_IMODE((tmp_path / "token").stat().st_mode) == 0o600
    assert load_tokens(tmp_path, {}) == first
    assert first[0].startswith("reef-") and len(first[0]) > 40


def test_matches_any_token_and_rejects_missing() -> None:
    assert matches("b", ["a", "b"])
    assert not matches("c", ["a", "b"])
    assert not matches(None, ["a"])
    assert not matches("", [""])
