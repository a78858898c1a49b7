"""The harness tree model: a scenario's rules, skills, prompts and config as a validated set of entries (entry.py)
and as files. Owns the layout, the limits, parsing, atomic mutations and the system-prompt block; knows nothing
about git, releases, HTTP or how agents install the files."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from reefd.harness import declared
from reefd.harness.entry import (
    _ID_RE,
    _SKILL_FILE,
    CONFIG_ID,
    FOLDERS,
    ID_PATTERN,
    KINDS,
    MAX_BODY_BYTES,
    MAX_DESCRIPTION_CHARS,
    Entry,
    HarnessError,
    _Bad,
    _check_id,
    _exact_keys,
    _word,
)

__all__ = ["CONFIG_ID", "ID_PATTERN", "KINDS", "MAX_BODY_BYTES", "MAX_DESCRIPTION_CHARS", "MAX_ENTRIES",
           "MAX_TOTAL_BYTES", "OPS", "SAMPLING", "Entry", "Harness", "HarnessError"]

OPS = ("create", "update", "remove")
SAMPLING = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0)}  # what a harness's config.yaml may set: (min, max)
MAX_TOTAL_BYTES = 1024 * 1024  # all rendered files together
MAX_ENTRIES = 200
README = "README.md"  # allowed at the top of a harness folder, ignored

_MD_FOLDERS = {folder: kind for kind, folder in FOLDERS.items()}  # folder of <id>.md files -> kind
_FRONT_KEYS = ("name", "description")
_ROLE_KEYS = ("name", "description", "tools")


class Harness(Mapping[tuple[str, str], Entry]):
    """An immutable, validated set of entries keyed by (kind, id), iterated in KINDS order, then by id.

    Construction checks the harness limits (MAX_ENTRIES, MAX_TOTAL_BYTES) and raises HarnessError("harness", ...).
    """

    def __init__(self, entries: Iterable[Entry] = ()) -> None:
        try:
            self._entries = _collect(entries)
        except _Bad as e:
            raise HarnessError("harness", str(e)) from None

    def __getitem__(self, key: tuple[str, str]) -> Entry:
        return self._entries[key]

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Harness([{', '.join(f'{kind} {ident}' for kind, ident in self._entries)}])"

    def of_kind(self, kind: str) -> tuple[Entry, ...]:
        """The entries of one kind, by id."""
        return tuple(e for (k, _), e in self._entries.items() if k == kind)

    # -- files

    def files(self) -> dict[str, bytes]:
        """The rendered files, paths relative to the harness folder, sorted by path; byte-for-byte deterministic."""
        return {e.path: e.file for e in sorted(self._entries.values(), key=lambda e: e.path)}

    def render(self, path: str | os.PathLike[str]) -> Path:
        """Write files() into `path`, which must be missing or an empty folder; returns it as a Path."""
        root = Path(path)
        if root.exists() and (not root.is_dir() or any(root.iterdir())):
            raise HarnessError(str(root), "render needs a missing or empty folder")
        root.mkdir(parents=True, exist_ok=True)
        for rel, data in self.files().items():
            target = root / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "xb") as f:
                f.write(data)
        return root

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Harness:
        """Parse a harness folder: rules/<id>.md, skills/<id>/SKILL.md, prompts/<id>.md, config.yaml and an
        ignored top-level README.md. Anything else (other files, folders, symlinks) raises HarnessError naming it."""
        root = Path(path)
        if not root.is_dir():
            raise HarnessError(str(root), "not a folder")
        entries = _read_tree(root)
        try:
            return cls(entries)
        except HarnessError as e:
            raise HarnessError(str(root), e.reason) from None

    @classmethod
    def from_files(cls, files: Mapping[str, str]) -> Harness:
        """Parse a harness from its files' texts by path (what GET /reef/harness lists), as from_dir would."""
        entries = []
        for path, text in sorted(files.items()):
            try:
                key = _file_key(path)
                if key is not None:
                    entries.append(_entry(text.replace("\r\n", "\n").replace("\r", "\n"), *key))
            except _Bad as e:
                raise HarnessError(path, str(e)) from None
            except HarnessError as e:
                raise HarnessError(path, e.reason) from None
        return cls(entries)

    # -- JSON

    def to_json(self) -> list[dict[str, Any]]:
        """The entries as [{"id", "kind", "config"}], in iteration order."""
        return [e.to_json() for e in self._entries.values()]

    @classmethod
    def from_json(cls, data: object) -> Harness:
        """The inverse of to_json; raises HarnessError naming "entry <index>"."""
        if not isinstance(data, list):
            raise HarnessError("entries", f"expected a list, got {type(data).__name__}")
        entries = []
        for i, item in enumerate(data):
            where = f"entry {i}"
            if not isinstance(item, Mapping) or set(item) != {"id", "kind", "config"}:
                raise HarnessError(where, 'expected an object with exactly "id", "kind" and "config"')
            try:
                entries.append(Entry(item["id"], item["kind"], item["config"]))
            except HarnessError as e:
                raise HarnessError(f"{where} ({e.where})", e.reason) from None
        return cls(entries)

    # -- mutations

    def apply(self, mutations: Sequence[Mapping[str, Any]]) -> Harness:
        """A new harness with `mutations` applied in order, all or none.

        Each is {"op": create|update|remove, "kind", "id", "config"} ("config" is ignored for remove). create fails
        if the entry exists, update and remove if it does not (an earlier mutation of the batch counts); update
        replaces the entry's whole config, it does not merge. The first bad mutation raises HarnessError naming
        "mutation <index, from 0> (<op> <kind> <id>)"; the result must satisfy every limit.
        """
        if isinstance(mutations, str | bytes) or not isinstance(mutations, Sequence):
            raise HarnessError("mutations", f"expected a list, got {type(mutations).__name__}")
        work = dict(self._entries)
        for i, mutation in enumerate(mutations):
            key, entry = _mutation(i, mutation, work)
            if entry is None:
                del work[key]
            else:
                work[key] = entry
        try:
            return Harness(work.values())
        except HarnessError as e:
            raise HarnessError("mutations (result)", e.reason) from None

    def summary(self, other: Harness) -> str:
        """What changed from `other` to this harness, e.g. "create skill a, b; update rules style; remove config",
        grouped by op (create, update, remove) then kind; "no changes" when equal."""
        groups: dict[tuple[str, str], list[str]] = {}
        for key in sorted(set(self) | set(other), key=_order):
            if key not in other:
                op = "create"
            elif key not in self:
                op = "remove"
            elif self[key] != other[key]:
                op = "update"
            else:
                continue
            groups.setdefault((op, key[0]), []).append(key[1])
        parts = []
        for (op, kind), ids in sorted(groups.items(), key=lambda g: (OPS.index(g[0][0]), KINDS.index(g[0][1]))):
            if kind == "config":
                parts.append(f"{op} config")
                continue
            more = f" (+{len(ids) - 5} more)" if len(ids) > 5 else ""
            parts.append(f"{op} {kind} {', '.join(ids[:5])}{more}")
        return "; ".join(parts) or "no changes"

    def operator_only(self, base: Harness) -> str | None:
        """What this harness changes from `base` that only an operator may change, in one line ("adds extension
        lint, changes the tools list of role reviewer"): any extension added, changed or removed, and any role's
        `tools` given, changed or dropped (declared.operator_only); None when it changes neither. reefd refuses
        a recipe's candidate that does, before its gate; the harness folder an operator gives a scenario is not
        checked."""
        found = []
        for key in sorted(set(self) | set(base), key=_order):
            old, new = base.get(key), self.get(key)
            why = declared.operator_only(*key, old.config if old is not None else None,
                                         new.config if new is not None else None)
            if why is not None:
                found.append(why)
        return ", ".join(found) or None

    # -- prompt

    def sampling(self) -> dict[str, float]:
        """The sampling defaults its config.yaml sets (temperature, top_p): requests served with this harness
        that set none get them, before the scenario's serve: defaults."""
        entry = self.get(("config", CONFIG_ID))
        config = entry.config if entry is not None else {}
        return {k: float(config[k]) for k in SAMPLING if k in config}

    def config_problem(self) -> str | None:
        """Why its config.yaml cannot take effect: a key reefd does not read, or a value out of range."""
        entry = self.get(("config", CONFIG_ID))
        for key, value in (entry.config.items() if entry is not None else ()):
            if key not in SAMPLING:
                return (f"config.yaml: {key!r} is not a setting reefd reads (a harness config sets "
                        f"{' and '.join(SAMPLING)}, the sampling defaults of the requests it serves)")
            low, high = SAMPLING[key]
            if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
                return f"config.yaml: {key}: {value!r} is not a number from {low:g} to {high:g}"
        return None

    def prompt_block(self, inline_skills: bool = False, prompt: str | None = None) -> str:
        """The text reefd adds to an agent's system prompt: the body of the prompt `prompt` names (the scenario's
        `harness.prompt`; none when this harness has no such prompt), then a heading, the rules' bodies and the
        skill catalog ("- <id>: <description>"; with inline_skills, each skill's description and body under its
        own heading). Other prompts and config are not part of it. "" when there is nothing to add."""
        rules, skills = self.of_kind("rules"), self.of_kind("skill")
        applied = self.get(("prompt", prompt)) if prompt is not None else None
        head = [applied.config["body"]] if applied is not None else []
        if not rules and not skills:
            return "\n\n".join(head) + "\n" if head else ""
        parts = [*head, "# Harness"]
        if rules:
            parts += ["## Rules", *(e.config["body"] for e in rules)]
        if skills and inline_skills:
            parts.append("## Skills")
            for e in skills:
                parts += [f"### {e.id}", e.config["description"], e.config["body"]]
        elif skills:
            parts += ["## Skills", "\n".join(f"- {e.id}: {e.config['description']}" for e in skills)]
        return "\n\n".join(parts) + "\n"


