"""Runtime LoRA adapters and weight reload: in-process batcher and a real worker subprocess."""

from __future__ import annotations

import asyncio
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from reefd.worker.batcher import Batcher
from reefd.worker.model import Model
from reefd.worker.params import BadRequest, parse_generate
from tests.loras import make_lora
from tests.worker.support import Worker
from tests.worker.test_batcher import collect, run

# peft 0.21 still reads transformers' deprecated `is_gradient_checkpointing` (a FutureWarning)
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
PROMPTS = [[5, 17, 99], [300, 2, 41, 41, 7, 8, 120, 64, 11], [77, 78]]
N = 8


def make_adapter(base: Path, out: Path, seed: int, targets: tuple[str, ...] = ("q_proj", "v_proj")) -> Path:
    """A real PEFT LoRA (r=4) for the tiny model, with lora_B perturbed so that outputs change."""
    return make_lora(base, out, seed=seed, scale=2.0, target_modules=list(targets))


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"a": make_adapter(tiny_model, root / "a", 1), "b": make_adapter(tiny_model, root / "b", 2)}


@torch.inference_mode()
def peft_greedy(base: Path, adapter: Path | None, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by full forward passes of a fresh (Peft)Model: no cache, no batching."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(base, local_files_only=True).float().eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).eval()
    ids, out = list(prompt), []
    for _ in range(n):
        token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        out.append(token)
        ids.append(token)
    return out


@pytest.fixture(scope="module")
def references(tiny_model: Path, adapters: dict[str, Path]) -> dict[str | None, list[list[int]]]:
    out: dict[str | None, list[list[int]]] = {}
    for name, path in [(None, None), *adapters.items()]:
        out[name] = [peft_greedy(tiny_model, path, p, N) for p in PROMPTS]
    return out


def body(prompt: list[int], lora: str | None = None, n: int = N) -> dict[str, Any]:
    b: dict[str, Any] = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }
    if lora is not None:
        b["lora_path"] = lora
    return b


def test_adapters_change_outputs(references: dict[str | None, list[list[int]]]) -> None:
    assert references["a"] != references[None] and references["b"] != references[None]
    assert references["a"] != references["b"]


def test_mixed_batch_in_process(tiny_model: Path, adapters: dict[str, Path], references: Any) -> None:
    """Base and two adapters in one batch: every row equals its own unbatched PEFT reference."""
    engine = Model(tiny_model, device="cpu")
    engine.load_adapter("a", adapters["a"])
    engine.load_adapter("b", adapters["b"])
    reqs = [(parse_generate(body(p, lora)), p) for lora in (None, "a", "b") for p in PROMPTS]

    results, batcher = run(engine, reqs, max_batch=16)
    got = [r["ids"] for r in results]
    assert got == references[None] + references["a"] + references["b"]
    assert batcher.stats.max_running == len(reqs)  # really one mixed batch
    engine.unload_adapter("a")
    engine.unload_adapter("b")
    assert engine.adapters == {} and engine.lora.slot == {}


