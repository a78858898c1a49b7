"""A trainer beside the engines, as rank 0 of a weight update group: it joins the group and broadcasts the
tensors of a safetensors file, sorted by name (the order the engine was told). Used by the weight sync tests:
python -m tests.worker.weight_trainer --port P --world N --weights FILE"""

from __future__ import annotations

import argparse
import datetime

import torch.distributed as dist
from safetensors.torch import load_file


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--weights", required=True)
    args = ap.parse_args()
    tensors = load_file(args.weights)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", world_size=args.world, rank=0,
                            timeout=datetime.timedelta(seconds=120))
    for name in sorted(tensors):
        dist.broadcast(tensors[name].contiguous(), src=0)
    dist.destroy_process_group()
    print("broadcast", len(tensors), flush=True)


if __name__ == "__main__":
    main()
