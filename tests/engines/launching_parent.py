"""`python -m tests.engines.launching_parent OUT`: a stand-in for reefd that launches the child through the fork
server (as reefd launches its worker), prints the child's pid once it is forked, and waits to be killed."""

from __future__ import annotations

import asyncio
import sys

from reefd.engines import launch as launching


async def main(out: str) -> None:
    launching.FORKED = frozenset({"tests.engines.launched_child"})
    proc = await launching.launch([sys.executable, "-m", "tests.engines.launched_child", out, "0", "600"], None)
    print(proc.pid, flush=True)
    await asyncio.sleep(600)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
