"""A function verifier's process, run inside the sandbox: `python -m reefd.grow.practice.call pkg.mod:fn` calls
fn(answer, task) on answer.txt and task.json and prints {"score": x} (True: 1, False: 0). A function that raises,
or returns anything else, ends it with status 3: the verifier failed, not the answer."""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

from reefd import plugins

ERROR = 3


def main(argv: list[str]) -> int:
    try:
        fn = plugins.resolve({}, argv[0], "practice verifier function")
        result = fn(Path("answer.txt").read_text(), json.loads(Path("task.json").read_text()))
    except Exception:  # whatever the user's function raises is its verifier's failure, in its own words
        traceback.print_exc()
        return ERROR
    if isinstance(result, bool):
        result = float(result)
    if not isinstance(result, int | float):
        print(f"{argv[0]} returned {type(result).__name__}, not a bool or a number in [0, 1]", file=sys.stderr)
        return ERROR
    print(json.dumps({"score": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
