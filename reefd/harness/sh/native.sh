# shellcheck shell=sh
# native.sh: what an agent loads itself. Placed files (its commands and subagents, release/place/) and extensions
# (MCP servers and hooks, release/ext/<id>/), which are enabled only once the user said yes to that version of them.
# installer.py puts it after common.sh: apply_release calls place_files, ext_decide and ext_apply; check_release
# calls check_placed; the wrapper's `extensions` command uses the rest.
# Set elsewhere: SCENARIO, ADAPTER, PROG (the constants installer.py writes first), ADATA (paths()), COMMANDS,
# AGENTS, TOML (check_release), WORK (the command's scratch folder); say, mkdirs, put_file, sha256_of, splice,
# block_state, remove_block (common.sh).

place_dir() {  # place_dir PLACE: the folder the agent reads PLACE (commands, agents) from
  case $1 in commands) printf '%s\n' "$COMMANDS" ;; *) printf '%s\n' "$AGENTS" ;; esac
}

placed_targets() {  # placed_targets RELEASE: "SOURCE<TAB>TARGET" of each file the release places
  for pt_place in commands agents; do
    for pt_f in "$1/place/$pt_place"/*; do
      [ -f "$pt_f" ] && printf '%s\t%s/%s\n' "$pt_f" "$(place_dir "$pt_place")" "${pt_f##*/}"
    done
  done
  return 0
}

owns() {  # owns MANIFEST PATH: whether MANIFEST lists PATH as a file Reef installed
  sed -n 's/^file [0-9a-f]* //p' "$1" 2>/dev/null | grep -qFx "$2"
}

check_placed() {  # check_placed RELEASE MANIFEST: fails when a placed file would replace one that is not Reef's
  placed_targets "$1" > "$WORK/placed"
  while IFS="$(printf '\t')" read -r _ cp_t; do
    if { [ -e "$cp_t" ] || [ -L "$cp_t" ]; } && ! owns "$2" "$cp_t"; then
      die "$cp_t already exists and is not Reef's: Reef does not overwrite it." \
        "Rename or remove it, then install again (nothing was changed)"
    fi
  done < "$WORK/placed"
}

place_files() {  # place_files RELEASE MANIFEST: copies the placed files, listing them in MANIFEST and $WORK/paths
  placed_targets "$1" > "$WORK/placed"
  while IFS="$(printf '\t')" read -r pf_src pf_t; do
    mkdirs "$(dirname "$pf_t")"
    cp "$pf_src" "$WORK/text"; put_file "$WORK/text" "$pf_t"
    echo "file $(sha256_of "$pf_src") $pf_t" >> "$2"
    echo "$pf_t" >> "$WORK/paths"
  done < "$WORK/placed"
}

# --- extensions: "on ID SHA" or "off ID SHA" in $ADATA/extensions, the user's last answer for each id ---

