"""The harness installer: one self-contained POSIX sh script per coding agent, with the harness files inline.

Owns where each agent reads its instructions and skills, how its wrapper points it at reefd, and the marked
blocks, manifest and releases folder that keep a user's own files untouched; knows nothing about HTTP, the release
chain or how harnesses are made (reefd/api/harness.py serves the script, reefd/harness.py renders the files).
The shell is one artifact, so this module runs past the usual ~400 lines: splitting it would split the script.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

ADAPTERS = ("claude", "codex", "opencode", "generic")

_SCENARIO_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # reefd's scenario names
_RELEASE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_PART = r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}"  # no leading dot: no "..", no hidden files
_PATH_RE = re.compile(rf"{_PART}(?:/{_PART}){{0,7}}")
_SHA_RE = re.compile(r"[0-9a-f]{64}")
_URL_RE = re.compile(r"https?://[A-Za-z0-9.-]+(?::[0-9]{1,5})?(?:/[A-Za-z0-9._~!$&()*+,;=:@%/-]*)?")
_SKILL_NAME_RE = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")  # the Agent Skills standard's names


@dataclass(frozen=True)
class _Agent:
    title: str
    instructions: str  # sh: the user-level instructions file Reef's block goes in
    skills: str  # sh: the user-level skills folder
    launch: str  # sh: the body of launch(), which runs the agent ("$@": its arguments; $SESSION: this run)


_AGENTS = {
    "claude": _Agent(  # code.claude.com memory + skills docs: ~/.claude/CLAUDE.md, ~/.claude/skills/<name>/SKILL.md
        "Claude Code", '"${CLAUDE_CONFIG_DIR:-$HOME/.claude}/CLAUDE.md"',
        '"${CLAUDE_CONFIG_DIR:-$HOME/.claude}/skills"',
        """  unset ANTHROPIC_API_KEY  # the user's own key must not go to reefd
  ANTHROPIC_BASE_URL=$BASE_URL
  ANTHROPIC_AUTH_TOKEN=$REEF_TOKEN
  ANTHROPIC_CUSTOM_HEADERS="x-reef-scenario: $SCENARIO
x-reef-session: $SESSION"
  export ANTHROPIC_BASE_URL ANTHROPIC_AUTH_TOKEN ANTHROPIC_CUSTOM_HEADERS
  exec "${REEF_AGENT_BIN:-claude}" "$@"
"""),
    "codex": _Agent(  # developers.openai.com/codex: $CODEX_HOME/AGENTS.md (default ~/.codex); $HOME/.agents/skills
        "Codex CLI", '"${CODEX_HOME:-$HOME/.codex}/AGENTS.md"', '"$HOME/.agents/skills"',
        """  export REEF_TOKEN  # read through env_key; Codex ignores OPENAI_BASE_URL, so the provider comes by -c
  exec "${REEF_AGENT_BIN:-codex}" -c 'model_provider="reef"' -c "model=\\"$SCENARIO\\"" \\
    -c 'model_providers.reef.name="Reef"' -c "model_providers.reef.base_url=\\"$BASE_URL/v1\\"" \\
    -c 'model_providers.reef.wire_api="responses"' -c 'model_providers.reef.env_key="REEF_TOKEN"' \\
    -c "model_providers.reef.http_headers={ \\"x-reef-scenario\\" = \\"$SCENARIO\\", \\
\\"x-reef-session\\" = \\"$SESSION\\" }" \\
    "$@"
"""),
    "opencode": _Agent(  # opencode.ai/docs rules + skills: ~/.config/opencode/AGENTS.md, ~/.config/opencode/skills
        "opencode", '"${XDG_CONFIG_HOME:-$HOME/.config}/opencode/AGENTS.md"',
        '"${XDG_CONFIG_HOME:-$HOME/.config}/opencode/skills"',
        """  OPENCODE_CONFIG=$ADATA/opencode.json  # merged over the user's own config; the token stays {env:REEF_TOKEN}
  REEF_SESSION=$SESSION
  export OPENCODE_CONFIG REEF_SESSION REEF_TOKEN
  exec "${REEF_AGENT_BIN:-opencode}" "$@"
