"""Multi-LoRA serving: adapters made by the real `peft` package, with random non-zero A and B
(alpha != r, rsLoRA, ranks 2..16, different target modules), give the engine's fp32 greedy tokens
equal to transformers + PEFT's, each adapter alone and in batches mixing adapters and the base
model (tp 1 and 2, fewer slots than adapters); the scheduler never puts more than max_loras
adapters in a step; prefix-cache blocks are keyed by adapter; bad adapters are refused with a
clear error while the engine serves on. One test runs the real SmolLM2-135M."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.helpers.lora import MAX_NEW, PROMPTS, SPECS, AdapterSpec, save_peft_adapters, tiny_llama_with_adapters
from tests.helpers.models import hf_greedy, save_tiny_llama
from tests.helpers.scheduler import add, make_request, make_scheduler, run_step, run_to_completion
from zllm import LLM, LoRARequest, SamplingParams
from zllm.config import EngineConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
ENGINE = dict(dtype="float32", enable_lora=True, max_lora_rank=16, kv_cache_memory_bytes=8 << 20)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(base model dir, adapters dir, reference tokens per adapter name and "base")."""
    return tiny_llama_with_adapters(tmp_path_factory.mktemp("lora"))


def lora_requests(adapters: Path) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(adapters / name)) for i, name in enumerate(SPECS)}


def generate(llm: LLM, pairs: list[tuple[str, list[int]]], loras: dict[str, LoRARequest]) -> list[list[int]]:
    """One generate call over (adapter name or "base", prompt) pairs."""
    outputs = llm.generate(
        [{"prompt_token_ids": ids} for _, ids in pairs],
        GREEDY,
        use_tqdm=False,
        lora_request=[loras.get(name) for name, _ in pairs],
    )
    return [o.outputs[0].token_ids for o in outputs]


def mixed_pairs(names: list[str]) -> list[tuple[str, list[int]]]:
    """Every (adapter, prompt), interleaved so that neighbours differ in adapter."""
    return [(name, ids) for ids in PROMPTS for name in names]


def expected(pairs, references) -> list[list[int]]:
    return [references[name][PROMPTS.index(ids)] for name, ids in pairs]


def test_each_adapter_alone_matches_peft(tiny):
    """One slot: adapters take turns in it; each prompt runs under the base model first, so a
    prefix cache not keyed by adapter would hand the adapters the base model's blocks."""
    model_dir, adapters, references = tiny
    loras = lora_requests(adapters)
    with LLM(str(model_dir), max_loras=1, **ENGINE) as llm:
        for name in ["base", *SPECS, "all-r8"]:
            pairs = [(name, ids) for ids in PROMPTS]
            assert generate(llm, pairs, loras) == references[name], name


@pytest.mark.parametrize("tp", [1, 2])
def test_mixed_batch_matches_each_alone(tiny, tp):
    model_dir, adapters, references = tiny
    pairs = mixed_pairs(["base", *SPECS])
    with LLM(str(model_dir), max_loras=4, tensor_parallel_size=tp, **ENGINE) as llm:
        assert generate(llm, pairs, lora_requests(adapters)) == expected(pairs, references)


def test_more_adapters_than_slots(tiny):
    """Four adapters, two device slots and two in host memory: requests wait for a slot, adapters
    are evicted and reloaded, the outputs stay exact."""
    model_dir, adapters, references = tiny
    pairs = mixed_pairs([*SPECS, "base"])
    with LLM(str(model_dir), max_loras=2, max_cpu_loras=2, **ENGINE) as llm:
        assert generate(llm, pairs, lora_requests(adapters)) == expected(pairs, references)


def test_scheduler_never_exceeds_max_loras():
    scheduler = make_scheduler(max_loras=2)
    requests = [make_request(f"r{i}", max_tokens=3) for i in range(8)]
    for i, request in enumerate(requests):
        request.lora = None if i % 4 == 3 else LoRARequest(f"a{i % 4}", i % 4 + 1, "/unused")
    add(scheduler, *requests)
    seen_steps = 0
    while scheduler.has_unfinished_requests():
        step = run_step(scheduler)
        adapters = {r.lora_id for r in scheduler.requests.values() if r.request_id in step.scheduled_ids} - {0}
        assert len(adapters) <= 2, step.scheduled_ids
        seen_steps += 1
        assert seen_steps < 100
    assert all(r.output_token_ids for r in requests)


def test_prefix_cache_blocks_are_keyed_by_adapter():
    """The same prompt under the base model, adapter 1, adapter 2 and adapter 1 again: only the
    last finds cached blocks (and all of its full ones)."""
    scheduler = make_scheduler(max_loras=2, enable_prefix_caching=True, max_num_batched_tokens=256)
    loras = [None, LoRARequest("a", 1, "/unused"), LoRARequest("b", 2, "/unused"), LoRARequest("a", 1, "/unused")]
    cached = []
    for i, lora in enumerate(loras):
        request = make_request(f"r{i}", prompt_len=13, max_tokens=1)
        request.lora = lora
        add(scheduler, request)
        run_to_completion(scheduler)
        cached.append(request.num_cached_tokens)
    assert cached == [0, 0, 0, 12]  # block size 4: three full blocks of the 13 tokens