def _order(key: tuple[str, str]) -> tuple[int, str]:
    return KINDS.index(key[0]), key[1]


def _collect(entries: Iterable[Entry]) -> dict[tuple[str, str], Entry]:
    found: dict[tuple[str, str], Entry] = {}
    for entry in entries:
        if not isinstance(entry, Entry):
            raise _Bad(f"expected an Entry, got {type(entry).__name__}")
        key = (entry.kind, entry.id)
        if key in found:
            raise _Bad(f"duplicate {entry.kind} {entry.id}")
        found[key] = entry
    if len(found) > MAX_ENTRIES:
        raise _Bad(f"{len(found)} entries (limit {MAX_ENTRIES})")
    total = sum(len(e.file) for e in found.values())
    if total > MAX_TOTAL_BYTES:
        raise _Bad(f"rendered files total {total} bytes (limit {MAX_TOTAL_BYTES})")
    return {key: found[key] for key in sorted(found, key=_order)}


def _mutation(i: int, mutation: object, work: Mapping[tuple[str, str], Entry]) -> tuple[tuple[str, str], Entry | None]:
    """Check mutation `i` against the running result `work`: the key it touches and its new entry (None: remove)."""
    if not isinstance(mutation, Mapping):
        raise HarnessError(f"mutation {i}", f"expected an object, got {type(mutation).__name__}")
    where = f"mutation {i} ({' '.join(_word(mutation[f]) for f in ('op', 'kind', 'id') if f in mutation)})"
    op, kind, ident = mutation.get("op"), mutation.get("kind"), mutation.get("id")
    try:
        for name in mutation:
            if name not in ("op", "kind", "id", "config"):
                raise _Bad(f"unknown field {_word(name)}")
        for name in ("op", "kind", "id"):
            if name not in mutation:
                raise _Bad(f"missing {name}")
        if op not in OPS:
            raise _Bad(f"unknown op {_word(op)} (expected {'|'.join(OPS)})")
        if kind not in KINDS:
            raise _Bad(f"unknown kind {_word(kind)} (expected {'|'.join(KINDS)})")
        key = (str(kind), _check_id(ident))
        if op == "create" and key in work:
            raise _Bad(f"{kind} {ident} already exists")
        if op != "create" and key not in work:
            raise _Bad(f"{kind} {ident} does not exist")
        if op == "remove":
            return key, None
        if "config" not in mutation:
            raise _Bad(f"{op} needs a config")
    except _Bad as e:
        raise HarnessError(where, str(e)) from None
    try:
        return key, Entry(key[1], key[0], mutation["config"])
    except HarnessError as e:
        raise HarnessError(where, e.reason) from None


