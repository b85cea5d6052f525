"""Model coverage: tiny random checkpoints of every registered architecture, made with
transformers' own classes, give the engine's greedy tokens equal to HF generate exactly (fp32,
CPU); sharded checkpoints equal single files; a GGUF file loads like its conversion; bad
checkpoints fail at LLM construction with errors naming the file and tensor."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers.engine import PROMPTS, count_row_steps, engine_generate_all
from tests.helpers.models import TINY_ARCHITECTURES, hf_greedy, save_tiny_llama, save_tiny_model
from tests.helpers.server import start_server
from zllm import LLM, LLMEngine, SamplingParams
from zllm.model_spec import VISION_ARCHITECTURES
from zllm.workers.models import MODEL_REGISTRY
from zllm.workers.weight_loader import checkpoint_files

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

CASES = {  # name: (architecture, config overrides)
    "llama": ("llama", {}),
    "llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),  # Llama 3.2 1B/3B, SmolLM2
    "llama-mha-head-dim": ("llama", {"num_key_value_heads": 4, "head_dim": 32}),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "mistral": ("mistral", {"sliding_window": 128, "head_dim": 32}),
    "mistral-window": ("mistral", {"sliding_window": 16, "head_dim": 32}),  # prompts and outputs past it
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),  # q/k/v bias, no o_proj bias
    "qwen3": ("qwen3", {"head_dim": 32}),  # q/k RMSNorm, head_dim apart from hidden/heads
    "qwen3-bias": ("qwen3", {"attention_bias": True, "head_dim": 16}),
    # Mixture of experts: expert counts, top-k 1/2/4, odd expert sizes, shared expert on/off,
    # dense layers between sparse ones.
    "mixtral-8x2": ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 40}),
    "mixtral-top1": ("mixtral", {"num_local_experts": 3, "num_experts_per_tok": 1, "intermediate_size": 37}),
    "qwen2-moe-shared": (
        "qwen2_moe",
        {
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 24,
            "shared_expert_intermediate_size": 56,
        },
    ),
    "qwen2-moe-sparse-step": (
        "qwen2_moe",
        {
            "num_experts": 5,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 19,
            "shared_expert_intermediate_size": 0,
            "norm_topk_prob": True,
            "decoder_sparse_step": 2,
            "num_hidden_layers": 3,
        },
    ),
    "qwen3-moe": (
        "qwen3_moe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 24,
            "norm_topk_prob": True,
            "head_dim": 32,
        },
    ),
    "qwen3-moe-mlp-only": (
        "qwen3_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 33,
            "norm_topk_prob": False,
            "mlp_only_layers": [0],
            "num_hidden_layers": 3,
        },
    ),
    # Sliding windows shorter than the longer prompts; more in tests/test_windowed_models.py.
    "gemma2": ("gemma2", {"sliding_window": 16, "num_hidden_layers": 4, "head_dim": 16}),  # soft-capped
    "gemma2-untied": ("gemma2", {"sliding_window": 16, "head_dim": 32, "query_pre_attn_scalar": 20}),
    "gemma3": (
        "gemma3",
        {
            "sliding_window": 16,
            "num_hidden_layers": 4,
            "sliding_window_pattern": 2,
            "head_dim": 16,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        },
    ),
    "phi3": ("phi3", {"sliding_window": 16}),  # fused qkv_proj and gate_up_proj in the checkpoint
    "phi3-mha-no-window": ("phi3", {"num_key_value_heads": 4}),
    # Phi-4-mini's kind: rotary over 3/4 of each head; LongRoPE's short factors (max_model_len is
    # the original length; the long ones: tests/test_windowed_models.py).
    "phi3-partial-longrope": (
        "phi3",
        {
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 512,
            "rope_scaling": {
                "rope_type": "longrope",
                "short_factor": [1.0, 1.1, 1.5, 2.0, 3.0, 4.0],
                "long_factor": [2.0, 4.0, 8.0, 16.0, 32.0, 64.0],
            },
        },
    ),
}


def _hf_generate_all(model_dir, prompts, max_new_tokens):
    import torch
    from transformers import AutoModelForCausalLM

    config = json.loads((Path(model_dir) / "config.json").read_text())
    # MoE: HF's expert-by-expert loop, the reference (its grouped-GEMM path refuses odd sizes on CPU).
    moe = {"experts_implementation": "eager"} if "num_experts" in config or "num_local_experts" in config else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **moe).eval()
    return [hf_greedy(model, p, max_new_tokens, eos_token_id=None) for p in prompts]


def test_every_registered_architecture_is_tested():
    """Here, or in the files of the families with their own tests (DeepSeek's MLA,
    tests/test_deepseek_models.py; GPT-OSS, tests/test_gpt_oss_model.py; the vision-language
    models, tests/test_vision_models.py, whose cases name each tower's kind)."""
    from tests.test_deepseek_models import CASES as DEEPSEEK_CASES
    from tests.test_vision_models import test_greedy_tokens_equal_transformers as vision_test

    cases = [*CASES.values(), *DEEPSEEK_CASES.values(), ("gpt_oss", {})]
    vision_kinds = {args[0] for mark in vision_test.pytestmark if mark.name == "parametrize" for args in mark.args[1]}
    vision = {arch for arch, kind in VISION_ARCHITECTURES.items() if kind in vision_kinds}
    assert {TINY_ARCHITECTURES[arch][1] for arch, _ in cases} | vision == set(MODEL_REGISTRY)


@pytest.mark.parametrize("case", sorted(CASES))
def test_tiny_model_matches_hf(tmp_path, case):
    architecture, overrides = CASES[case]
    model_dir = save_tiny_model(tmp_path, architecture, initializer_range=0.2, **overrides)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"][0] in MODEL_REGISTRY
    expected = _hf_generate_all(model_dir, PROMPTS, 20)
    assert engine_generate_all(model_dir, PROMPTS, 20) == expected  # block_size 16
    # A block size of 8 puts every prompt but the first across several blocks.
    assert engine_generate_all(model_dir, PROMPTS, 20, block_size=8) == expected


@pytest.mark.parametrize("case", sorted(CASES))
def test_prompt_tokens_as_decode_rows_match_hf(tmp_path, monkeypatch, case):
    """mixed_graph_max_tokens (on by default wherever CUDA graphs run): every step with prefill
    goes in as decode rows, each prompt token attending to the cache up to its own position,
    through each family's decode attention (sliding windows, soft-capping, partial rotary, MoE)."""
    architecture, overrides = CASES[case]
    model_dir = save_tiny_model(tmp_path, architecture, initializer_range=0.2, **overrides)
    expected = _hf_generate_all(model_dir, PROMPTS, 20)
    rows = count_row_steps(monkeypatch)
    assert engine_generate_all(model_dir, PROMPTS, 20, max_num_batched_tokens=32, mixed_graph_max_tokens=32) == expected
    assert any(rows)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_sharded_checkpoint_equals_single_file(tmp_path, architecture):
    single = save_tiny_model(tmp_path / "single", architecture, initializer_range=0.2)
    sharded = save_tiny_model(tmp_path / "sharded", architecture, shards=3, initializer_range=0.2)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(checkpoint_files(str(sharded))) >= 2
    assert engine_generate_all(sharded, PROMPTS, 12) == engine_generate_all(single, PROMPTS, 12)


def test_worker_process_serves_a_registered_architecture(tmp_path):
    """vllm-launch (frontend, engine core and worker processes) on a tiny Qwen3: HF's tokens."""
    from zllm import Client

    model_dir = save_tiny_model(tmp_path / "qwen3", "qwen3", initializer_range=0.2, head_dim=32)
    expected = _hf_generate_all(model_dir, PROMPTS[1:3], 16)
    handle = start_server(tmp_path, str(model_dir), "--dtype", "float32", "--max-model-len", "256")
    try:
        with Client(handle.endpoint) as client:
            params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
            outs = [client.generate(prompt_token_ids=ids, sampling_params=params) for ids in PROMPTS[1:3]]
    finally:
        handle.stop()
    assert [o.outputs[0].token_ids for o in outs] == expected


TP_CASES = {  # name: (architecture, tp, config overrides)
    # Each rank loads its slice of the q/k/v biases (Qwen2) or a copy of the q/k norms (Qwen3);
    # tp 3 splits 4 heads over 2 KV heads unevenly, replicating KV heads.
    "qwen2-tp2": ("qwen2", 2, {"head_dim": 32}),
    "qwen3-tp3": ("qwen3", 3, {"head_dim": 32}),
    # Gemma 3: Gemma's norms replicated, local and global layers, q/k norms at tp 2 (Phi-3's
    # fused tensors at tp 2: tests/test_windowed_models.py).
    "gemma3-tp2": ("gemma3", 2, CASES["gemma3"][1]),
    # MoE (gloo): each rank holds every expert's slice of the intermediate dimension (37 rows split
    # 19/18 for mixtral-top1) and the shared expert's; one all-reduce per MoE block.
    "mixtral-top1-tp2": ("mixtral", 2, CASES["mixtral-top1"][1]),
    "qwen2-moe-shared-tp2": ("qwen2_moe", 2, CASES["qwen2-moe-shared"][1]),
}


@pytest.mark.parametrize("case", sorted(TP_CASES))
def test_tensor_parallel_matches_hf(tmp_path, case):
    architecture, tp, overrides = TP_CASES[case]
    model_dir = save_tiny_model(tmp_path, architecture, initializer_range=0.2, **overrides)
    expected = _hf_generate_all(model_dir, PROMPTS, 16)
    llm = LLM(
        str(model_dir), dtype="float32", tensor_parallel_size=tp, max_model_len=256, kv_cache_memory_bytes=8 << 20
    )
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_moe_staggered_arrivals_with_prefix_hits_match_hf(tmp_path):
    """Requests join a running MoE batch one step apart and share a 32-token prefix (prefix-cache
    hits after the first; 8-token steps chunk the prompts): still HF's tokens."""
    architecture, overrides = CASES["qwen3-moe"]
    model_dir = save_tiny_model(tmp_path, architecture, initializer_range=0.2, **overrides)
    prefix = list(range(10, 42))
    prompts = [prefix + [100 + i, 7, 8 + i] for i in range(4)]
    expected = _hf_generate_all(model_dir, prompts, 12)
    engine = LLMEngine.from_engine_args(
        str(model_dir), dtype="float32", block_size=8, max_num_batched_tokens=16, enable_prefix_caching=True
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    results, cached, pending = {}, {}, list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending:
            i, ids = pending.pop(0)
            engine.add_request(str(i), {"prompt_token_ids": ids}, params)
        for out in engine.step():
            if out.finished:
                results[out.request_id], cached[out.request_id] = out.outputs[0].token_ids, out.num_cached_tokens
    assert [results[str(i)] for i in range(len(prompts))] == expected
    assert max(cached.values()) >= 24  # later requests found the shared prefix's full blocks cached


# Steps of exactly 16 and 48 tokens (a captured size: no padding) and of 3, 37, 45 and 10 (padded).
PIECE_PROMPTS = [list(range(20, 36)), *PROMPTS]


@pytest.mark.parametrize("case", ["mixtral-8x2", "qwen2-moe-shared"])
def test_moe_pieces_follow_the_unpieced_forward(tmp_path, case):
    """piecewise_cuda_graphs on a MoE model (on CPU the pieces run eagerly: the code the GPU
    captures). Each step through the pieces, padded to its captured size: the same caches outside
    its slots, bit for bit the model's own forward where nothing was padded, and over the run no
    further from a float64 forward of each step than the fp32 forward itself (CPU GEMMs too round
    differently over another row count: tests/helpers/pieces.py); the tokens are HF's."""
    import torch

    from tests.helpers.pieces import ErrorTally, WideReference, forward_from, unwritten_equal, watch_steps, written_rows
    from zllm.workers.piecewise_graphs import EagerPieces

    architecture, overrides = CASES[case]
    model_dir = save_tiny_model(tmp_path, architecture, initializer_range=0.2, **overrides)
    expected = _hf_generate_all(model_dir, PIECE_PROMPTS, 8)
    engine = LLMEngine.from_engine_args(  # a small cache: each step copies it a few times
        str(model_dir),
        dtype="float32",
        piecewise_cuda_graphs=True,
        max_num_batched_tokens=64,
        max_model_len=128,
        num_kv_blocks=32,
    )
    runner = engine.core.executor.runner
    assert isinstance(runner.pieces, EagerPieces)
    wide = WideReference(runner, torch.float64)
    hidden, written, exact_steps = ErrorTally("hidden states"), ErrorTally("cache entries written"), []

    def check(run, input_ids, positions, meta):
        saved = [c.clone() for c in runner.kv_caches]
        eager, eager_caches = forward_from(runner, saved, runner.model, input_ids, positions, runner.kv_caches, meta)
        exact, exact_caches = wide.forward(saved, input_ids, positions, meta)
        pieces, pieces_caches = forward_from(runner, saved, run, input_ids, positions, meta)
        step = (input_ids.shape[0], meta.num_decodes)
        assert all(unwritten_equal(c, s, meta.slot_mapping) for c, s in zip(pieces_caches, saved)), step
        if runner.pieces.bucket(input_ids.shape[0]) == input_ids.shape[0]:
            exact_steps.append(step)
            assert torch.equal(pieces, eager) and all(map(torch.equal, pieces_caches, eager_caches)), step
        hidden.add(pieces, eager, exact)
        for p, e, x in zip(pieces_caches, eager_caches, exact_caches):
            written.add(*(written_rows(c, meta.slot_mapping) for c in (p, e, x)))
        return pieces

    steps = watch_steps(runner, check)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, ids in enumerate(PIECE_PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
        if i % 2 == 0:
            engine.step()  # staggered: prefills join running decodes
    results = {}
    while engine.has_unfinished_requests():
        results.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert [results[str(i)] for i in range(len(PIECE_PROMPTS))] == expected
    assert exact_steps and any(decodes and tokens > decodes for tokens, decodes in steps), steps
    hidden.check()
    written.check()


def test_piecewise_graphs_are_on_by_default_with_cuda_for_dense_and_moe_models(tmp_path):
    """Issue 40: the pieces are on wherever CUDA graphs run, MoE models included; --enforce-eager
    turns every graph off, --no-piecewise-cuda-graphs only the pieces; on CPU they are off."""
    from zllm.config import EngineConfig

    for case in ("llama", "qwen3-moe"):
        architecture, overrides = CASES[case]
        model_dir = str(save_tiny_model(tmp_path / case, architecture, **overrides))
        assert EngineConfig.create(model_dir, device="cuda").piecewise_cuda_graphs is True
        assert EngineConfig.create(model_dir, device="cuda", enforce_eager=True).piecewise_cuda_graphs is False
        assert EngineConfig.create(model_dir, device="cuda", piecewise_cuda_graphs=False).piecewise_cuda_graphs is False
        assert EngineConfig.create(model_dir, device="cpu").piecewise_cuda_graphs is False


def test_dummy_weights_run_any_shape(tmp_path):
    model_dir = save_tiny_llama(tmp_path, hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    (tokens,) = engine_generate_all(model_dir, PROMPTS[:1], 5, load_format="dummy")
    assert len(tokens) == 5 and all(0 <= t < 256 for t in tokens)


# ---- architecture flags, dtype, sliding window ---------------------------------------------------


def _spec(architecture: str, **overrides):
    import transformers

    from zllm.model_spec import ModelSpec

    config_class = getattr(transformers, TINY_ARCHITECTURES[architecture][0])
    config = config_class(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, **overrides)
    config.architectures = [TINY_ARCHITECTURES[architecture][1]]
    return ModelSpec.from_hf_config(config)


def test_architecture_flags_follow_hf():
    qwen2, qwen3, mistral = _spec("qwen2"), _spec("qwen3"), _spec("mistral", sliding_window=None)
    assert (qwen2.qkv_bias, qwen2.o_proj_bias, qwen2.qk_norm) == (True, False, False)
    assert (qwen3.qkv_bias, qwen3.o_proj_bias, qwen3.qk_norm, qwen3.head_dim) == (False, False, True, 128)
    assert _spec("qwen3", attention_bias=True).o_proj_bias is True
    assert (mistral.qkv_bias, mistral.sliding_window) == (False, None)
    llama = _spec("llama", attention_bias=True, mlp_bias=True)
    assert (llama.qkv_bias, llama.o_proj_bias, llama.mlp_bias) == (True, True, True)
    assert (llama.hidden_act, llama.norm_unit_offset, llama.embed_scale, llama.attention_scale) == (
        "silu",
        False,
        None,
        None,
    )
    gemma2 = _spec("gemma2", head_dim=16, query_pre_attn_scalar=24)
    assert (gemma2.hidden_act, gemma2.norm_unit_offset, gemma2.sandwich_norms, gemma2.qk_norm) == (
        "gelu_pytorch_tanh",
        True,
        True,
        False,
    )
    assert (gemma2.embed_scale, gemma2.attention_scale) == (8.0, 24**-0.5)
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (50.0, 30.0)  # HF's defaults
    gemma3 = _spec("gemma3", rope_theta=1e6, rope_local_base_freq=1e4)
    assert (gemma3.qk_norm, gemma3.attn_logit_softcap, gemma3.final_logit_softcap) == (True, None, None)
    assert (gemma3.rope_theta, gemma3.local_rope_theta) == (1e6, 1e4)
    phi3 = _spec("phi3", partial_rotary_factor=0.5, pad_token_id=0)
    assert (phi3.fused_checkpoint, phi3.rotary_dim, phi3.head_dim) == (True, 8, 16)


def test_sliding_window_only_where_a_layer_uses_it():
    assert _spec("mistral", sliding_window=4096).sliding_layers == tuple(range(32))
    assert _spec("qwen2", sliding_window=4096).sliding_window is None  # use_sliding_window=False
    qwen2 = _spec("qwen2", use_sliding_window=True, sliding_window=64, num_hidden_layers=4, max_window_layers=2)
    assert (qwen2.sliding_window, qwen2.sliding_layers) == (64, (2, 3))
    assert (
        _spec(
            "qwen3", use_sliding_window=True, sliding_window=64, num_hidden_layers=4, max_window_layers=4
        ).sliding_window
        is None
    )  # no layer past max_window_layers
    gemma2 = _spec("gemma2", num_hidden_layers=4, sliding_window=32)  # local layers first, alternating
    assert (gemma2.sliding_window, gemma2.sliding_layers) == (32, (0, 2))
    assert [gemma2.window_of(i) for i in range(4)] == [32, None, 32, None]
    gemma3 = _spec("gemma3", num_hidden_layers=8, sliding_window=32)  # five local layers, then a global
    assert gemma3.sliding_layers == (0, 1, 2, 3, 4, 6, 7)
    assert [gemma3.uses_local_rope(i) for i in (0, 5)] == [True, False]
    assert _spec("phi3", sliding_window=2047, pad_token_id=0).sliding_layers == tuple(range(32))


def test_unsupported_variations_are_refused():
    with pytest.raises(ValueError, match="^model: use_bidirectional_attention"):
        _spec("gemma3", use_bidirectional_attention=True)
    with pytest.raises(ValueError, match=r"^model: hidden_act 'relu' is not supported"):
        _spec("llama", hidden_act="relu")
    with pytest.raises(ValueError, match=r"^model: rope_type 'dynamic' is not supported"):
        _spec("llama", rope_scaling={"rope_type": "dynamic", "factor": 4.0})


def test_config_without_architectures_falls_back_on_model_type():
    from transformers import Qwen2Config

    from zllm.model_spec import ModelSpec

    assert ModelSpec.from_hf_config(Qwen2Config()).architecture == "Qwen2ForCausalLM"


def test_auto_dtype_follows_the_checkpoint_on_gpu_only():
    import torch

    from zllm.workers.model_runner import resolve_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu, "bfloat16") == torch.float32
    assert resolve_dtype("auto", cuda, "float16") == torch.float16
    assert resolve_dtype("auto", cuda, "bfloat16") == torch.bfloat16
    assert resolve_dtype("auto", cuda, "float32") == torch.bfloat16  # half precision, as vLLM
    assert resolve_dtype("auto", cuda, None) == torch.bfloat16
    assert resolve_dtype("float16", cpu, "bfloat16") == torch.float16  # --dtype overrides


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])  # transformers 5 / 4.x spelling
def test_checkpoint_dtype_is_read_from_config(tmp_path, key):
    from zllm.model_spec import ModelSpec

    model_dir = save_tiny_model(tmp_path, "qwen2")
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("dtype", None)
    config[key] = "bfloat16"
    (model_dir / "config.json").write_text(json.dumps(config))
    assert ModelSpec.from_pretrained(str(model_dir)).checkpoint_dtype == "bfloat16"


def test_sliding_window_does_not_cap_max_model_len(tmp_path):
    """The window is attended within (tests/test_windowed_models.py): any length up to the
    model's max_position_embeddings."""
    model_dir = save_tiny_model(tmp_path, "mistral", sliding_window=128)
    assert LLM(str(model_dir), dtype="float32").engine.config.max_model_len == 512
    assert LLM(str(model_dir), dtype="float32", max_model_len=300).engine.config.max_model_len == 300
    with pytest.raises(ValueError, match=r"^max_model_len: 600 exceeds the model's max_position_embeddings \(512\)"):
        LLM(str(model_dir), dtype="float32", max_model_len=600)


# ---- bad checkpoints: clear errors at construction -----------------------------------------------


def test_directory_without_config_json(tmp_path):
    with pytest.raises(ValueError, match="^model: .* has no config.json"):
        LLM(str(tmp_path))


def test_path_that_is_neither_directory_nor_gguf(tmp_path):
    with pytest.raises(ValueError, match="^model: .* is neither a model directory nor a .gguf file"):
        LLM(str(tmp_path / "nothing-here"))
    with pytest.raises(ValueError, match="^model: GGUF file .*missing.gguf.* does not exist"):
        LLM(str(tmp_path / "missing.gguf"))


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    from transformers import GPT2Config

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"^model: architecture \['GPT2LMHeadModel'\] is not supported") as error:
        LLM(str(tmp_path))
    assert all(name in str(error.value) for name in MODEL_REGISTRY)


