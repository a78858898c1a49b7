# shellcheck shell=sh
# installer.sh: unpack, on_exit and main of the installer; installer.py puts it after common.sh and follows it
# with stage_files() (one unpack heredoc a file), notes() and the line that runs main.
# Set elsewhere: SCENARIO, ADAPTER, BASE_URL, PROG, RELEASE (the constants installer.py writes first), BIN, ADATA
# (paths()), INSTR, SKILLS (common.sh's check_release); placed_targets, ext_enabled (native.sh).

unpack() {  # unpack NAME SHA256 DROPNL <<TEXT: writes $STAGE/NAME, then checks it against SHA256
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
  # shellcheck disable=SC2034  # WORK: where common.sh's functions keep their scratch files
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
    placed_targets "$ADATA/releases/$RELEASE" | while IFS="$(printf '\t')" read -r src to; do
      case $src in */place/commands/*) echo "  command: $to" ;; *) echo "  subagent: $to" ;; esac
    done
    for id in $(ext_enabled "$ADATA/releases/$RELEASE"); do echo "  extension: $id (enabled)"; done
  fi
  if [ "$ADAPTER" = codex ] && [ -s "$(dirname "$INSTR")/AGENTS.override.md" ]; then
    say "note: Codex reads $(dirname "$INSTR")/AGENTS.override.md instead of AGENTS.md while it is there"
  fi
  echo "Start it with: $PROG  (it talks to reefd at $BASE_URL with the token in \$REEF_TOKEN)"
  case ":${PATH:-}:" in *":$BIN:"*) ;; *) say "note: $BIN is not on your PATH; add it, or run $BIN/$PROG" ;; esac
}
