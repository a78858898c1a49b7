#!/bin/sh
# Reef harness installer: scenario {scenario}, release {release}, for {title} ({adapter}).
# Made by reefd for GET /reef/harness/install; read it, then run it with sh. It writes only under $HOME:
#  - Reef's part of the agent's instructions file, between <!-- reef:{scenario} begin ... --> and
#    <!-- reef:{scenario} end --> (the rest of the file stays yours), and Reef's skills, listed in a manifest;
#  - ~/.local/share/reef/{scenario}/{adapter}/ (this release and earlier ones, to roll back) and
#    ~/.local/bin/reef-{scenario}, which starts the agent pointed at reefd.
# Every file is checked against its sha256 before anything is moved into place. No token is written anywhere:
# the wrapper reads $REEF_TOKEN when it runs. A truncated download does nothing: main runs on the last line.
set -eu
