# shellcheck shell=sh
# launch_generic.sh: the wrapper's launch() for any OpenAI- or Anthropic-SDK agent: runs the command in "$@"
# pointed at reefd (REEF_AGENT_BIN when there is none).
# installer.py puts it after wrapper.sh, whose start() calls it with SESSION set.
# Set elsewhere: SCENARIO, BASE_URL, PROG (the constants installer.py writes first), ADATA
# (paths()); die (common.sh); REEF_TOKEN (the user's).

launch() {
  if [ $# -eq 0 ] && [ -n "${REEF_AGENT_BIN:-}" ]; then set -- "$REEF_AGENT_BIN"; fi
  [ $# -gt 0 ] || die "usage: $PROG COMMAND [ARGS...] (runs COMMAND pointed at reefd)"
  OPENAI_BASE_URL=$BASE_URL/scenarios/$SCENARIO/v1  # the path names the scenario: SDKs send no custom header
  OPENAI_API_KEY=$REEF_TOKEN
  ANTHROPIC_BASE_URL=$BASE_URL/scenarios/$SCENARIO
  ANTHROPIC_AUTH_TOKEN=$REEF_TOKEN
  REEF_SCENARIO=$SCENARIO REEF_SESSION=$SESSION REEF_URL=$BASE_URL
  REEF_HARNESS_DIR=$ADATA/harness REEF_INSTRUCTIONS=$ADATA/AGENTS.md
  export OPENAI_BASE_URL OPENAI_API_KEY ANTHROPIC_BASE_URL ANTHROPIC_AUTH_TOKEN REEF_SCENARIO REEF_SESSION \
    REEF_URL REEF_HARNESS_DIR REEF_INSTRUCTIONS
  exec "$@"
}
