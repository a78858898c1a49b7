# shellcheck shell=sh
# launch_opencode.sh: the wrapper's launch() for opencode: runs the agent pointed at reefd ("$@": its arguments).
# installer.py puts it after wrapper.sh, whose start() calls it with SESSION set.
# Set elsewhere: ADATA (paths(), which installer.py writes); REEF_TOKEN (the user's).

launch() {
  OPENCODE_CONFIG=$ADATA/opencode.json  # merged over the user's own config; the token stays {env:REEF_TOKEN}
  REEF_SESSION=$SESSION
  export OPENCODE_CONFIG REEF_SESSION REEF_TOKEN
  exec "${REEF_AGENT_BIN:-opencode}" "$@"
}
