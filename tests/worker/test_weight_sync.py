"""SGLang's distributed weight update (`init_weights_update_group` + `update_weights_from_distributed`) through
reefd's engine client, against the real worker and a real trainer process as rank 0 of a gloo group.

Contract test: in production the group is NCCL between GPU trainers (slime) and SGLang servers. Here it is the
same protocol over gloo on CPU: the worker joins as rank 1, receives every tensor, serves it as the weight version
named, and answers exactly as when it loads the same weights from disk.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from safetensors.torch import load_file

from reefd.engines import EngineError, ModelConfig
from reefd.engines.sglang import SGLangEngine
from reefd.engines.sglang_client import SGLangClient
from reefd.serve.chat import ChatRequest, Completion
from tests.conftest import free_port
from tests.loras import make_weights
from tests.served import ROOT
from tests.worker.support import Worker

pytestmark = [pytest.mark.contract, pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]


async def greedy(engine: SGLangEngine) -> Completion:
    req = ChatRequest(messages=[{"role": "user", "content": "tell me a story"}], max_tokens=8, temperature=0.0)
    async for event in engine.generate(req, stream=False):
        if isinstance(event, Completion):
            return event
    raise AssertionError("no completion")


def test_weights_from_a_trainer_beside_the_engine(tiny_model: Path, tmp_path: Path) -> None:
    weights = make_weights(tiny_model, tmp_path / "weights", seed=1, scale=0.5)
    tensors = load_file(str(weights / "model.safetensors"))
    names = sorted(tensors)
    dtypes = [str(tensors[n].dtype).removeprefix("torch.") for n in names]
    shapes = [list(tensors[n].shape) for n in names]

    async def go(url: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with aiohttp.ClientSession() as session:
            engine = SGLangEngine(ModelConfig(name="t", engine="sglang", url=url, path=str(tiny_model)),
                                  tiny_model, session)
            await engine.start()
            while not engine.ready:
                await asyncio.sleep(0.05)
            out["base"] = (await greedy(engine)).completion_logprobs
            with pytest.raises(EngineError, match="no weight update group"):
                await engine.update_weights_from_distributed(names, dtypes, shapes, version="r1-0000000", path=None)
            port = free_port()
            world = engine.weight_group_size()
            trainer = subprocess.Popen([sys.executable, "-m", "tests.worker.weight_trainer", "--port", str(port),
                                        "--world", str(world), "--weights", str(weights / "model.safetensors")],
                                       cwd=ROOT, stdout=subprocess.PIPE, text=True)
            try:
                assert await engine.join_weight_group("127.0.0.1", port, backend="gloo") == 2
                report = await engine.update_weights_from_distributed(names, dtypes, shapes, version="r7-abcdef0",
                                                                      path=weights)
                out["trainer"] = trainer.communicate(timeout=60)[0]
            finally:
                trainer.kill()
            out["report"] = report
            client = SGLangClient(session, url)
            out["version"] = await client.weight_version()
            got = await greedy(engine)
            out["pushed"], out["pushed_version"] = got.completion_token_ids, got.weight_version
            out["pushed_logprobs"] = got.completion_logprobs
            await engine.leave_weight_group()
            # the same weights from disk answer the same
            await client.update_weights_from_disk(weights, "r8-abcdef0")
            disk = await greedy(engine)
            out["disk"], out["disk_logprobs"] = disk.completion_token_ids, disk.completion_logprobs
            await engine.stop()
        return out

    worker = Worker(tiny_model, tmp_path / "worker.log", ["--threads", "1"]).start()
    try:
        out = asyncio.run(go(worker.url))
    finally:
        worker.stop()
    assert out["trainer"].strip() == f"broadcast {len(names)}"
    assert out["report"]["source"] == "distributed" and out["report"]["replicas"] == 1
    assert out["version"] == (True, "r7-abcdef0") and out["pushed_version"] == "r7-abcdef0"
    assert not torch.allclose(torch.tensor(out["pushed_logprobs"]), torch.tensor(out["base"]), atol=1e-3)
    assert out["pushed"] == out["disk"]
    assert torch.allclose(torch.tensor(out["pushed_logprobs"]), torch.tensor(out["disk_logprobs"]), atol=1e-5)


def test_bad_weight_group_requests_are_refused_in_sglangs_shape(worker: Worker) -> None:
    code, body = worker.post("/update_weights_from_distributed", {"names": ["lm_head.weight"], "dtypes": ["float32"],
                                                                  "shapes": [[4, 4]]})
    assert code == 400 and body == {"success": False,
                                    "message": "no weight update group 'weight_update_group' (joined: none)"}
    code, body = worker.post("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                            "rank_offset": 1, "world_size": 2, "backend": "mpi"})
    assert code == 400 and "backend 'mpi' is not one of gloo, nccl" in body["message"]
    code, body = worker.post("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                            "rank_offset": 2, "world_size": 2, "backend": "gloo"})
    assert code == 400 and "rank_offset 2 is outside 1..1" in body["message"]
    code, body = worker.post("/update_weights_from_distributed", {"names": ["x"], "dtypes": ["int8"],
                                                                  "shapes": [[1]]})
    assert code == 400 and "dtypes must name one of" in body["message"]
    code, body = worker.post("/destroy_weights_update_group", {"group_name": "weight_update_group"})
    assert code == 400 and body["success"] is False
