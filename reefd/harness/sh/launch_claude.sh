# shellcheck shell=sh
# launch_claude.sh: the wrapper's launch() for Claude Code: runs the agent pointed at reefd ("$@": its arguments).
# installer.py puts it after wrapper.sh, whose start() calls it with SESSION set.
# Set elsewhere: SCENARIO, BASE_URL (the constants installer.py writes first), ADATA (paths()); REEF_TOKEN (the
# user's).

launch() {
  unset ANTHROPIC_API_KEY  # the user's own key must not go to reefd
  ANTHROPIC_BASE_URL=$BASE_URL
  ANTHROPIC_AUTH_TOKEN=$REEF_TOKEN
  ANTHROPIC_CUSTOM_HEADERS="x-reef-scenario: $SCENARIO
x-reef-session: $SESSION"
  export ANTHROPIC_BASE_URL ANTHROPIC_AUTH_TOKEN ANTHROPIC_CUSTOM_HEADERS
  if [ -f "$ADATA/settings.json" ]; then set -- --settings "$ADATA/settings.json" "$@"; fi  # the enabled hooks
  exec "${REEF_AGENT_BIN:-claude}" "$@"
}