"""),
    "generic": _Agent(
        "any OpenAI- or Anthropic-SDK agent", '"$ADATA/AGENTS.md"', '"$ADATA/harness/skills"',
        """  if [ $# -eq 0 ] && [ -n "${REEF_AGENT_BIN:-}" ]; then set -- "$REEF_AGENT_BIN"; fi
  [ $# -gt 0 ] || die "usage: $PROG COMMAND [ARGS...] (runs COMMAND pointed at reefd)"
  OPENAI_BASE_URL=$BASE_URL/scenarios/$SCENARIO/v1  # the path names the scenario: SDKs send no custom header
  OPENAI_API_KEY=$REEF_TOKEN
  ANTHROPIC_BASE_URL=$BASE_URL/scenarios/$SCENARIO
  ANTHROPIC_AUTH_TOKEN=$REEF_TOKEN
  REEF_SCENARIO=$SCENARIO REEF_SESSION=$SESSION REEF_URL=$BASE_URL
  REEF_HARNESS_DIR=$ADATA/harness REEF_INSTRUCTIONS=$ADATA/AGENTS.md
  export OPENAI_BASE_URL OPENAI_API_KEY ANTHROPIC_BASE_URL ANTHROPIC_AUTH_TOKEN REEF_SCENARIO REEF_SESSION \\
    REEF_URL REEF_HARNESS_DIR REEF_INSTRUCTIONS
  exec "$@"
"""),
}


def installer(adapter: str, scenario: str, base_url: str, harness: dict[str, Any]) -> str:
    """The sh installer for `adapter` with `harness` (GET /reef/harness's JSON) inline; ValueError on bad input.

    The script writes only under $HOME, checks every file's sha256 before anything is moved into place, keeps
    each release under ~/.local/share/reef/<scenario>/<adapter>/releases/ and installs ~/.local/bin/reef-<scenario>,
    the wrapper that starts the agent pointed at reefd. No token is ever written: it comes from $REEF_TOKEN.
    """
    if adapter not in _AGENTS:
        raise ValueError(f"unknown adapter {adapter!r}; known adapters: {', '.join(ADAPTERS)}")
    if not _SCENARIO_RE.fullmatch(scenario) or ".." in scenario:
        raise ValueError(f"invalid scenario name {scenario!r}")
    url = base_url.rstrip("/")
    if not _URL_RE.fullmatch(url):
        raise ValueError(f"invalid base URL {base_url!r}: want http(s)://host[:port][/path]")
    release = harness.get("release")
    if not isinstance(release, str) or not _RELEASE_RE.fullmatch(release):
        raise ValueError(f"invalid harness release id {release!r}")
    files = _files(harness)
    agent = _AGENTS[adapter]
    consts = _consts(scenario=scenario, adapter=adapter, base_url=url)
    wrapper = "\n".join([_WRAPPER_HEAD.format(scenario=scenario, title=agent.title), consts, _paths(agent),
                         _COMMON, _WRAPPER, "launch() {\n" + agent.launch + "}\n", 'main "$@"\n'])
    staged: list[tuple[str, str]] = [(f"release/harness/{path}", text) for path, _, text in files]
    staged.append(("release/instructions.md", _instructions(files)))
    staged.append(("wrapper", wrapper))
    if adapter == "opencode":
        staged.append(("opencode.json", _opencode_json(scenario, url)))
    checks = {f"release/harness/{path}": sha for path, sha, _ in files}
    delim = _delimiter([text for _, text in staged])
    unpack = [_unpack(name, checks.get(name) or _sha(text), text, delim) for name, text in staged]
    notes = [f'  say "note: skill {p.split("/")[1]!r} is not a lowercase-hyphenated name; agents may skip it"'
             for p, _, _ in files if p.startswith("skills/") and not _SKILL_NAME_RE.fullmatch(p.split("/")[1])]
    return "\n".join([
        _INSTALLER_HEAD.format(scenario=scenario, release=release, title=agent.title, adapter=adapter),
        consts + f"RELEASE={_q(release)}\n", _paths(agent), _COMMON, _INSTALLER,
        "stage_files() {\n" + "".join(unpack) + "}\n",
        "notes() {\n" + "".join(n + "\n" for n in notes) + "  :\n}\n",
        'main "$@"\n'])


def _files(harness: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(path, sha256, content) of each harness file, paths checked so none can leave the harness folder."""
    out = []
    for f in harness.get("files") or []:
        path, sha, content = f.get("path"), f.get("sha256"), f.get("content")
        if not isinstance(path, str) or not _PATH_RE.fullmatch(path):
            raise ValueError(f"invalid harness file path {path!r}")
        if not isinstance(sha, str) or not _SHA_RE.fullmatch(sha) or not isinstance(content, str):
            raise ValueError(f"harness file {path}: needs a hex sha256 and a text content")
        out.append((path, sha, content))
    return sorted(out)


def _instructions(files: list[tuple[str, str, str]]) -> str:
    """What goes inside the marked block: the rules, then the prompts, a blank line between files.

    A line that looks like a Reef marker gets a leading space (Markdown still reads it as a comment), so a block
    always ends at its own end marker.
    """
    parts = [t if t.endswith("\n") else t + "\n" for folder in ("rules/", "prompts/")
             for p, _, t in files if p.startswith(folder) and p.endswith(".md") and "/" not in p[len(folder):]]
    text = "\n".join(p for p in parts if p.strip())
    return re.sub(r"(?m)^(?=<!-- reef:)", " ", text)


def _opencode_json(scenario: str, url: str) -> str:
    provider = {"npm": "@ai-sdk/openai-compatible", "name": "Reef",
                "options": {"baseURL": f"{url}/v1", "apiKey": "{env:REEF_TOKEN}",
                            "headers": {"x-reef-scenario": scenario, "x-reef-session": "{env:REEF_SESSION}"}},
                "models": {scenario: {}}}
    config = {"$schema": "https://opencode.ai/config.json", "provider": {"reef": provider},
              "model": f"reef/{scenario}", "small_model": f"reef/{scenario}"}
    return json.dumps(config, indent=2) + "\n"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _q(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def _consts(**values: str) -> str:
    return "".join(f"{k.upper()}={_q(v)}\n" for k, v in values.items()) + 'PROG="reef-$SCENARIO"\n'


def _paths(agent: _Agent) -> str:
    return f"""paths() {{  # where this agent reads its files, and where Reef keeps its own
  DATA=$HOME/.local/share/reef/$SCENARIO BIN=$HOME/.local/bin
  ADATA=$DATA/$ADAPTER LEDGER=$HOME/.local/share/reef/created
  INSTR_DEFAULT={agent.instructions} SKILLS_DEFAULT={agent.skills}
}}
"""


def _delimiter(texts: list[str]) -> str:
    """A heredoc delimiter that is no line of any text; quoted (<<'DELIM'), it keeps the shell from expanding."""
    lines = {line for t in texts for line in t.split("\n")}
    seed = _sha("".join(texts))[:16].upper()
    n = 0
    while (delim := f"REEF_EOF_{seed}_{n}") in lines:
        n += 1
    return delim


def _unpack(name: str, sha: str, text: str, delim: str) -> str:
    """A heredoc with the exact text: a text without a final newline gets one, which `unpack ... 1` drops."""
    strip = "0" if text.endswith("\n") or not text else "1"
    body = text if strip == "0" else text + "\n"
    return f"  unpack {_q(name)} {sha} {strip} <<'{delim}'\n{body}{delim}\n"


_INSTALLER_HEAD = """#!/bin/sh
# Reef harness installer: scenario {scenario}, release {release}, for {title} ({adapter}).
# Made by reefd for GET /reef/harness/install; read it, then run it with sh. It writes only under $HOME:
#  - Reef's part of the agent's instructions file, between <!-- reef:{scenario} begin ... --> and
#    <!-- reef:{scenario} end --> (the rest of the file stays yours), and Reef's skills, listed in a manifest;
#  - ~/.local/share/reef/{scenario}/{adapter}/ (this release and earlier ones, to roll back) and
#    ~/.local/bin/reef-{scenario}, which starts the agent pointed at reefd.
# Every file is checked against its sha256 before anything is moved into place. No token is written anywhere:
# the wrapper reads $REEF_TOKEN when it runs. A truncated download does nothing: main runs on the last line.
set -eu
"""

_WRAPPER_HEAD = """#!/bin/sh
# reef-{scenario}: starts {title} pointed at reefd for scenario {scenario}, with Reef's harness installed.
#   reef-{scenario} [AGENT ARGS...]       start (first asks reefd whether a newer harness exists)
#   reef-{scenario} update                install reefd's current harness (the previous one is kept)
#   reef-{scenario} rollback              go back to the previously installed harness
#   reef-{scenario} report --score S [--feedback TEXT]   report on the turns of the last session
#   reef-{scenario} uninstall             remove Reef's blocks, skills and data (every agent's, for
#                                      scenario {scenario}) and this wrapper
#   reef-{scenario} -- ARGS...            start, even when ARGS begins with a word above
# One wrapper per scenario: installing another agent for it makes this file start that agent. The token is read
# from $REEF_TOKEN at run time and never written down. Written by Reef's installer.
set -eu
"""

# Shared by the installer and the wrapper (rollback and uninstall run the same code the installer ran).
_COMMON = r"""say() { printf '%s\n' "$PROG: $*" >&2; }
die() { say "$*"; exit 1; }

sha256_of() {
  if command -v sha256sum >/dev/null 2>&1; then set -- "$(sha256sum < "$1")"; else set -- "$(shasum -a 256 < "$1")"; fi
  printf '%s\n' "${1%% *}"
}

mkdirs() {  # mkdir -p that adds the folders it makes to NEW (what this run created)
  md_d=$1 md_new=
  while [ ! -d "$md_d" ]; do md_new="$md_new$md_d
"; md_d=$(dirname "$md_d"); done
  if [ -n "$md_new" ]; then mkdir -p "$1"; NEW="$NEW$md_new"; fi
}

sweep() {  # removes the paths listed on stdin that are empty: files, then folders, deepest first
  sort -r -u | while IFS= read -r sw_p; do
    if [ -f "$sw_p" ] && [ ! -s "$sw_p" ]; then rm -f "$sw_p"
    elif [ -d "$sw_p" ]; then rmdir "$sw_p" 2>/dev/null || true; fi
  done
}

ledger_add() {  # the ledger lists what Reef created and still exists: the last uninstall removes it when empty
  { cat "$LEDGER" 2>/dev/null || true; printf '%s' "$NEW"; } | sort -u |
    while IFS= read -r la_p; do [ ! -e "$la_p" ] || echo "$la_p"; done > "$WORK/ledger"
  put_file "$WORK/ledger" "$LEDGER"
  NEW=''
}

mget() {  # mget KEY MANIFEST: the first value of KEY
  [ -f "$2" ] || return 0
  sed -n "s|^$1 ||p" "$2" | head -n 1
}

put_file() {  # put_file NEW DEST: DEST gets NEW's bytes unless equal; an existing DEST keeps its inode and mode
  if [ -f "$2" ] && cmp -s "$1" "$2"; then rm -f "$1"
  elif [ -e "$2" ]; then cat "$1" > "$2"; rm -f "$1"
  else mv "$1" "$2"; fi
}

splice() {  # splice FILE MODE [BODY] [DROPNL]: FILE's text with Reef's block put (from BODY), removed or checked
  sp_nl=1
  if [ -s "$1" ] && [ -n "$(tail -c 1 "$1")" ]; then sp_nl=0; fi
  sp_in=$1; [ -f "$sp_in" ] || sp_in=/dev/null
  SP_MODE=$2 SP_BODY=${3:-/dev/null} SP_DROPNL=${4:-0} SP_NL=$sp_nl \
  SP_BEGIN="<!-- reef:$SCENARIO begin " SP_HEAD="<!-- reef:$SCENARIO begin release=${REL_ID:-} -->" \
  SP_END="<!-- reef:$SCENARIO end -->" awk '
    function put(  l) { out[++m] = ENVIRON["SP_HEAD"]; while ((getline l < ENVIRON["SP_BODY"]) > 0) out[++m] = l
                        out[++m] = ENVIRON["SP_END"] }
    BEGIN { mode = ENVIRON["SP_MODE"]; begin = ENVIRON["SP_BEGIN"]; end = ENVIRON["SP_END"] }
    state == 1 { if ($0 == end) { state = 2; atend = 1 }; next }
    index($0, begin) == 1 { state = 1; if (!found && mode == "put") put(); found = 1; next }
    { out[++m] = $0; atend = 0 }
    END {
      if (state == 1) exit 3
      if (mode == "check") exit (found ? 0 : 1)
      if (!found && mode == "put") { put(); atend = 1 }
      for (k = 1; k <= m; k++) printf "%s%s", out[k], (k < m ? "\n" : "")
      if (m > 0 && (atend ? !(mode == "remove" && ENVIRON["SP_DROPNL"] == 1) : ENVIRON["SP_NL"] == 1)) printf "\n"
    }' "$sp_in"
}

block_state() {  # block_state FILE: "present", "absent" or "broken" (a begin marker without its end)
  if splice "$1" check; then echo present; elif [ $? = 1 ]; then echo absent; else echo broken; fi
}

remove_block() {  # remove_block FILE DROPNL
  [ -f "$1" ] || return 0
  [ "$(block_state "$1")" = present ] || return 0
  splice "$1" remove /dev/null "$2" > "$WORK/text"
  put_file "$WORK/text" "$1"
}

prune() {  # prune FOLDER: removes FOLDER and the folders in it that are empty (a user's files keep theirs)
  if [ -d "$1" ]; then find "$1" -depth -type d -exec rmdir {} \; 2>/dev/null || true; fi
}

skill_ids() {  # the skills of release folder $1, one id a line
  for si_d in "$1"/harness/skills/*/; do [ -d "$si_d" ] && basename "$si_d"; done; return 0
}

check_release() {  # check_release FOLDER: fails, changing nothing, when installing FOLDER would clobber anything
  [ "$ADAPTER" != generic ] || return 0
  cr_old=$ADATA/manifest INSTR=$(mget instructions "$ADATA/manifest") SKILLS=$(mget skills "$ADATA/manifest")
  INSTR=${INSTR:-$INSTR_DEFAULT} SKILLS=${SKILLS:-$SKILLS_DEFAULT}
  if [ "$(block_state "$INSTR")" = broken ]; then
    die "$INSTR has a '<!-- reef:$SCENARIO begin' line without its '<!-- reef:$SCENARIO end -->' line;" \
      "fix or remove it, then install again (nothing was changed)"
  fi
  for cr_id in $(skill_ids "$1"); do
    cr_t=$SKILLS/$cr_id
    if { [ -e "$cr_t" ] || [ -L "$cr_t" ]; } && ! grep -qFx "skill $cr_t" "$cr_old" 2>/dev/null; then
      cr_by=$(grep -lFx "skill $cr_t" "$HOME"/.local/share/reef/*/*/manifest 2>/dev/null | head -n 1) || true
      [ -z "$cr_by" ] || cr_by=" (Reef's scenario $(basename "$(dirname "$(dirname "$cr_by")")") installed it)"
      die "$cr_t already exists and is not this harness's skill$cr_by: Reef does not overwrite it." \
        "Rename or remove it, then install again (nothing was changed)"
    fi
  done
  [ -f "$cr_old" ] || return 0
  sed -n 's/^file //p' "$cr_old" > "$WORK/owned"
  while IFS= read -r cr_line; do  # a file of Reef's that the user changed, and that this release would change
    cr_f=${cr_line#* } cr_new=$1/harness/skills/${cr_line#* "$SKILLS"/}
    if [ -f "$cr_f" ] && [ -f "$cr_new" ] && ! cmp -s "$cr_f" "$cr_new" &&
      [ "$(sha256_of "$cr_f")" != "${cr_line%% *}" ]; then
      die "$cr_f was changed after Reef installed it: Reef does not overwrite your changes." \
        "Save them elsewhere and undo them or delete the file, then install again (nothing was changed)"
    fi
  done < "$WORK/owned"
}

forget() {  # forget MANIFEST [KEEP]: deletes the files MANIFEST lists that KEEP does not, unless the user changed them
  sed -n 's/^file //p' "$1" > "$WORK/owned"
  while IFS= read -r fg_line; do
    fg_f=${fg_line#* }
    if [ ! -f "$fg_f" ] || { [ -n "${2:-}" ] && grep -qFx "$fg_f" "$2"; }; then continue; fi
    if [ "$(sha256_of "$fg_f")" = "${fg_line%% *}" ]; then rm -f "$fg_f"
    else say "kept $fg_f: it was changed after Reef installed it, so it is yours now"; fi
  done < "$WORK/owned"
}

apply_release() {  # apply_release ID: installs releases/ID (its block and skills) and writes the manifest
  REL_ID=$1 ar_rel=$ADATA/releases/$1 ar_old=$ADATA/manifest ar_new=$WORK/manifest
  check_release "$ar_rel"
  if [ "$ADAPTER" = generic ]; then
    if ! diff -r "$ar_rel/harness" "$ADATA/harness" >/dev/null 2>&1; then
      rm -rf "$ADATA/harness.new"; cp -R "$ar_rel/harness" "$ADATA/harness.new"
      rm -rf "$ADATA/harness"; mv "$ADATA/harness.new" "$ADATA/harness"
    fi
    cp "$ar_rel/instructions.md" "$WORK/text"; put_file "$WORK/text" "$ADATA/AGENTS.md"
    { echo "release $1"; } > "$ar_new"
  else
    ar_dropnl=$(mget block-newline "$ar_old")
    if [ -s "$ar_rel/instructions.md" ]; then
      if [ "$(block_state "$INSTR")" = absent ]; then  # Reef's first block here: remember how the file ended
        ar_dropnl=0
        if [ -s "$INSTR" ] && [ -n "$(tail -c 1 "$INSTR")" ]; then ar_dropnl=1; fi
        if [ ! -e "$INSTR" ]; then NEW="$NEW$INSTR
"; fi
      fi
      mkdirs "$(dirname "$INSTR")"
      splice "$INSTR" put "$ar_rel/instructions.md" > "$WORK/text"
      put_file "$WORK/text" "$INSTR"
    else
      remove_block "$INSTR" "${ar_dropnl:-0}"; ar_dropnl=0
    fi
    printf 'release %s\ninstructions %s\nskills %s\nblock-newline %s\n' "$1" "$INSTR" "$SKILLS" "${ar_dropnl:-0}" \
      > "$ar_new"
    : > "$WORK/paths"
    for ar_id in $(skill_ids "$ar_rel"); do
      mkdirs "$SKILLS/$ar_id"
      echo "skill $SKILLS/$ar_id" >> "$ar_new"
      (cd "$ar_rel/harness/skills/$ar_id" && find . -type f) | sort > "$WORK/list"
      while IFS= read -r ar_f; do
        ar_f=${ar_f#./} ar_to=$SKILLS/$ar_id/${ar_f#./}
        mkdirs "$(dirname "$ar_to")"
        cp "$ar_rel/harness/skills/$ar_id/$ar_f" "$WORK/text"; put_file "$WORK/text" "$ar_to"
        echo "file $(sha256_of "$ar_rel/harness/skills/$ar_id/$ar_f") $ar_to" >> "$ar_new"
        echo "$ar_to" >> "$WORK/paths"
      done < "$WORK/list"
    done
    if [ -f "$ar_old" ]; then  # what the last release installed and this one does not
      forget "$ar_old" "$WORK/paths"
      sed -n 's/^skill //p' "$ar_old" | while IFS= read -r ar_d; do
        grep -qFx "skill $ar_d" "$ar_new" || prune "$ar_d"; done
    fi
  fi
  put_file "$ar_new" "$ar_old"
  ledger_add
}

history_add() {  # the installed releases, oldest first; the last line is the one installed now
  [ "$(tail -n 1 "$ADATA/history" 2>/dev/null || true)" = "$1" ] || echo "$1" >> "$ADATA/history"
}
"""

_INSTALLER = r"""unpack() {  # unpack NAME SHA256 DROPNL <<TEXT: writes $STAGE/NAME, then checks it against SHA256
  mkdir -p "$(dirname "$STAGE/$1")"
  if [ "$3" = 1 ]; then un_text=$(cat); printf '%s' "$un_text" > "$STAGE/$1"; else cat > "$STAGE/$1"; fi
  [ "$(sha256_of "$STAGE/$1")" = "$2" ] ||
    die "${1#release/} does not match its sha256 (a damaged download?); nothing was installed." \
      "Download the installer again."
}

on_exit() {  # a failed install leaves nothing behind: the stage goes, and so do the folders it made
  [ -z "$STAGE" ] || rm -rf "$STAGE"
  if [ "$1" != 0 ] && [ -z "${DONE:-}" ]; then printf '%s' "$NEW" | sweep; fi
}

main() {
  umask 022
  { [ -n "${HOME:-}" ] && [ -d "$HOME" ]; } || die "HOME is not set to a folder"
  command -v sha256sum >/dev/null 2>&1 || command -v shasum >/dev/null 2>&1 || die "sha256sum or shasum is needed"
  paths
  NEW='' DONE='' STAGE='' was=$(tail -n 1 "$ADATA/history" 2>/dev/null || true)
  trap 'on_exit $?' EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  mkdirs "$ADATA/releases"
  mkdirs "$BIN"
  STAGE=$(mktemp -d "$ADATA/.stage.XXXXXX")
  WORK=$STAGE
  stage_files
  check_release "$STAGE/release"
  if [ -e "$BIN/$PROG" ] && ! head -n 2 "$BIN/$PROG" | grep -q "^# $PROG: starts "; then
    die "$BIN/$PROG exists and is not Reef's wrapper: Reef does not overwrite it. Move it away, then install again"
  fi
  kept=$ADATA/releases/$RELEASE
  if ! diff -r "$STAGE/release" "$kept" >/dev/null 2>&1; then
    rm -rf "$kept.old"
    if [ -d "$kept" ]; then mv "$kept" "$kept.old"; fi
    mv "$STAGE/release" "$kept"
    rm -rf "$kept.old"
  fi
  apply_release "$RELEASE"
  if [ -f "$STAGE/opencode.json" ]; then put_file "$STAGE/opencode.json" "$ADATA/opencode.json"; fi
  if ! cmp -s "$STAGE/wrapper" "$BIN/$PROG"; then  # a new file, never rewritten in place: it may be running
    chmod 755 "$STAGE/wrapper"
    mv "$STAGE/wrapper" "$BIN/$PROG"
  fi
  history_add "$RELEASE"
  DONE=1
  notes
  if [ "$was" = "$RELEASE" ]; then
    echo "Reef harness $RELEASE of scenario $SCENARIO was already installed for $ADAPTER; its files are checked."
  else
    printf 'Installed Reef harness %s of scenario %s for %s%s.\n' "$RELEASE" "$SCENARIO" "$ADAPTER" \
      "${was:+ (was $was; $PROG rollback goes back)}"
  fi
  if [ "$ADAPTER" = generic ]; then echo "  files: $ADATA/harness, instructions: $ADATA/AGENTS.md"
  else
    echo "  instructions: $INSTR (between the reef:$SCENARIO markers)"
    for id in $(skill_ids "$ADATA/releases/$RELEASE"); do echo "  skill: $SKILLS/$id"; done
  fi
  if [ "$ADAPTER" = codex ] && [ -s "$(dirname "$INSTR")/AGENTS.override.md" ]; then
    say "note: Codex reads $(dirname "$INSTR")/AGENTS.override.md instead of AGENTS.md while it is there"
  fi
  echo "Start it with: $PROG  (it talks to reefd at $BASE_URL with the token in \$REEF_TOKEN)"
  case ":${PATH:-}:" in *":$BIN:"*) ;; *) say "note: $BIN is not on your PATH; add it, or run $BIN/$PROG" ;; esac
}
"""

_WRAPPER = r"""json_flat() {  # json_flat "PATHS": JSON on stdin -> "PATH<TAB>VALUE" lines for PATHS like ".data[].id"
  JF_WANT=" $1 " LC_ALL=C awk '
    function hex(h,  k, v, c) {
      v = 0
      for (k = 1; k <= 4; k++) {
        c = index("0123456789abcdef", tolower(substr(h, k, 1))); if (!c) return -1; v = v * 16 + c - 1
      }
      return v
    }
    function utf8(c) {
      if (c < 128) return sprintf("%c", c)
      if (c < 2048) return sprintf("%c%c", 192 + int(c / 64), 128 + c % 64)
      if (c < 65536) return sprintf("%c%c%c", 224 + int(c / 4096), 128 + int(c / 64) % 64, 128 + c % 64)
      return sprintf("%c%c%c%c", 240 + int(c / 262144), 128 + int(c / 4096) % 64, 128 + int(c / 64) % 64, 128 + c % 64)
    }
    function text(s,  o, i, c, e, u, lo) {  # unescaped, cut at its first line break, without control characters
      o = ""; i = 1
      while (i <= length(s)) {
        c = substr(s, i, 1); i++
        if (c != "\\") { if (c < " " || c == "\177") { if (c == "\n" || c == "\r") break } else o = o c; continue }
        e = substr(s, i, 1); i++
        if (e == "n" || e == "r") break
        if (e == "t") o = o " "
        else if (e == "u") {
          u = hex(substr(s, i, 4)); i += 4
          if (u >= 55296 && u < 56320 && substr(s, i, 2) == "\\u") {
            lo = hex(substr(s, i + 2, 4))
            if (lo >= 56320 && lo < 57344) { u = 65536 + (u - 55296) * 1024 + lo - 56320; i += 6 }
          }
          if (u >= 32 && u != 127 && (u < 55296 || u >= 57344)) o = o utf8(u)
        } else if (e != "b" && e != "f") o = o e
      }
      return o
    }
    function where(generic,  k, p) {  # .a[3].b, or .a[].b when generic
      p = ""
      for (k = 1; k <= d; k++) p = p (kind[k] == "o" ? "." key[k] : (generic ? "[]" : "[" idx[k] "]"))
      return p
    }
    function value(v) { if (index(want, " " where(1) " ")) print where(0) "\t" v }
    function flush() { if (lit != "") { value(lit); lit = "" } }
    function outside(s,  i, c) {
      for (i = 1; i <= length(s); i++) {
        c = substr(s, i, 1)
        if (c == "{") { d++; kind[d] = "o"; key[d] = ""; wantkey = 1 }
        else if (c == "[") { d++; kind[d] = "a"; idx[d] = 0 }
        else if (c == "}" || c == "]") { flush(); d-- }
        else if (c == ",") { flush(); if (kind[d] == "a") idx[d]++; else wantkey = 1 }
        else if (c == ":") wantkey = 0
        else if (c == " " || c == "\t" || c == "\n" || c == "\r") flush()
        else lit = lit c
      }
    }
    BEGIN { RS = "\""; want = ENVIRON["JF_WANT"] }
    !instr { outside($0); instr = 1; next }
    {
      s = pend $0
      if (match(s, /\\+$/) && RLENGTH % 2) { pend = s "\""; next }
      pend = ""; instr = 0
      if (kind[d] == "o" && wantkey) key[d] = text(s); else value(text(s))
    }'
}

json_get() {  # json_get PATH: its value from json_flat lines on stdin
  JG_PATH=$1 awk '{ t = index($0, "\t") }
    substr($0, 1, t - 1) == ENVIRON["JG_PATH"] { print substr($0, t + 1); exit }'
}

work() {  # a scratch folder for this run
  if [ -z "${WORK:-}" ]; then WORK=$(mktemp -d "${TMPDIR:-/tmp}/reef.XXXXXX"); trap 'rm -rf "$WORK"' EXIT; fi
}

need_token() {
  [ -n "${REEF_TOKEN:-}" ] || die "set REEF_TOKEN to reefd's API token first (it is never written to disk)"
}

reef_curl() {  # curl with the token on stdin, out of the process list
  printf 'Authorization: Bearer %s\n' "$REEF_TOKEN" | curl -sS -H @- "$@"
}

api_error() {  # api_error FILE CODE: one line on what reefd answered
  ae_msg=$(json_flat ".error.message" < "$1" 2>/dev/null | json_get .error.message) || ae_msg=
  say "reefd answered HTTP $2${ae_msg:+: $ae_msg}"
}

installed() { tail -n 1 "$ADATA/history" 2>/dev/null || true; }

list_index() {  # list_index ID: the position of release ID in json_flat lines of a release list on stdin
  LI_ID=$1 awk -F '\t' '$1 ~ /^\.data\[[0-9]+\]\.id$/ && $2 == ENVIRON["LI_ID"] {
    sub(/^\.data\[/, "", $1); sub(/\].*$/, "", $1); print $1; exit }'
}

do_update() {
  need_token; work
  up_code=$(reef_curl --connect-timeout 10 --max-time 120 -o "$WORK/install.sh" -w '%{http_code}' \
    "$BASE_URL/reef/harness/install?adapter=$ADAPTER&scenario=$SCENARIO") || up_code=000
  if [ "$up_code" != 200 ]; then
    if [ "$up_code" = 000 ]; then say "could not reach reefd at $BASE_URL"
    else api_error "$WORK/install.sh" "$up_code"; fi
    return 1
  fi
  sh "$WORK/install.sh"
}

check_newer() {  # asks reefd, briefly, whether a harness newer than the installed one exists
  cn_have=$(installed); work
  cn_code=$(reef_curl --connect-timeout 2 --max-time 3 -o "$WORK/releases" -w '%{http_code}' \
    "$BASE_URL/reef/harness/releases?scenario=$SCENARIO" 2>/dev/null) || cn_code=000
  if [ "$cn_code" = 401 ]; then say "reefd refused REEF_TOKEN (HTTP 401)"; fi
  [ "$cn_code" = 200 ] || return 0
  json_flat ".current .data[].id .data[].summary" < "$WORK/releases" > "$WORK/releases.flat"
  cn_cur=$(json_get .current < "$WORK/releases.flat")
  { [ -n "$cn_cur" ] && [ "$cn_cur" != "$cn_have" ]; } || return 0
  cn_ci=$(list_index "$cn_cur" < "$WORK/releases.flat") cn_hi=$(list_index "$cn_have" < "$WORK/releases.flat")
  if [ -n "$cn_ci" ] && [ -n "$cn_hi" ] && [ "$cn_hi" -lt "$cn_ci" ]; then return 0; fi  # newest first: ours is newer
  cn_sum=$(json_get ".data[$cn_ci].summary" < "$WORK/releases.flat")
  cn_what="$cn_cur${cn_sum:+ ($cn_sum)}"
  if [ -t 0 ] && [ -t 1 ]; then
    printf 'A newer harness is available: %s\n1) Update with %s update\n2) Skip\n' "$cn_what" "$PROG"
    while :; do
      printf 'Choose 1 or 2 [2]: '
      read -r cn_choice || cn_choice=2
      case $cn_choice in
        1) do_update || say "the update failed; starting on the installed harness ($cn_have)"; break ;;
        2 | "") break ;;
        *) echo "Please answer 1 or 2." ;;
      esac
    done
  else
    say "a newer harness is available: $cn_what; '$PROG update' installs it"
  fi
}

start() {
  need_token
  check_newer
  SESSION=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n' |
    sed 's/^\(........\)\(....\)\(....\)\(....\)\(............\)$/\1-\2-\3-\4-\5/')
  mkdir -p "$DATA"
  printf '%s\n' "$SESSION" > "$DATA/last-session.new"
  mv "$DATA/last-session.new" "$DATA/last-session"
  if [ -n "${WORK:-}" ]; then rm -rf "$WORK"; trap - EXIT; fi
  launch "$@"
}

do_rollback() {
  work; NEW=''
  rb_n=$(awk 'END { print NR }' "$ADATA/history" 2>/dev/null || echo 0)
  [ "$rb_n" -ge 2 ] || die "no earlier harness to roll back to"
  rb_from=$(installed) rb_to=$(tail -n 2 "$ADATA/history" | head -n 1)
  [ -d "$ADATA/releases/$rb_to" ] || die "the files of $rb_to are gone from $ADATA/releases"
  apply_release "$rb_to"
  sed '$d' "$ADATA/history" > "$WORK/history"; mv "$WORK/history" "$ADATA/history"
  echo "Rolled back the harness of scenario $SCENARIO from $rb_from to $rb_to ('$PROG update' installs the newest)."
}

do_report() {
  rp_score='' rp_fb='' rp_hasfb=
  while [ $# -gt 0 ]; do
    case $1 in
      --score) [ $# -ge 2 ] || die "--score needs a value"; rp_score=$2; shift 2 ;;
      --score=*) rp_score=${1#--score=}; shift ;;
      --feedback) [ $# -ge 2 ] || die "--feedback needs a value"; rp_fb=$2 rp_hasfb=1; shift 2 ;;
      --feedback=*) rp_fb=${1#--feedback=} rp_hasfb=1; shift ;;
      *) die "usage: $PROG report --score S [--feedback TEXT]" ;;
    esac
  done
  printf '%s\n' "$rp_score" | grep -Eq '^-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?$' ||
    die "usage: $PROG report --score S [--feedback TEXT], S a number like 1 or 0.5"
  need_token; work
  rp_session=$(cat "$DATA/last-session" 2>/dev/null) || die "no session to report on: start $PROG first"
  rp_after=
  : > "$WORK/refs"
  while :; do
    rp_code=$(reef_curl --max-time 60 -o "$WORK/page" -w '%{http_code}' \
      "$BASE_URL/reef/scenarios/$SCENARIO/records?session=$rp_session&limit=1000${rp_after:+&after=$rp_after}") ||
      die "could not reach reefd at $BASE_URL"
    [ "$rp_code" = 200 ] || { api_error "$WORK/page" "$rp_code"; exit 1; }
    json_flat ".data[].id .has_more .last_id" < "$WORK/page" > "$WORK/page.flat"
    awk -F '\t' '$1 ~ /^\.data\[[0-9]+\]\.id$/ { print $2 }' "$WORK/page.flat" >> "$WORK/refs"
    [ "$(json_get .has_more < "$WORK/page.flat")" = true ] || break
    rp_after=$(json_get .last_id < "$WORK/page.flat")
  done
  [ -s "$WORK/refs" ] || die "reefd has no turns of the last session ($rp_session) yet"
  {
    printf '{"score": %s, ' "$rp_score"
    if [ -n "$rp_hasfb" ]; then printf '"feedback": "%s", ' "$(json_str "$rp_fb")"; fi
    printf '"references": ['
    rp_sep=
    while IFS= read -r rp_id; do printf '%s"%s"' "$rp_sep" "$(json_str "$rp_id")"; rp_sep=", "; done < "$WORK/refs"
    printf ']}\n'
  } > "$WORK/body"
  rp_code=$(reef_curl --max-time 60 -o "$WORK/answer" -w '%{http_code}' -H 'Content-Type: application/json' \
    -H "x-reef-scenario: $SCENARIO" --data-binary @"$WORK/body" "$BASE_URL/reef/report") ||
    die "could not reach reefd at $BASE_URL"
  case $rp_code in 2??) ;; *) api_error "$WORK/answer" "$rp_code"; exit 1 ;; esac
  rp_n=$(wc -l < "$WORK/refs" | tr -d ' ')
  rp_rid=$(json_flat ".report_id" < "$WORK/answer" | json_get .report_id)
  echo "Reported score $rp_score on $rp_n turn(s) of session $rp_session${rp_rid:+ (report $rp_rid)}."
}

json_str() {  # json_str TEXT: TEXT as the inside of a JSON string
  printf '%sx' "$1" | LC_ALL=C awk '  # the x keeps a final line break from being lost; END drops it
    BEGIN { for (i = 1; i < 32; i++) esc[sprintf("%c", i)] = sprintf("\\u%04x", i)
            esc["\""] = "\\\""; esc["\\"] = "\\\\" }
    { if (NR > 1) all = all "\\n"
      for (i = 1; i <= length($0); i++) { c = substr($0, i, 1); all = all ((c in esc) ? esc[c] : c) } }
    END { printf "%s", substr(all, 1, length(all) - 1) }'
}

do_uninstall() {
  work
  for un_m in "$DATA"/*/manifest; do
    [ -f "$un_m" ] || continue
    un_i=$(mget instructions "$un_m")
    if [ -n "$un_i" ]; then remove_block "$un_i" "$(mget block-newline "$un_m")"; fi
    forget "$un_m"
    sed -n 's/^skill //p' "$un_m" | while IFS= read -r un_d; do prune "$un_d"; done
  done
  if head -n 2 "$BIN/$PROG" 2>/dev/null | grep -q "^# $PROG: starts "; then rm -f "$BIN/$PROG"; fi  # ours only
  rm -rf "$DATA"
  if [ -f "$LEDGER" ]; then  # what Reef created and no scenario needs any more
    mv "$LEDGER" "$WORK/ledger"
    sweep < "$WORK/ledger"
    if [ -d "$(dirname "$LEDGER")" ]; then
      while IFS= read -r un_p; do [ ! -e "$un_p" ] || echo "$un_p"; done < "$WORK/ledger" > "$LEDGER"
    fi
  fi
  echo "Removed Reef's harness of scenario $SCENARIO: its blocks, skills, data and $PROG. Your own files stay."
}

main() {
  paths
  case ${1:-} in
    update) [ $# -eq 1 ] || die "usage: $PROG update"; do_update ;;
    rollback) [ $# -eq 1 ] || die "usage: $PROG rollback"; do_rollback ;;
    report) shift; do_report "$@" ;;
    uninstall) [ $# -eq 1 ] || die "usage: $PROG uninstall"; do_uninstall ;;
    --) shift; start "$@" ;;
    *) start "$@" ;;
  esac
}
"""
