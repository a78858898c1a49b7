"""reefctl's job lines: the progress bar of `train --follow` and the one-line outcome."""

from __future__ import annotations

from reefd.cli.job_verbs import outcome, progress_line

JOB = {"id": "j-1", "state": "running", "stage": "train", "release": None, "verdict": None, "error": None,
       "progress": {"step": 3, "steps": 8, "loss": 0.41234, "tokens_per_s": 951.6}}


def test_progress_bar_while_training() -> None:
    assert progress_line(JOB) == "j-1: train [#########---------------] step 3/8 loss 0.4123 952 tok/s"
    assert progress_line({**JOB, "progress": {"step": 8, "steps": 8}}) == f"j-1: train [{'#' * 24}] step 8/8"


def test_other_stages_show_their_name() -> None:
    assert progress_line({**JOB, "stage": "gate"}) == "j-1: gate"
    assert progress_line({**JOB, "stage": "train", "progress": {}}) == "j-1: train"


def test_outcomes() -> None:
    assert outcome({**JOB, "state": "published", "release": "r2-abcdef0"}) == (
        "job/j-1 published r2-abcdef0 (serving on the next request)")
    rejected = {**JOB, "state": "rejected", "release": "r2-abcdef0",
                "verdict": {"reason": "candidate 0.2 vs current 0.5"}}
    assert outcome(rejected) == "job/j-1 rejected candidate r2-abcdef0: candidate 0.2 vs current 0.5"
    assert outcome({**JOB, "state": "failed", "error": "non-finite loss at step 1"}) == (
        "job/j-1 failed: non-finite loss at step 1")
    assert outcome({**JOB, "state": "skipped", "error": None}) == "job/j-1 skipped"
