"""The release chain's value types and refusals: a release, the refs of a release line (a scenario's shared line,
or one user's), names, and the errors chain operations raise. Knows ref names; nothing about git objects."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from reefd.ops.tokens import user_problem

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class ReleaseError(Exception):
    """Base class for release chain errors."""


class InvalidName(ReleaseError, ValueError):
    """A scenario name that could escape the ref namespace or the filesystem."""

    def __init__(self, name: object) -> None:
        super().__init__(f"invalid scenario name: {name!r}")
        self.name = name


class UnknownRelease(ReleaseError, KeyError):
    """No release with this id is reachable from its scenario's head."""


class WrongScenario(ReleaseError, ValueError):
    """The target release belongs to another scenario."""


class NothingToRollBack(UnknownRelease):
    """A plain rollback of a scenario whose head is its first release."""


class HeadConflict(ReleaseError):
    """The scenario head is not what the publisher expected; nothing was overwritten."""

    def __init__(self, scenario: str, expected: str | None, actual: str | None, user: str | None = None) -> None:
        super().__init__(f"{line_label(scenario, user)}: expected head {expected}, found {actual}")
        self.scenario, self.expected, self.actual, self.user = scenario, expected, actual, user


class Pinned(ReleaseError):
    """The scenario's file pins its release (release.pin): it takes no other release."""

    def __init__(self, scenario: str, pin: str) -> None:
        super().__init__(f"scenario {scenario!r} is pinned to {pin}")
        self.scenario, self.pin = scenario, pin


class TrialRefused(ReleaseError):
    """Full weights a scenario would put on trial (release.canary or release.shadow) on an engine that cannot host
    one: a trial of weights needs two or more replicas, since one engine process serves one set of weights."""

    def __init__(self, scenario: str, mode: str, replicas: int) -> None:
        super().__init__(
            f"scenario {scenario!r} puts new releases on a {mode} trial, but full weights go on trial on some of "
            f"its replicas, and its model runs {replicas} (one process serves one set of weights): set "
            f"model.replicas: 2 or more, or release.{mode}.share: 0 to serve weights releases to everyone at once")
        self.scenario, self.mode, self.replicas = scenario, mode, replicas


class WeightsRefused(ReleaseError):
    """Full weights the scenario's engine cannot serve (its kind's swap_limits, or no full-weights ability at
    all): refused before anything is written, so the chain's head never names a release the engine cannot take."""

    def __init__(self, scenario: str, why: str) -> None:
        super().__init__(f"scenario {scenario!r} cannot serve these full weights: {why}")
        self.scenario, self.why = scenario, why


class BaseMismatch(ReleaseError):
    """An adapter made on other weights than the head's: it would serve on a model it was not trained on."""

    def __init__(self, scenario: str, trained_on: str | None, head_weights: str | None) -> None:
        super().__init__(f"scenario {scenario!r}: the adapter was trained on "
                         f"{_weights_label(trained_on)}, but the head serves {_weights_label(head_weights)}")
        self.scenario, self.trained_on, self.head_weights = scenario, trained_on, head_weights


def _weights_label(release: str | None) -> str:
    return f"the weights of {release}" if release else "the base model's weights"


class NoRelease(ReleaseError):
    """The scenario has no release yet (its base is recorded at its first start)."""

    def __init__(self, scenario: str) -> None:
        super().__init__(f"scenario {scenario!r} has no base release yet")
        self.scenario = scenario


@dataclass(frozen=True)
class Release:
    id: str
    scenario: str
    parent: str | None
    kind: str
    meta: dict[str, Any]
    commit: str
    created_at: str
    seq: int
    status: str = "released"  # or "rejected": a candidate the gates refused, kept for the record, never served
    user: str | None = None  # the user whose line it is on (None: the scenario's shared line)


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or ".." in name or name.endswith((".lock", ".")):
        raise InvalidName(name)
    return name


def line_root(scenario: str, user: str | None = None) -> str:
    """The refs of one release line: the scenario's shared line, or one user's (user names follow
    reefd/ops/tokens.py's rule, which leaves them usable as one ref component)."""
    root = f"refs/reef/scenarios/{validate_name(scenario)}/"
    if user is None:
        return root
    if user_problem(user) is not None:
        raise InvalidName(user)
    return f"{root}users/{user}/"


def head_ref(scenario: str, user: str | None = None) -> str:
    return line_root(scenario, user) + "head"


def rejected_prefix(scenario: str, user: str | None = None) -> str:
    return line_root(scenario, user) + "rejected/"


def line_label(scenario: str, user: str | None = None) -> str:
    """How messages name a line: scenario 'assist', or scenario 'assist' (user 'alice')."""
    return f"scenario {scenario!r}" + ("" if user is None else f" (user {user!r})")
