"""What the fork server imports once, before it forks engine workers (reefd/engines/launch.py): the worker's
modules and the libraries behind them, with transformers' model code (about 3 s of CPU a worker skips here).
It runs no torch operation and touches no device, so no thread pool or CUDA context exists to break in a fork."""

from __future__ import annotations

import importlib
import os

from reefd.engines.launch import die_with_parent

MODULES = ("torch", "transformers.modeling_utils", "transformers.generation.utils", "aiohttp.web",
           "reefd.worker.batcher", "reefd.worker.server", "reefd.worker.wire")

# The fork server goes when reefd goes, even by SIGKILL, and takes the workers it forked with it (each has
# SIGTERM on its own parent's death): they hold its liveness pipe, so reefd's end closing would not end it.
die_with_parent()
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read at import: local folders only, as the worker itself sets it
for name in MODULES:
    importlib.import_module(name)
