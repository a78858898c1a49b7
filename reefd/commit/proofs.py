"""A release's fingerprint: the greedy answers of its model on the scenario's probe set (`release.proof`), computed by
the reference (`python -m reefd.train.fingerprint`, transformers and PEFT in a process of their own) from the
release's own files. A candidate gets it when it is written (`stamp`: meta `proof`); a release made before, or
one that carries its parent's model, gets it at its first load, kept in STATE/proofs by the model it names (its
weights and adapter trees). The engine then holds every process that loads it to those answers
(reefd/engines/proof.py). Knows nothing of engines' processes or of HTTP.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from reefd.commit.chain import Candidate
from reefd.engines import Engine, Proves, WeightSwap
from reefd.engines.launch import die_with_parent
from reefd.engines.proof import Fingerprint
from reefd.ops.files import write_json

log = logging.getLogger("reefd.commit.proofs")

REFERENCE_TIMEOUT_S = 900.0


class ReferenceFailed(Exception):
    """The reference could not compute a fingerprint (the model or adapter does not load)."""


def probe_of(cfg: Any) -> dict[str, Any]:
    """The probe a scenario's `release.proof` settings declare."""
    return {"texts": list(cfg.prompts), "max_tokens": int(cfg.max_tokens)}


def in_meta(meta: dict[str, Any], probe: dict[str, Any]) -> Fingerprint | None:
    """The fingerprint a release's meta keeps for `probe`: its own, or (a rollback, a promote) its target's."""
    while isinstance(meta, dict):
        kept = meta.get("proof")
        if isinstance(kept, dict) and kept.get("probe") == probe:
            return Fingerprint.from_json(kept)
        meta = meta.get("target_meta")  # type: ignore[assignment]
    return None


class Reference:
    """The reference process (`python -m reefd.train.fingerprint --serve`): started at its first use, kept while
    reefd runs (torch is imported once), one fingerprint at a time; started again if it died."""

    def __init__(self) -> None:
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    async def fingerprint(self, model: Path, adapter: Path | None, probe: dict[str, Any],
                          tokenizer: Path) -> Fingerprint:
        """The fingerprint of the model folder `model` with `adapter` (a PEFT folder) on it; the probe's texts
        tokenized by the tokenizer in `tokenizer` (the base model's: a weights folder may have none)."""
        request = {"model": str(model), "adapter": str(adapter) if adapter else None, "tokenizer": str(tokenizer),
                   "probe": probe}
        async with self._lock:
            try:
                answer = await asyncio.wait_for(self._ask(request), REFERENCE_TIMEOUT_S)
            except (OSError, ValueError, TimeoutError, asyncio.IncompleteReadError) as exc:
                await self.close()
                raise ReferenceFailed(f"the reference process failed: {exc}") from None
            except BaseException:  # cancelled mid-request: its answer must not reach the next caller
                if self._proc is not None and self._proc.returncode is None:
                    self._proc.kill()
                self._proc = None
                raise
        fp = Fingerprint.from_json(answer.get("fingerprint"))
        if fp is None:
            raise ReferenceFailed(f"the reference fingerprint of {model}{f' with {adapter}' if adapter else ''} "
                                  f"failed: {answer.get('error') or 'a malformed answer'}")
        return fp

    async def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        if self._proc is None or self._proc.returncode is not None:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "reefd.train.fingerprint", "--serve", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, preexec_fn=die_with_parent,
                env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"}, limit=1 << 24)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps(request).encode() + b"\n")
        await self._proc.stdin.drain()
        line = await self._proc.stdout.readline()
        if not line:
            raise asyncio.IncompleteReadError(line, None)
        answer = json.loads(line)
        if not isinstance(answer, dict):
            raise ValueError("not a JSON object")
        return answer

    async def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()


def stamped(fp: Fingerprint, probe: dict[str, Any]) -> dict[str, Any]:
    """What a release's meta keeps: the probe and the answers."""
    return {"probe": probe, **fp.as_json()}


async def stamp(ref: Reference, cand: Candidate, cfg: Any, engine: Engine) -> None:
    """Put a new adapter's or weights' fingerprint in its meta (`proof`), from its own files: weights alone, an
    adapter (a bundle's included) on the weights it serves on, and only while the engine serves those (else its
    first load computes it). Not for a candidate refused (never loaded), one that has it (its trainer's), or an
    engine that does not prove, or whose model is on another machine (the reference reads the files). When the
    reference fails, the release is written without one, and its first load computes it (and refuses to serve it
    if it fails again)."""
    base, serving = engine.model_folder(), engine.weights.path if isinstance(engine, WeightSwap) else None
    passed = cand.verdict is None or cand.verdict.get("verdict") == "pass"
    kind = "adapter" if cand.kind == "bundle" else cand.kind  # a bundle's adapter is what the engine loads
    if kind not in ("adapter", "weights") or not cfg.enabled or "proof" in cand.meta or not passed or \
            cand.artifact is None or not isinstance(engine, Proves) or base is None or not base.is_dir():
        return
    if kind == "adapter" and (cand.meta.get("weights") or {}).get("tree") != (serving.name if serving else None):
        return
    probe = probe_of(cfg)
    artifact = cand.artifact / "adapter" if cand.kind == "bundle" else cand.artifact
    model, adapter = (artifact, None) if kind == "weights" else (serving or base, artifact)
    log.info("computing the reference fingerprint of a new %s candidate", cand.kind)
    try:
        cand.meta["proof"] = stamped(await ref.fingerprint(model, adapter, probe, base), probe)
    except ReferenceFailed as exc:
        log.warning("%s", exc)


class Proofs:
    """The fingerprints of the models releases name, kept in STATE/proofs (one JSON file per model and probe)."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir / "proofs"
        self.reference = Reference()

    def _path(self, weights: str | None, adapter: str | None, probe: dict[str, Any]) -> Path:
        key = json.dumps([weights, adapter, probe], sort_keys=True).encode()
        return self.dir / f"{hashlib.sha256(key).hexdigest()[:32]}.json"

    def forget(self, trees: tuple[str | None, str | None], probe: dict[str, Any]) -> None:
        """Remove the kept fingerprint of the model the trees name (a deleted user's adapter; blocking)."""
        self._path(*trees, probe).unlink(missing_ok=True)

    async def of(self, meta: dict[str, Any], trees: tuple[str | None, str | None], probe: dict[str, Any],
                 model: Path, adapter: Path | None, tokenizer: Path) -> Fingerprint:
        """The fingerprint of the model the trees (weights, adapter) name: from the release's meta, else kept, else
        the reference's (then kept)."""
        found = in_meta(meta, probe)
        if found is not None:
            return found
        path = self._path(*trees, probe)
        kept = await asyncio.to_thread(_read, path)
        if kept is not None:
            return kept
        log.info("computing the reference fingerprint of %s%s", model, f" with {adapter}" if adapter else "")
        fp = await self.reference.fingerprint(model, adapter, probe, tokenizer)
        await asyncio.to_thread(write_json, path, stamped(fp, probe))
        return fp


def _read(path: Path) -> Fingerprint | None:
    try:
        return Fingerprint.from_json(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None