# -- reading a folder


def _read_tree(root: Path) -> list[Entry]:
    entries = []
    for item in _list(root, root):
        rel = item.name
        if rel == README and item.is_file(follow_symlinks=False):
            continue
        if rel == "config.yaml" and item.is_file(follow_symlinks=False):
            entries.append(_parse(root, rel, "config", CONFIG_ID))
        elif rel in _MD_FOLDERS and item.is_dir(follow_symlinks=False):
            for child in _list(root, root / rel):
                name = f"{rel}/{child.name}"
                ident = child.name.removesuffix(".md")
                if not child.is_file(follow_symlinks=False) or ident == child.name or not _ID_RE.fullmatch(ident):
                    raise HarnessError(_where(root, name), f"unexpected; {rel}/ holds <id>.md files, id {ID_PATTERN}")
                entries.append(_parse(root, name, _MD_FOLDERS[rel], ident))
        elif rel == "extensions" and item.is_dir(follow_symlinks=False):
            for child in _list(root, root / rel):
                name = f"{rel}/{child.name}"
                ident = child.name.removesuffix(".yaml")
                if not child.is_file(follow_symlinks=False) or ident == child.name or not _ID_RE.fullmatch(ident):
                    raise HarnessError(_where(root, name), f"unexpected; extensions/ holds <id>.yaml files, id "
                                       f"{ID_PATTERN}")
                entries.append(_parse(root, name, "extension", ident))
        elif rel == "skills" and item.is_dir(follow_symlinks=False):
            for child in _list(root, root / rel):
                name = f"{rel}/{child.name}"
                if not child.is_dir(follow_symlinks=False) or not _ID_RE.fullmatch(child.name):
                    raise HarnessError(_where(root, name), f"unexpected; skills/ holds <id>/ folders, id {ID_PATTERN}")
                inside = _list(root, root / name)
                for extra in inside:
                    if extra.name != _SKILL_FILE or not extra.is_file(follow_symlinks=False):
                        raise HarnessError(_where(root, f"{name}/{extra.name}"), f"unexpected; only {_SKILL_FILE}")
                if not inside:
                    raise HarnessError(_where(root, name), f"missing {_SKILL_FILE}")
                entries.append(_parse(root, f"{name}/{_SKILL_FILE}", "skill", child.name))
        else:
            raise HarnessError(_where(root, rel), "unexpected; a harness holds rules/, skills/, prompts/, roles/, "
                               "extensions/, config.yaml")
    return entries