def test_bad_adapters_are_refused_and_the_engine_serves_on(tiny, tmp_path):
    model_dir, adapters, references = tiny
    broken = {
        "no-config": _copy_without(adapters / "all-r8", tmp_path / "no-config", "adapter_config.json"),
        "garbage-weights": _with_file(adapters / "all-r8", tmp_path / "garbage", "adapter_model.safetensors", b"xx"),
        "dora": _with_config(adapters / "all-r8", tmp_path / "dora", use_dora=True),
    }
    wrong_base = save_tiny_llama(tmp_path / "wide", hidden_size=32, intermediate_size=64)
    _write_adapter_of(wrong_base, tmp_path / "wrong-shape")
    cases = {
        "rank 16 is above max_lora_rank (8)": LoRARequest("mlp-r16", 3, str(adapters / "mlp-r16")),
        "no adapter_config.json": LoRARequest("a", 10, str(broken["no-config"])),
        "is not a safetensors file": LoRARequest("b", 11, str(broken["garbage-weights"])),
        "use_dora is not supported": LoRARequest("c", 12, str(broken["dora"])),
        "adapts a 32 -> 32 projection, but the base model's is 64 -> 64": LoRARequest(
            "d", 13, str(tmp_path / "wrong-shape")
        ),
        "no adapter_config.json ": LoRARequest("e", 14, str(tmp_path / "missing")),
    }
    with LLM(str(model_dir), **(ENGINE | {"max_lora_rank": 8})) as llm:
        for message, lora in cases.items():
            with pytest.raises(ValueError, match=re.escape(message.strip())):
                llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False, lora_request=lora)
        good = LoRARequest("all-r8", 1, str(adapters / "all-r8"))
        pairs = [("base", PROMPTS[1]), ("all-r8", PROMPTS[2])]
        assert generate(llm, pairs, {"all-r8": good}) == expected(pairs, references)


def test_lora_modules_are_checked_at_start(tiny, tmp_path):
    model_dir, adapters, _ = tiny
    with pytest.raises(ValueError, match=r"lora_modules: big: .*rank 16 is above max_lora_rank \(4\)"):
        EngineConfig.create(
            str(model_dir), enable_lora=True, max_lora_rank=4, lora_modules={"big": str(adapters / "mlp-r16")}
        )
    with pytest.raises(ValueError, match="lora_modules: needs enable_lora"):
        EngineConfig.create(str(model_dir), lora_modules={"a": str(adapters / "all-r8")})
    with pytest.raises(ValueError, match="max_cpu_loras: must be >= max_loras"):
        EngineConfig.create(str(model_dir), enable_lora=True, max_loras=4, max_cpu_loras=2)


def test_a_request_for_an_adapter_without_enable_lora_is_refused(tiny):
    model_dir, adapters, _ = tiny
    with LLM(str(model_dir), dtype="float32", kv_cache_memory_bytes=8 << 20) as llm:
        with pytest.raises(ValueError, match="lora_request: this engine serves no LoRA adapters"):
            llm.generate("hi", GREEDY, lora_request=lora_requests(adapters)["all-r8"])


@pytest.mark.slow
def test_smollm2_adapters_match_peft(smollm2_dir, hf_smollm2, smollm2_tokenizer, tmp_path):
    """The real SmolLM2-135M: two adapters and the base model in one batch, each equal to
    transformers + PEFT."""
    ids = smollm2_tokenizer.encode("My favourite colour is")
    specs = {
        "all-r8": AdapterSpec(r=8, alpha=32, std=0.08),
        "qv-rslora": AdapterSpec(r=4, alpha=2, targets=["q_proj", "v_proj"], rslora=True, std=0.3),
    }
    max_new = 6
    references = {"base": [hf_greedy(hf_smollm2, ids, max_new, None)]}
    references |= save_peft_adapters(hf_smollm2, tmp_path, specs, [ids], max_new)
    assert all(references[name] != references["base"] for name in specs), references
    loras = {name: LoRARequest(name, i + 1, str(tmp_path / name)) for i, name in enumerate(specs)}
    with LLM(smollm2_dir, dtype="float32", enable_lora=True, max_loras=2, kv_cache_memory_bytes=64 << 20) as llm:
        outputs = llm.generate(
            [{"prompt_token_ids": ids}] * 3,
            SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True),
            use_tqdm=False,
            lora_request=[None, loras["all-r8"], loras["qv-rslora"]],
        )
    assert [o.outputs[0].token_ids for o in outputs] == [references[n][0] for n in ("base", *specs)]


def _copy_without(source: Path, target: Path, name: str) -> Path:
    shutil.copytree(source, target)
    (target / name).unlink()
    return target


def _with_file(source: Path, target: Path, name: str, content: bytes) -> Path:
    shutil.copytree(source, target)
    (target / name).write_bytes(content)
    return target


def _with_config(source: Path, target: Path, **changes) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "adapter_config.json").read_text())
    (target / "adapter_config.json").write_text(json.dumps(config | changes))
    return target


def _write_adapter_of(model_dir: Path, target: Path) -> None:
    """A valid adapter of another base model (hidden size 32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    save_peft_adapters(model, target.parent, {target.name: AdapterSpec(r=4, alpha=8, targets=["q_proj"])}, [], 0)
