"""SGLang's distributed weight update: a trainer beside the engines (rank 0) broadcasts new parameters over a
torch.distributed group the engine joins (`/init_weights_update_group`), one tensor per name and in the order
named (`/update_weights_from_distributed`). The engine is rank `rank_offset` (it runs no tensor parallelism).
Gloo on CPU, NCCL on GPUs; one group at a time, since the group is the process's default one.

Owns the group and the receiving; knows nothing about HTTP. Every call blocks (a rendezvous, a broadcast):
the routes run them off the event loop.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist

from reefd.worker.params import BadRequest

log = logging.getLogger("reefd.worker")
BACKENDS = ("gloo", "nccl")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class WeightGroup:
    """The weight-update group this worker has joined, if any."""

    def __init__(self, device: torch.device, timeout_s: float = 600.0) -> None:
        self.device, self.timeout_s = device, timeout_s
        self.name: str | None = None

    def join(self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
             backend: str) -> None:
        if self.name is not None:
            raise BadRequest(f"this engine is in weight update group {self.name!r}; destroy it first")
        if backend not in BACKENDS:
            raise BadRequest(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
        if not 0 < rank_offset < world_size:
            raise BadRequest(f"rank_offset {rank_offset} is outside 1..{world_size - 1} (the trainer is rank 0)")
        try:
            dist.init_process_group(backend=backend, init_method=f"tcp://{master_address}:{master_port}",
                                    world_size=world_size, rank=rank_offset,
                                    timeout=datetime.timedelta(seconds=self.timeout_s))
        except (RuntimeError, ValueError) as exc:
            raise BadRequest(f"cannot join the weight update group at {master_address}:{master_port}: {exc}") from None
        self.name = group_name
        log.info("joined weight update group %s as rank %d of %d (%s)", group_name, rank_offset, world_size, backend)

    def receive(self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]]
                ) -> dict[str, torch.Tensor]:
        """The named tensors, as rank 0 broadcasts them in this order."""
        self._check(group_name)
        out: dict[str, torch.Tensor] = {}
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            tensor = torch.empty(shape, dtype=DTYPES[dtype], device=self.device)
            try:
                dist.broadcast(tensor, src=0)
            except RuntimeError as exc:
                raise BadRequest(f"the broadcast of {name} failed: {exc}") from None
            out[name] = tensor
        return out

    def leave(self, group_name: str) -> None:
        self._check(group_name)
        dist.destroy_process_group()
        self.name = None

    def _check(self, group_name: str) -> None:
        if self.name is None or group_name != self.name:
            raise BadRequest(f"no weight update group {group_name!r} (joined: {self.name or 'none'})")


def parse_update(body: Any) -> tuple[str, list[str], list[str], list[list[int]]]:
    """UpdateWeightsFromDistributedReqInput: names, dtypes, shapes (older releases: one name, dtype, shape)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if names is None and "name" in body:
        names, dtypes, shapes = [body.get("name")], [body.get("dtype")], [body.get("shape")]
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise BadRequest("names must be a non-empty list of parameter names")
    if not isinstance(dtypes, list) or len(dtypes) != len(names) or any(d not in DTYPES for d in dtypes):
        raise BadRequest(f"dtypes must name one of {', '.join(DTYPES)} per name")
    if not isinstance(shapes, list) or len(shapes) != len(names) or not all(
            isinstance(s, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in s)
            for s in shapes):
        raise BadRequest("shapes must give one list of sizes per name")
    group = body.get("group_name", "weight_update_group")
    if not isinstance(group, str):
        raise BadRequest("group_name must be a string")
    return group, names, dtypes, shapes