def test_missing_shard_is_named(tmp_path):
    model_dir = save_tiny_model(tmp_path, "qwen3", shards=3)
    shard = checkpoint_files(str(model_dir))[1]
    shard.unlink()
    with pytest.raises(ValueError, match=f"^model: .*index.json names shard\\(s\\) that do not exist: .*{shard.name}"):
        LLM(str(model_dir), dtype="float32")


def test_mismatched_tensor_shape_names_file_and_tensor(tmp_path):
    model_dir = save_tiny_model(tmp_path, "llama")
    config = json.loads((model_dir / "config.json").read_text())
    config["intermediate_size"] = 96  # the checkpoint's MLP matrices are 128 wide
    (model_dir / "config.json").write_text(json.dumps(config))
    pattern = (
        r"^model: .*/model.safetensors: tensor 'model.layers.0.mlp.(down|gate|up)_proj.weight' has shape "
        r"\((128, 64|64, 128)\), expected \((96, 64|64, 96)\)"
    )
    with pytest.raises(ValueError, match=pattern):
        LLM(str(model_dir), dtype="float32")


def test_missing_tensor_is_named_as_in_the_checkpoint(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = save_tiny_model(tmp_path, "qwen2")
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"^model: checkpoint in .* lacks tensor\(s\) model.layers.1.self_attn.k_proj.bias$"
    ):
        LLM(str(model_dir), dtype="float32")


