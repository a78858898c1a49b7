# shellcheck shell=sh
# launch_codex.sh: the wrapper's launch() for Codex CLI: runs the agent pointed at reefd ("$@": its arguments).
# installer.py puts it after wrapper.sh, whose start() calls it with SESSION set.
# Set elsewhere: SCENARIO, BASE_URL (the constants installer.py writes first); REEF_TOKEN (the user's).

launch() {
  export REEF_TOKEN  # read through env_key; Codex ignores OPENAI_BASE_URL, so the provider comes by -c
  exec "${REEF_AGENT_BIN:-codex}" -c 'model_provider="reef"' -c "model=\"$SCENARIO\"" \
    -c 'model_providers.reef.name="Reef"' -c "model_providers.reef.base_url=\"$BASE_URL/v1\"" \
    -c 'model_providers.reef.wire_api="responses"' -c 'model_providers.reef.env_key="REEF_TOKEN"' \
    -c "model_providers.reef.http_headers={ \"x-reef-scenario\" = \"$SCENARIO\", \
\"x-reef-session\" = \"$SESSION\" }" \
    "$@"
}