def _list(root: Path, folder: Path) -> list[os.DirEntry[str]]:
    """The folder's items by name; symlinks raise."""
    with os.scandir(folder) as it:
        items = sorted(it, key=lambda d: d.name)
    for item in items:
        if item.is_symlink():
            raise HarnessError(_where(root, os.path.relpath(item.path, root)), "symlinks are not allowed")
    return items


def _where(root: Path, rel: str) -> str:
    text = str(root / rel)
    return text if text.isprintable() else repr(text)


def _parse(root: Path, rel: str, kind: str, ident: str) -> Entry:
    try:
        return _entry(_read(root / rel), kind, ident)
    except _Bad as e:
        raise HarnessError(_where(root, rel), str(e)) from None
    except HarnessError as e:
        raise HarnessError(_where(root, rel), e.reason) from None


def _entry(text: str, kind: str, ident: str) -> Entry:
    """The entry a file's text holds (raises _Bad or HarnessError)."""
    if kind in ("config", "extension"):
        config = _yaml(text)
        if not isinstance(config, dict):
            raise _Bad(f"must be a YAML mapping, got {type(config).__name__}")
    elif kind == "skill":
        config = _skill(text, ident)
    elif kind == "role":
        config = _front(text, ident, "file", _ROLE_KEYS, required=_FRONT_KEYS)
    else:
        config = {"body": text}
    return Entry(ident, kind, config)