ext_ids() {  # ext_ids RELEASE: the extensions of a release folder, one id a line
  for ei_d in "$1"/ext/*/; do [ -d "$ei_d" ] && basename "$ei_d"; done; return 0
}

ext_key() {  # ext_key RELEASE ID: "ID SHA", SHA that of the extension's file in the release
  printf '%s %s\n' "$2" "$(sha256_of "$1/harness/extensions/$2.yaml")"
}

ext_state() {  # ext_state KEY: on or off when the user answered for this version of the extension, else nothing
  [ -f "$ADATA/extensions" ] || return 0
  ES_KEY=$1 awk '{ k = $0; sub(/^[a-z]+ /, "", k) } k == ENVIRON["ES_KEY"] { s = $1 } END { print s }' \
    "$ADATA/extensions"
}

ext_set() {  # ext_set on|off KEY: the answer for KEY's id, replacing any earlier one
  { awk -v id="${2%% *}" '$2 != id' "$ADATA/extensions" 2>/dev/null || true; echo "$1 $2"; } > "$WORK/ext"
  put_file "$WORK/ext" "$ADATA/extensions"
}

can_ask() {  # a terminal to ask on; `curl | sh` reads the script from stdin, so the answer comes from /dev/tty
  [ -z "${REEF_NO_PROMPT:-}" ] && (true < /dev/tty) 2>/dev/null
}

ext_ask() {  # ext_ask RELEASE ID: shows the extension on the terminal and asks; 0 when the user says yes
  ea_was='a new'
  if grep -q "^[a-z]* $2 " "$ADATA/extensions" 2>/dev/null; then ea_was='a changed'; fi
  {
    printf "Reef's harness for scenario %s has %s extension for %s:\n" "$SCENARIO" "$ea_was" "$ADAPTER"
    printf '  %s\n' "$(cat "$1/ext/$2/shown")"
    printf 'Enable it? [y/N] '
  } > /dev/tty
  read -r ea_answer < /dev/tty || ea_answer=
  case $ea_answer in [yY] | [yY][eE][sS]) return 0 ;; *) return 1 ;; esac
}

ext_decide() {  # ext_decide RELEASE: asks about each new or changed extension the agent can take, on a terminal
  can_ask || return 0
  for ed_id in $(ext_ids "$1"); do
    [ ! -f "$1/ext/$ed_id/none" ] || continue
    ed_key=$(ext_key "$1" "$ed_id")
    [ -z "$(ext_state "$ed_key")" ] || continue
    if ext_ask "$1" "$ed_id"; then ext_set on "$ed_key"; else ext_set off "$ed_key"; fi
  done
}

ext_enabled() {  # ext_enabled RELEASE: the ids the user enabled in their current version, one a line
  for ee_id in $(ext_ids "$1"); do
    [ ! -f "$1/ext/$ee_id/none" ] || continue
    [ "$(ext_state "$(ext_key "$1" "$ee_id")")" != on ] || echo "$ee_id"
  done
}

ext_report() {  # ext_report RELEASE: one line on each extension that is not enabled, and why
  er_pending=
  for er_id in $(ext_ids "$1"); do
    if [ -f "$1/ext/$er_id/none" ]; then say "extension $er_id is not enabled: $(cat "$1/ext/$er_id/none")"; continue; fi
    case $(ext_state "$(ext_key "$1" "$er_id")") in
      on) ;; off) say "extension $er_id is off (you said no; '$PROG extensions enable $er_id' turns it on)" ;;
      *) er_pending="$er_pending $er_id" ;;
    esac
  done
  [ -z "$er_pending" ] || say "not enabled, waiting for your yes:$er_pending ('$PROG extensions' shows and asks)"
}

ext_apply() {  # ext_apply RELEASE MANIFEST OLDMANIFEST: the agent's config gets exactly the enabled extensions
  ext_enabled "$1" > "$WORK/enabled"
  case $ADAPTER in
    claude) claude_mcp "$@"; claude_hooks "$1" ;;
    codex) codex_toml "$@" ;;
    opencode) opencode_config "$1" ;;
  esac
}

agent_bin() {  # agent_bin NAME: the agent's command (REEF_AGENT_BIN when NAME is this wrapper's agent)
  if [ "$ADAPTER" = "$1" ] && [ -n "${REEF_AGENT_BIN:-}" ]; then echo "$REEF_AGENT_BIN"; else echo "$1"; fi
}

claude_mcp_remove() {  # claude_mcp_remove ID: takes an MCP server Reef added out of Claude Code's user config
  if ! "$(agent_bin claude)" mcp remove --scope user "$1" > "$WORK/out" 2>&1; then
    say "could not remove MCP server $1 from Claude Code: $(head -n 1 "$WORK/out")" \
      "(claude mcp remove --scope user $1 does it)"
  fi
}

claude_mcp() {  # MCP servers through Claude Code's own CLI, into its user config; "mcp ID SHA" in the manifest
  sed -n 's/^mcp //p' "$3" 2>/dev/null > "$WORK/had" || true
  : > "$WORK/want"
  while IFS= read -r cm_id; do
    [ ! -f "$1/ext/$cm_id/mcp.json" ] || ext_key "$1" "$cm_id" >> "$WORK/want"
  done < "$WORK/enabled"
  while IFS= read -r cm_key; do
    if grep -qFx "$cm_key" "$WORK/want"; then echo "mcp $cm_key" >> "$2"; else claude_mcp_remove "${cm_key%% *}"; fi
  done < "$WORK/had"
  while IFS= read -r cm_key; do
    cm_id=${cm_key%% *}
    ! grep -qFx "$cm_key" "$WORK/had" || continue
    if ! command -v "$(agent_bin claude)" > /dev/null 2>&1; then
      say "MCP server $cm_id is not added yet: claude is not on the PATH ('$PROG extensions' adds it once it is)"
    elif "$(agent_bin claude)" mcp add-json --scope user "$cm_id" "$(cat "$1/ext/$cm_id/mcp.json")" \
      > "$WORK/out" 2>&1; then
      echo "mcp $cm_key" >> "$2"
    else
      say "Claude Code did not add MCP server $cm_id: $(head -n 1 "$WORK/out")"
    fi
  done < "$WORK/want"
}

hook_events() {  # hook_events RELEASE: the events the enabled hooks of a release run on, one a line
  while IFS= read -r he_id; do
    for he_f in "$1/ext/$he_id"/hook.*.json; do
      [ -f "$he_f" ] || continue
      he_f=${he_f##*/hook.}; echo "${he_f%.json}"
    done
  done < "$WORK/enabled" | sort -u
}

