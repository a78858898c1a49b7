"""`python -m tests.engines.launched_child OUT CODE [SLEEP_S]`: what a launched engine process sees (its argv, name,
session, environment), written to OUT as JSON; then it sleeps SLEEP_S and exits with CODE."""

from __future__ import annotations

import json
import os
import sys
import time

if __name__ == "__main__":
    out, code, *rest = sys.argv[1:]
    seen = {"argv": sys.argv[1:], "sid": os.getsid(0), "pid": os.getpid(), "env": dict(os.environ),
            "stdin": os.readlink("/proc/self/fd/0")}
    with open(out + ".tmp", "w") as f:
        json.dump(seen, f)
    os.replace(out + ".tmp", out)
    time.sleep(float(rest[0]) if rest else 0)
    sys.exit(int(code))