def test_adapters_of_other_ranks_targets_and_scalings_batch_with_the_rest(tiny_model: Path, adapters: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    """Rank 8 on every Linear with rsLoRA, rank 2 on o_proj with an alpha_pattern, and rank 4 on q/v, in one batch
    with base rows: each row equals its unbatched PEFT reference (ranks zero-padded, PEFT's scaling per module).
    Unloading one frees its slot for the next adapter, which then reads its own factors alone."""
    wide = make_lora(tiny_model, tmp_path / "wide", seed=5, scale=1.0, r=8, lora_alpha=4, use_rslora=True,
                     target_modules="all-linear")
    narrow = make_lora(tiny_model, tmp_path / "narrow", seed=6, scale=3.0, r=2, lora_alpha=2,
                       target_modules=["o_proj"], alpha_pattern={"o_proj": 6})
    folders = {"a": adapters["a"], "wide": wide, "narrow": narrow}
    refs = {name: [peft_greedy(tiny_model, folder, p, N) for p in PROMPTS] for name, folder in folders.items()}
    refs[None] = [peft_greedy(tiny_model, None, p, N) for p in PROMPTS]
    assert len({str(r) for r in refs.values()}) == 4  # four different models
    engine = Model(tiny_model, device="cpu")
    for name, folder in folders.items():
        engine.load_adapter(name, folder)
    order: list[str | None] = [None, "wide", "a", "narrow"]
    reqs = [(parse_generate(body(p, lora)), p) for lora in order for p in PROMPTS]
    results, batcher = run(engine, reqs, max_batch=16)
    assert [r["ids"] for r in results] == [ids for lora in order for ids in refs[lora]]
    assert batcher.stats.max_running == len(reqs)
    slot = engine.lora.slot["wide"]
    engine.unload_adapter("wide")
    engine.load_adapter("b", adapters["b"])
    assert engine.lora.slot["b"] == slot  # the freed slot, with nothing of wide's left in it
    b_refs = [peft_greedy(tiny_model, adapters["b"], p, N) for p in PROMPTS]
    results, _ = run(engine, [(parse_generate(body(p, "b")), p) for p in PROMPTS], max_batch=16)
    assert [r["ids"] for r in results] == b_refs


def test_uniform_batches_switch_adapters_and_keep_every_row_exact(tiny_model: Path, adapters: dict[str, Path],
                                                                  references: Any) -> None:
    """Batches on one adapter, switching between adapters, unloading one, and base rows beside loaded adapters:
    every row exact."""
    engine = Model(tiny_model, device="cpu")
    engine.load_adapter("a", adapters["a"])
    engine.load_adapter("b", adapters["b"])
    for lora in ("a", "b", "b", "a", None):
        results, _ = run(engine, [(parse_generate(body(p, lora)), p) for p in PROMPTS], max_batch=16)
        assert [r["ids"] for r in results] == references[lora], lora
    engine.unload_adapter("a")
    results, _ = run(engine, [(parse_generate(body(p, "b")), p) for p in PROMPTS], max_batch=16)
    assert [r["ids"] for r in results] == references["b"]
    with pytest.raises(RuntimeError, match="no LoRA adapter is loaded under \\['a'\\]"):
        engine.prefill([PROMPTS[0]], adapters=["a"])


@torch.inference_mode()
def peft_scores(base: Path, adapter: Path | None, ids: list[int]) -> torch.Tensor:
    """log_softmax of a fresh (Peft)Model's logits at every position of `ids`, one full forward pass."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(base, local_files_only=True).float().eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).eval()
    return model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_a_teacher_forced_probe_on_mixed_adapters_is_one_prefill_and_peft_s(tiny_model: Path,
                                                                             adapters: dict[str, Path]) -> None:
    """A release proof's requests: each prompt followed by the tokens to score, from the prompt's last token on,
    on the base and two adapters at once. One prefill; every position's logprob and best token are PEFT's."""
    engine = Model(tiny_model, device="cpu")
    engine.load_adapter("a", adapters["a"])
    engine.load_adapter("b", adapters["b"])
    tokens = [9, 10, 11, 12]
    probes = [(lora, p) for lora in (None, "a", "b") for p in PROMPTS]
    reqs = [(parse_generate({**body(p + tokens, lora, 1), "return_logprob": True, "logprob_start_len": len(p) - 1,
                             "top_logprobs_num": 1}), p + tokens) for lora, p in probes]
    results, batcher = run(engine, reqs, max_batch=16)
    assert batcher.stats.prefills == 1
    for (lora, prompt), result in zip(probes, results, strict=True):
        ref = peft_scores(tiny_model, adapters[lora] if lora else None, prompt + tokens)
        at = range(len(prompt) - 1, len(prompt) - 1 + len(tokens))
        entries, tops = result["input_logprobs"][1:], result["input_top_logprobs"][1:]
        assert [t for _, t, _ in entries] == tokens
        want = [float(ref[i, t]) for i, t in zip(at, tokens, strict=True)]
        assert [lp for lp, _, _ in entries] == pytest.approx(want, abs=1e-4)
        assert [row[0][1] for row in tops] == [int(ref[i].argmax()) for i in at]


def test_test_faults_named_in_a_file_apply_to_the_loads_after(tiny_model: Path, adapters: dict[str, Path],
                                                              tmp_path: Path) -> None:
    """`--fault-file`: the fault the file names at an adapter's first load, none while it is empty, and the same
    at its loads after (reefd trying the release again); scaled-layer makes the first decoder layer's LoRA 1.1
    times too strong, shift-logprobs marks the adapter's answers."""
    engine = Model(tiny_model, device="cpu")
    engine.fault_file = tmp_path / "fault"
    engine.load_adapter("clean", adapters["a"])
    engine.fault_file.write_text("scaled-layer\n")
    engine.load_adapter("scaled", adapters["a"])
    engine.fault_file.write_text("shift-logprobs")
    engine.load_adapter("shifted", adapters["b"])
    engine.fault_file.write_text("")
    engine.load_adapter("later", adapters["b"])
    engine.unload_adapter("scaled")
    engine.load_adapter("scaled", adapters["a"])
    clean, scaled = engine.lora.slot["clean"], engine.lora.slot["scaled"]
    for name, factors in engine.lora.layers.items():
        ratio = 1.1 if ".layers.0." in name else 1.0
        assert torch.allclose(factors.b[scaled], factors.b[clean] * ratio), name
    assert engine.shifted == {"shifted"}
    engine.unload_adapter("shifted")
    assert engine.shifted == set()
    engine.load_adapter("shifted", adapters["b"])
    assert engine.shifted == {"shifted"}


def test_engine_refuses_bad_adapters(tiny_model: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    engine = Model(tiny_model, device="cpu")
    wrong_target = make_adapter(tiny_model, tmp_path / "wt", 3)
    config = json.loads((wrong_target / "adapter_config.json").read_text())
    config["target_modules"] = ["nope_proj"]
    (wrong_target / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(BadRequest, match="nope_proj"):
        engine.load_adapter("x", wrong_target)
    with pytest.raises(BadRequest, match="missing: not a folder"):
        engine.load_adapter("x", tmp_path / "missing")
    with pytest.raises(BadRequest, match="no adapter"):
        engine.unload_adapter("x")
    assert engine.adapters == {} and engine.lora.slot == {} and engine.lora.layers == {}


def bad_adapters(tiny_model: Path, good: Path, root: Path) -> dict[str, Path]:
    from safetensors.torch import load_file, save_file

    out: dict[str, Path] = {}
    wrong = make_adapter(tiny_model, root / "wrong_module", 4, targets=("q_proj",))
    config = json.loads((wrong / "adapter_config.json").read_text())
    config["target_modules"] = ["nope_proj"]
    (wrong / "adapter_config.json").write_text(json.dumps(config))
    out["wrong_module"] = wrong
    shape = root / "wrong_shape"
    shutil.copytree(good, shape)
    tensors = load_file(str(good / "adapter_model.safetensors"))
    key = next(k for k in tensors if "lora_A" in k)
    tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 3)
    save_file(tensors, str(shape / "adapter_model.safetensors"))
    out["wrong_shape"] = shape
    corrupt = root / "corrupt"
    shutil.copytree(good, corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    out["corrupt"] = corrupt
    out["missing"] = root / "does-not-exist"
    return out


def perturbed_copy(tiny_model: Path, out: Path) -> Path:
    from transformers import AutoModelForCausalLM

    shutil.copytree(tiny_model, out)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    model.save_pretrained(out)
    return out


def test_worker_lora_and_weights(
    tiny_model: Path,
    adapters: dict[str, Path],
    references: dict[str | None, list[list[int]]],
    tmp_path: Path,
) -> None:
    worker = Worker(tiny_model, tmp_path / "worker.log", ["--max-batch", "8", "--threads", "1"]).start()
    try:
        _exercise(worker, tiny_model, adapters, references, tmp_path)
    finally:
        code = worker.stop()
    assert code == 0, worker.logs()


def _gen(worker: Worker, prompt: list[int], lora: str | None = None) -> list[int]:
    status, answer = worker.post("/generate", body(prompt, lora))
    assert status == 200, answer
    return list(answer["output_ids"])


def _exercise(worker: Worker, tiny_model: Path, adapters: dict[str, Path], references: Any, tmp_path: Path) -> None:
    p = PROMPTS[1]
    # an unknown adapter is a 400; the base serves as before
    status, answer = worker.post("/generate", body(p, "a"))
    assert status == 400, answer
    assert _gen(worker, p) == references[None][1]

    status, answer = worker.post("/load_lora_adapter", {"lora_name": "a", "lora_path": str(adapters["a"])})
    assert status == 200, answer
    assert answer == {"success": True, "error_message": None, "loaded_adapters": {"a": str(adapters["a"])}}
    status, answer = worker.post("/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapters["b"])})
    assert status == 200 and set(answer["loaded_adapters"]) == {"a", "b"}, answer
    status, info = worker.get("/server_info")
    assert status == 200 and set(json.loads(info)["loaded_adapters"]) == {"a", "b"}

    assert _gen(worker, p, "a") == references["a"][1]
    assert _gen(worker, p) == references[None][1]

    # OpenAI chat: `model: "base:adapter"` or `lora_path` picks the adapter, as SGLang
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}
    answers = {}
    for key, extra in [("base", {}), ("model", {"model": "tiny:a"}), ("lora", {"lora_path": "a"})]:
        status, answer = worker.post("/v1/chat/completions", {**chat, **extra})
        assert status == 200, answer
        answers[key] = answer["choices"][0]["message"]["content"]
    assert answers["model"] == answers["lora"]
    status, answer = worker.post("/v1/chat/completions", {**chat, "lora_path": "zzz"})
    assert status == 400, answer

    # a mixed batch: concurrent base and adapter requests each get their lone answer
    jobs = [(prompt, lora) for prompt in PROMPTS for lora in (None, "a", "b")]
    before = worker.stats()["max_running"]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: _gen(worker, j[0], j[1]), jobs))
    for (prompt, lora), ids in zip(jobs, got, strict=True):
        assert ids == references[lora][PROMPTS.index(prompt)], (prompt, lora)
    assert worker.stats()["max_running"] >= max(before, 1)

    # invalid adapters: 400 in SGLang's shape, nothing changes, still serving
    for kind, path in bad_adapters(tiny_model, adapters["a"], tmp_path / "bad").items():
        status, answer = worker.post("/load_lora_adapter", {"lora_name": kind, "lora_path": str(path)})
        assert status == 400, (kind, answer)
        assert answer["success"] is False and answer["error_message"], kind
        assert set(answer["loaded_adapters"]) == {"a", "b"}, kind
    status, answer = worker.post("/load_lora_adapter", {"lora_name": "a", "lora_path": str(adapters["b"])})
    assert status == 400 and "already loaded" in answer["error_message"]
    assert _gen(worker, p, "b") == references["b"][1]

    # unload: unknown name is a 400; after unloading, the name is refused and others still work
    status, answer = worker.post("/unload_lora_adapter", {"lora_name": "zzz"})
    assert status == 400 and answer["success"] is False
    status, answer = worker.post("/unload_lora_adapter", {"lora_name": "a"})
    assert status == 200 and answer["loaded_adapters"] == {"b": str(adapters["b"])}, answer
    status, _ = worker.post("/generate", body(p, "a"))
    assert status == 400
    assert _gen(worker, p, "b") == references["b"][1]
    status, answer = worker.post("/unload_lora_adapter", {"lora_name": "b"})
    assert status == 200 and answer["loaded_adapters"] == {}
    assert _gen(worker, p) == references[None][1]

    # weight reload: a bad path is a 400 and changes nothing; a perturbed copy changes outputs
    status, answer = worker.post("/update_weights_from_disk", {"model_path": str(tmp_path / "nothing")})
    assert status == 400 and answer["success"] is False and answer["message"], answer
    assert _gen(worker, p) == references[None][1]
    other = perturbed_copy(tiny_model, tmp_path / "perturbed")
    expected = peft_greedy(other, None, p, N)
    assert expected != references[None][1]
    status, answer = worker.post("/update_weights_from_disk", {"model_path": str(other), "weight_version": "v2"})
    assert status == 200, answer
    assert answer == {"success": True, "message": answer["message"], "num_paused_requests": 0}
    assert _gen(worker, p) == expected
    status, info = worker.get("/server_info")
    assert json.loads(info)["weight_version"] == "v2"


def test_load_and_unload_between_steps_while_requests_run(
    tiny_model: Path, adapters: dict[str, Path], references: dict[str | None, list[list[int]]]
) -> None:
    """A load lands between decode steps of a running adapter request, which goes on unchanged;
    an unload of an adapter in use waits until its request finished (SGLang's behaviour)."""
    engine = Model(tiny_model, device="cpu")
    engine.load_adapter("a", adapters["a"])
    long_n = 40

    async def main() -> tuple[dict[str, Any], list[str], int]:
        batcher = Batcher(engine, max_batch=8, threads=1)
        batcher.start()
        try:
            prompt = PROMPTS[1]
            req = parse_generate({**body(prompt, "a", long_n), "stream": True})
            job = batcher.submit(req, prompt)
            first = await job.queue.get()  # the request is running now
            assert first.finish is None
            order: list[str] = []
            await batcher.control(lambda: engine.load_adapter("b", adapters["b"]))
            order.append("loaded b")
            assert "a" in engine.adapters  # the running request's adapter is still there
            unload = asyncio.ensure_future(
                batcher.control(lambda: engine.unload_adapter("a"), ready=lambda: not batcher.uses_adapter("a"))
            )
            rest = await collect(job)
            order.append("request done")
            await unload
            order.append("unloaded a")
            ids = first.new_ids + rest["ids"]
            return {"ids": ids}, order, batcher.stats.decode_steps
        finally:
            batcher.stop()

    result, order, _ = asyncio.run(main())
    assert order == ["loaded b", "request done", "unloaded a"]
    expected = peft_greedy(tiny_model, adapters["a"], PROMPTS[1], long_n)
    assert expected[:N] == references["a"][1]
    assert result["ids"] == expected
    assert set(engine.adapters) == {"b"}