claude_hooks() {  # hooks in a settings file of Reef's own, which the wrapper passes with --settings
  : > "$WORK/hooks"
  for ch_ev in $(hook_events "$1"); do
    [ ! -s "$WORK/hooks" ] || printf ', ' >> "$WORK/hooks"
    printf '"%s": [' "$ch_ev" >> "$WORK/hooks"
    ch_sep=
    while IFS= read -r ch_id; do
      [ -f "$1/ext/$ch_id/hook.$ch_ev.json" ] || continue
      printf '%s%s' "$ch_sep" "$(cat "$1/ext/$ch_id/hook.$ch_ev.json")" >> "$WORK/hooks"; ch_sep=', '
    done < "$WORK/enabled"
    printf ']' >> "$WORK/hooks"
  done
  if [ -s "$WORK/hooks" ]; then
    printf '{"hooks": {%s}}\n' "$(cat "$WORK/hooks")" > "$WORK/settings"
    put_file "$WORK/settings" "$ADATA/settings.json"
  else
    rm -f "$ADATA/settings.json"
  fi
}

codex_toml() {  # MCP servers and hooks as tables in Reef's block at the end of Codex's config.toml
  : > "$WORK/toml"
  splice "$TOML" remove /dev/null 0 toml > "$WORK/outside" 2>/dev/null || : > "$WORK/outside"
  while IFS= read -r ct_id; do
    ct_f=$1/ext/$ct_id/config.toml
    [ -f "$ct_f" ] || continue
    if grep -qFx "$(head -n 1 "$ct_f")" "$WORK/outside" && [ "$(head -c 13 "$ct_f")" = '[mcp_servers.' ]; then
      say "MCP server $ct_id is not enabled: $TOML has its own $(head -n 1 "$ct_f")"; continue
    fi
    [ ! -s "$WORK/toml" ] || echo >> "$WORK/toml"
    cat "$ct_f" >> "$WORK/toml"
  done < "$WORK/enabled"
  ct_nl=$(mget toml-newline "$3")
  if [ -s "$WORK/toml" ]; then
    if [ "$(block_state "$TOML" toml)" = absent ]; then
      ct_nl=0
      if [ -s "$TOML" ] && [ -n "$(tail -c 1 "$TOML")" ]; then ct_nl=1; fi
      if [ ! -e "$TOML" ]; then NEW="$NEW$TOML
"; fi
    fi
    mkdirs "$(dirname "$TOML")"
    splice "$TOML" put "$WORK/toml" 0 toml > "$WORK/text"
    put_file "$WORK/text" "$TOML"
    printf 'toml %s\ntoml-newline %s\n' "$TOML" "${ct_nl:-0}" >> "$2"
  else
    remove_block "$TOML" "${ct_nl:-0}" toml
  fi
}

opencode_config() {  # Reef's opencode.json (OPENCODE_CONFIG) with an "mcp" entry for each enabled server
  oc_n=0
  while IFS= read -r oc_id; do
    [ -f "$1/ext/$oc_id/entry.json" ] || continue
    if [ "$oc_n" = 0 ]; then sed '$d' "$1/opencode.json" | sed '$s/$/,/' > "$WORK/oc"; printf '  "mcp": {\n    ' >> "$WORK/oc"
    else printf ',\n    ' >> "$WORK/oc"; fi
    tr -d '\n' < "$1/ext/$oc_id/entry.json" >> "$WORK/oc"; oc_n=$((oc_n + 1))
  done < "$WORK/enabled"
  if [ "$oc_n" = 0 ]; then cp "$1/opencode.json" "$WORK/oc"; else printf '\n  }\n}\n' >> "$WORK/oc"; fi
  put_file "$WORK/oc" "$ADATA/opencode.json"
}