def _file_key(path: str) -> tuple[str, str] | None:
    """(kind, id) of a harness file by its path in the layout; None for the ignored README.md; _Bad otherwise."""
    parts = path.split("/")
    if parts == ["config.yaml"]:
        return "config", CONFIG_ID
    if parts == [README]:
        return None
    if len(parts) == 2 and parts[0] in _MD_FOLDERS and parts[1].endswith(".md"):
        return _MD_FOLDERS[parts[0]], parts[1][:-3]
    if len(parts) == 2 and parts[0] == "extensions" and parts[1].endswith(".yaml"):
        return "extension", parts[1][:-5]
    if len(parts) == 3 and parts[0] == "skills" and parts[2] == _SKILL_FILE:
        return "skill", parts[1]
    raise _Bad("unexpected; a harness holds rules/, skills/, prompts/, roles/, extensions/, config.yaml")


def _read(path: Path) -> str:
    size = path.lstat().st_size
    if size > MAX_TOTAL_BYTES:
        raise _Bad(f"file is {size} bytes (limit {MAX_TOTAL_BYTES})")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Bad(f"not valid UTF-8 at byte {e.start}") from None
    if "\x00" in text:
        raise _Bad("contains a NUL character")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _yaml(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise _Bad(f"invalid YAML: {' '.join(str(e).split())}") from None
    except RecursionError:
        raise _Bad("invalid YAML: nested too deep") from None


def _skill(text: str, folder: str) -> dict[str, Any]:
    """{"description", "body"} of a SKILL.md: "---" line, YAML front matter {name, description}, "---" line, body."""
    return _front(text, folder, "folder", _FRONT_KEYS)


def _front(text: str, ident: str, named_by: str, keys: tuple[str, ...], required: tuple[str, ...] | None = None
           ) -> dict[str, Any]:
    """The config of a file with YAML front matter: `keys` (`required` of them: all by default; `name` must be
    the entry's id, which its `named_by`, its file or its folder, gives), the rest as its body."""
    lines = text.split("\n")
    if lines[0] != "---":
        raise _Bad("must start with a '---' line (YAML front matter)")
    if "---" not in lines[1:]:
        raise _Bad("front matter has no closing '---' line")
    end = lines.index("---", 1)
    meta = _yaml("\n".join(lines[1:end]))
    if not isinstance(meta, dict):
        raise _Bad("front matter must be a YAML mapping")
    for key in meta:
        if key not in keys:
            raise _Bad(f"unknown front matter key {_word(key)} (expected {', '.join(keys)})")
    _exact_keys({k: v for k, v in meta.items() if k in (required or keys)}, required or keys, "front matter")
    if meta["name"] != ident:
        raise _Bad(f"name {_word(meta['name'])} does not match its {named_by} {ident}")
    return {**{k: v for k, v in meta.items() if k != "name"}, "body": "\n".join(lines[end + 1 :])}
