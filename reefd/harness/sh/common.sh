# shellcheck shell=sh
# common.sh: the functions the installer and the wrapper share (rollback and uninstall run the same code the
# installer ran); installer.py puts it after the constants and paths(), before installer.sh or wrapper.sh.
# Set elsewhere: SCENARIO, ADAPTER, BASE_URL, PROG (the constants installer.py writes first), DATA, BIN, ADATA,
# LEDGER, INSTR_DEFAULT, SKILLS_DEFAULT, COMMANDS_DEFAULT, AGENTS_DEFAULT, TOML_DEFAULT (paths()), NEW and WORK
# (installer.sh's and wrapper.sh's commands); check_placed, place_files, ext_decide, ext_apply (native.sh).

say() { printf '%s\n' "$PROG: $*" >&2; }
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

splice() {  # splice FILE MODE [BODY] [DROPNL] [STYLE]: FILE's text with Reef's block put (from BODY), removed or
  # checked; STYLE md (the default: <!-- --> markers) or toml (# markers)
  sp_nl=1
  if [ -s "$1" ] && [ -n "$(tail -c 1 "$1")" ]; then sp_nl=0; fi
  sp_in=$1; [ -f "$sp_in" ] || sp_in=/dev/null
  sp_open='<!-- ' sp_close=' -->'
  if [ "${5:-md}" = toml ]; then sp_open='# ' sp_close=''; fi
  SP_MODE=$2 SP_BODY=${3:-/dev/null} SP_DROPNL=${4:-0} SP_NL=$sp_nl \
  SP_BEGIN="${sp_open}reef:$SCENARIO begin " SP_HEAD="${sp_open}reef:$SCENARIO begin release=${REL_ID:-}$sp_close" \
  SP_END="${sp_open}reef:$SCENARIO end$sp_close" awk '
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

block_state() {  # block_state FILE [STYLE]: "present", "absent" or "broken" (a begin marker without its end)
  if splice "$1" check /dev/null 0 "${2:-md}"; then echo present; elif [ $? = 1 ]; then echo absent; else echo broken; fi
}

remove_block() {  # remove_block FILE DROPNL [STYLE]
  [ -f "$1" ] || return 0
  [ "$(block_state "$1" "${3:-md}")" = present ] || return 0
  splice "$1" remove /dev/null "$2" "${3:-md}" > "$WORK/text"
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
  cr_old=$ADATA/manifest INSTR=$(mget instructions "$cr_old") SKILLS=$(mget skills "$cr_old")
  COMMANDS=$(mget commands "$cr_old") AGENTS=$(mget agents "$cr_old") TOML=$(mget toml "$cr_old")
  INSTR=${INSTR:-$INSTR_DEFAULT} SKILLS=${SKILLS:-$SKILLS_DEFAULT} TOML=${TOML:-$TOML_DEFAULT}
  COMMANDS=${COMMANDS:-$COMMANDS_DEFAULT} AGENTS=${AGENTS:-$AGENTS_DEFAULT}
  if [ "$(block_state "$INSTR")" = broken ]; then
    die "$INSTR has a '<!-- reef:$SCENARIO begin' line without its '<!-- reef:$SCENARIO end -->' line;" \
      "fix or remove it, then install again (nothing was changed)"
  fi
  if [ -n "$TOML" ] && [ "$(block_state "$TOML" toml)" = broken ]; then
    die "$TOML has a '# reef:$SCENARIO begin' line without its '# reef:$SCENARIO end' line;" \
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
  check_placed "$1" "$cr_old"
  [ -f "$cr_old" ] || return 0
  sed -n 's/^file //p' "$cr_old" > "$WORK/owned"
  while IFS= read -r cr_line; do  # a file of Reef's that the user changed, and that this release would change
    cr_f=${cr_line#* } cr_new=$(source_of "$1" "${cr_line#* }")
    if [ -f "$cr_f" ] && [ -f "$cr_new" ] && ! cmp -s "$cr_f" "$cr_new" &&
      [ "$(sha256_of "$cr_f")" != "${cr_line%% *}" ]; then
      die "$cr_f was changed after Reef installed it: Reef does not overwrite your changes." \
        "Save them elsewhere and undo them or delete the file, then install again (nothing was changed)"
    fi
  done < "$WORK/owned"
}

source_of() {  # source_of FOLDER PATH: the file of release FOLDER that the installed file PATH comes from
  case $2 in
    "$SKILLS"/*) echo "$1/harness/skills/${2#"$SKILLS"/}" ;;
    "$COMMANDS"/*) echo "$1/place/commands/${2#"$COMMANDS"/}" ;;
    "$AGENTS"/*) echo "$1/place/agents/${2#"$AGENTS"/}" ;;
  esac
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

apply_block() {  # apply_block FOLDER OLDMANIFEST: Reef's block in the instructions file; prints block-newline
  ab_dropnl=$(mget block-newline "$2")
  if [ -s "$1/instructions.md" ]; then
    if [ "$(block_state "$INSTR")" = absent ]; then  # Reef's first block here: remember how the file ended
      ab_dropnl=0
      if [ -s "$INSTR" ] && [ -n "$(tail -c 1 "$INSTR")" ]; then ab_dropnl=1; fi
      if [ ! -e "$INSTR" ]; then NEW="$NEW$INSTR
"; fi
    fi
    mkdirs "$(dirname "$INSTR")"
    splice "$INSTR" put "$1/instructions.md" > "$WORK/text"
    put_file "$WORK/text" "$INSTR"
  else
    remove_block "$INSTR" "${ab_dropnl:-0}"; ab_dropnl=0
  fi
  AB_DROPNL=${ab_dropnl:-0}
}

apply_skills() {  # apply_skills FOLDER MANIFEST: the skills' files, listed in MANIFEST and $WORK/paths
  for as_id in $(skill_ids "$1"); do
    mkdirs "$SKILLS/$as_id"
    echo "skill $SKILLS/$as_id" >> "$2"
    (cd "$1/harness/skills/$as_id" && find . -type f) | sort > "$WORK/list"
    while IFS= read -r as_f; do
      as_f=${as_f#./} as_to=$SKILLS/$as_id/${as_f#./}
      mkdirs "$(dirname "$as_to")"
      cp "$1/harness/skills/$as_id/$as_f" "$WORK/text"; put_file "$WORK/text" "$as_to"
      echo "file $(sha256_of "$1/harness/skills/$as_id/$as_f") $as_to" >> "$2"
      echo "$as_to" >> "$WORK/paths"
    done < "$WORK/list"
  done
}

apply_release() {  # apply_release ID: installs releases/ID (block, skills, commands, subagents, extensions)
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
    apply_block "$ar_rel" "$ar_old"
    printf 'release %s\ninstructions %s\nskills %s\nblock-newline %s\ncommands %s\nagents %s\n' "$1" "$INSTR" \
      "$SKILLS" "$AB_DROPNL" "$COMMANDS" "$AGENTS" > "$ar_new"
    : > "$WORK/paths"
    apply_skills "$ar_rel" "$ar_new"
    place_files "$ar_rel" "$ar_new"
    if [ -f "$ar_old" ]; then  # what the last release installed and this one does not
      forget "$ar_old" "$WORK/paths"
      sed -n 's/^skill //p' "$ar_old" | while IFS= read -r ar_d; do
        grep -qFx "skill $ar_d" "$ar_new" || prune "$ar_d"; done
    fi
    ext_decide "$ar_rel"
    ext_apply "$ar_rel" "$ar_new" "$ar_old"
    ext_report "$ar_rel"
  fi
  put_file "$ar_new" "$ar_old"
  ledger_add
}

history_add() {  # the installed releases, oldest first; the last line is the one installed now
  [ "$(tail -n 1 "$ADATA/history" 2>/dev/null || true)" = "$1" ] || echo "$1" >> "$ADATA/history"
}
