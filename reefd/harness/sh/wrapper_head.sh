#!/bin/sh
# reef-{scenario}: starts {title} pointed at reefd for scenario {scenario}, with Reef's harness installed.
#   reef-{scenario} [AGENT ARGS...]       start (first asks reefd whether a newer harness exists)
#   reef-{scenario} update                install reefd's current harness (the previous one is kept)
#   reef-{scenario} rollback              go back to the previously installed harness
#   reef-{scenario} report --score S [--feedback TEXT]   report on the turns of the last session
#   reef-{scenario} extensions [enable|disable ID...]   list the harness's MCP servers and hooks, ask
#                                      about new ones on a terminal, or turn one on or off
#   reef-{scenario} uninstall             remove Reef's blocks, skills, commands, subagents, extensions and
#                                      data (every agent's, for scenario {scenario}) and this wrapper
#   reef-{scenario} -- ARGS...            start, even when ARGS begins with a word above
# One wrapper per scenario: installing another agent for it makes this file start that agent. The token is read
# from $REEF_TOKEN at run time and never written down. Written by Reef's installer.
set -eu