@pytest.mark.parametrize(
    ("case", "missing"),
    [
        ("mixtral-top1", "model.layers.1.block_sparse_moe.experts.2.w3.weight"),
        ("qwen2-moe-shared", "model.layers.0.mlp.experts.5.down_proj.weight"),
        ("qwen2-moe-shared", "model.layers.1.mlp.shared_expert.gate_proj.weight"),
    ],
)
def test_missing_expert_tensor_is_named_as_in_the_checkpoint(tmp_path, case, missing):
    from safetensors.torch import load_file, save_file

    architecture, overrides = CASES[case]
    model_dir = save_tiny_model(tmp_path, architecture, **overrides)
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    del tensors[missing]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"^model: checkpoint in .* lacks tensor\(s\) {re.escape(missing)}$"):
        LLM(str(model_dir), dtype="float32")


def test_moe_dummy_weights_run(tmp_path):
    architecture, overrides = CASES["qwen2-moe-shared"]
    model_dir = save_tiny_model(tmp_path, architecture, **overrides)
    (tokens,) = engine_generate_all(model_dir, PROMPTS[:1], 5, load_format="dummy")
    assert len(tokens) == 5 and all(0 <= t < 256 for t in tokens)


def test_tensor_in_two_files_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = save_tiny_model(tmp_path, "llama")
    tensors = load_file(model_dir / "model.safetensors")
    save_file({"model.norm.weight": tensors["model.norm.weight"]}, model_dir / "model-extra.safetensors")
    with pytest.raises(
        ValueError, match="^model: .*/model.safetensors: tensor 'model.norm.weight' appears a second time"
    ):
        LLM(str(model_dir), dtype="float32")


