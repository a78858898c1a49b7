# shellcheck shell=sh
# wrapper.sh: the reef-SCENARIO wrapper's commands (start, update, rollback, report, uninstall) and its main;
# installer.py puts it after common.sh and follows it with the agent's launch() (launch_*.sh) and `main "$@"`.
# Set elsewhere: SCENARIO, ADAPTER, BASE_URL, PROG (the constants installer.py writes first), DATA, BIN, ADATA,
# LEDGER (paths()); ext_* and claude_mcp_remove (native.sh).

json_flat() {  # json_flat "PATHS": JSON on stdin -> "PATH<TAB>VALUE" lines for PATHS like ".data[].id"
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

# shellcheck disable=SC2034  # NEW (reset in do_rollback) is read by common.sh's mkdirs and ledger_add
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
    un_i=$(mget instructions "$un_m") un_t=$(mget toml "$un_m")
    if [ -n "$un_i" ]; then remove_block "$un_i" "$(mget block-newline "$un_m")"; fi
    if [ -n "$un_t" ]; then remove_block "$un_t" "$(mget toml-newline "$un_m")" toml; fi
    sed -n 's/^mcp //p' "$un_m" | while IFS= read -r un_k; do claude_mcp_remove "${un_k%% *}"; done
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
  echo "Removed Reef's harness of scenario $SCENARIO: its blocks, skills, commands, subagents, extensions, data" \
    "and $PROG. Your own files stay."
}

# shellcheck disable=SC2034  # NEW (reset here) is read by common.sh's mkdirs and ledger_add
do_extensions() {  # extensions [enable|disable ID...]: what the installed harness extends the agent with
  work; NEW=''
  ex_rel=$(installed)
  if [ -z "$ex_rel" ] || [ ! -d "$ADATA/releases/$ex_rel" ]; then die "no harness is installed for $ADAPTER"; fi
  ex_dir=$ADATA/releases/$ex_rel
  case ${1:-} in
    enable | disable)
      [ $# -ge 2 ] || die "usage: $PROG extensions [enable|disable ID...]"
      ex_to=on; [ "$1" = enable ] || ex_to=off; shift
      for ex_id in "$@"; do
        [ -d "$ex_dir/ext/$ex_id" ] || die "release $ex_rel has no extension $ex_id (see: $PROG extensions)"
        [ ! -f "$ex_dir/ext/$ex_id/none" ] || die "extension $ex_id: $(cat "$ex_dir/ext/$ex_id/none")"
        ext_set "$ex_to" "$(ext_key "$ex_dir" "$ex_id")"
      done ;;
    "") ;;
    *) die "usage: $PROG extensions [enable|disable ID...]" ;;
  esac
  apply_release "$ex_rel"
  for ex_id in $(ext_ids "$ex_dir"); do
    ex_state=$(ext_state "$(ext_key "$ex_dir" "$ex_id")")
    [ ! -f "$ex_dir/ext/$ex_id/none" ] || ex_state=unsupported
    printf '%-11s %s\n' "${ex_state:-not-asked}" "$(cat "$ex_dir/ext/$ex_id/shown")"
  done
}

main() {
  paths
  case ${1:-} in
    update) [ $# -eq 1 ] || die "usage: $PROG update"; do_update ;;
    rollback) [ $# -eq 1 ] || die "usage: $PROG rollback"; do_rollback ;;
    report) shift; do_report "$@" ;;
    uninstall) [ $# -eq 1 ] || die "usage: $PROG uninstall"; do_uninstall ;;
    extensions) shift; do_extensions "$@" ;;
    --) shift; start "$@" ;;
    *) start "$@" ;;
  esac
}