def test_unreadable_safetensors_file_is_named(tmp_path):
    model_dir = save_tiny_model(tmp_path, "llama")
    (model_dir / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="^model: .*model.safetensors is not a readable safetensors file"):
        LLM(str(model_dir), dtype="float32")


# ---- GGUF ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_gguf_file_loads_like_its_conversion(tmp_path, monkeypatch, hf_smollm2):
    """`LLM(model="x.gguf")`: converted once into the cache, tokenizer and chat template from the
    GGUF, greedy tokens equal to HF on the same weights (the embedded SmolLM2 GGUF, Q4_1)."""
    from gguf import GGUFReader

    from zllm.model_files import _embedded_gguf

    gguf = tmp_path / "smol-q4.gguf"
    gguf.symlink_to(_embedded_gguf())
    monkeypatch.setenv("ZLLM_CACHE", str(tmp_path / "cache"))
    llm = LLM(str(gguf), dtype="float32", max_model_len=512)
    assert llm.engine.config.model_name == "smol-q4"
    assert Path(llm.engine.config.model).parent == tmp_path / "cache" / "gguf"

    field = GGUFReader(str(gguf)).fields["tokenizer.chat_template"]
    assert llm.get_tokenizer().chat_template == bytes(field.parts[field.data[0]]).decode()

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    conversation = [{"role": "user", "content": "Name the largest planet of the solar system."}]
    chat = llm.chat(conversation, params, use_tqdm=False)[0]
    text = llm.generate(
        "Once upon a time, in a small village by the sea, there lived an old fisherman who every morning",
        params,
        use_tqdm=False,
    )[0]
    for out in (chat, text):
        assert len(out.prompt_token_ids) > 16
        assert out.outputs[0].token_ids == hf_greedy(hf_smollm2, out.prompt_token_ids, 24, eos_token_id=None)
    # The conversion is cached: a second engine reuses the directory.
    assert LLM(str(gguf), dtype="float32", max_model_len=64).engine.config.model == llm.engine.config.model


def test_a_checkpoint_saved_after_loading_a_gguf_loads_as_the_plain_model(tmp_path):
    """transformers writes `quantization_config: {quant_method: gguf}` beside the plain float
    weights it dequantized: the same model, token for token."""
    plain = save_tiny_llama(tmp_path / "plain")
    noted = save_tiny_llama(tmp_path / "noted")
    config = json.loads((noted / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gguf"}
    (noted / "config.json").write_text(json.dumps(config))
    prompts = PROMPTS[:2]
    assert engine_generate_all(noted, prompts, 6) == engine_generate_all(plain, prompts, 6)
