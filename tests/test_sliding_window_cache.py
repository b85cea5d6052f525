"""Window-aware KV blocks (zllm/kv_layout.py, zllm/enginecore/kv_cache_manager.py): blocks behind
every sliding window go back to the pool, a hybrid model (Gemma) keeps two block tables, and a
KV cache smaller than one whole sequence still serves it, token for token as HF transformers."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import hf_greedy, save_tiny_model
from tests.helpers.scheduler import make_request, prompt
from tests.test_windowed_models import CASES as WINDOWED_CASES
from tests.test_windowed_models import LONGROPE, ORIGINAL_MAX, WINDOW
from zllm import LLMEngine, SamplingParams
from zllm.config import EngineConfig
from zllm.enginecore.block_pool import BlockPool
from zllm.enginecore.kv_cache_manager import KVCacheManager
from zllm.enginecore.request import Request
from zllm.enginecore.scheduler import Scheduler
from zllm.kv_layout import KVLayout

BS = 4


def window_manager(num_blocks: int = 16, window: int = 8, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, reserve_null_block=True), BS, caching, window=window)


def computed(manager: KVCacheManager, request: Request, num_tokens: int) -> None:
    assert manager.allocate_slots(request.request_id, num_tokens) is not None
    manager.cache_full_blocks(request, num_tokens)


# ---- the manager ----------------------------------------------------------------------------------


def test_blocks_behind_the_window_go_back_to_the_pool():
    manager = window_manager()
    pool = manager.pool
    assert pool.num_blocks == 15 and pool.null_block.block_id == 0  # block 0 is never handed out
    assert manager.allocate_slots("a", 16) == [1, 2, 3, 4]
    # The next token is at 13: its window (8) starts at 6, in block 1; block 0 is read by nobody.
    manager.free_out_of_window("a", 13)
    assert manager.block_ids("a") == [0, 2, 3, 4] and pool.num_free_blocks == 12
    manager.free_out_of_window("a", 13)  # idempotent
    assert pool.num_free_blocks == 12
    manager.free_out_of_window("a", 17)  # window from 10: blocks 0 and 1 behind it
    assert manager.block_ids("a") == [0, 0, 3, 4] and pool.num_free_blocks == 13
    assert {b.block_id for b in manager.blocks("a")} == {3, 4}  # the null block is nobody's
    manager.free("a")
    assert pool.num_free_blocks == 15


def test_a_full_attention_group_keeps_every_block():
    manager = KVCacheManager(BlockPool(8), BS)
    manager.allocate_slots("a", 16)
    manager.free_out_of_window("a", 15)
    assert manager.block_ids("a") == [0, 1, 2, 3]


def test_a_window_group_needs_a_null_block():
    with pytest.raises(ValueError, match="null block"):
        KVCacheManager(BlockPool(8), BS, window=8)


def test_a_window_hit_survives_the_eviction_of_blocks_behind_it():
    """A full-attention cache would find nothing once the first block is evicted; the window
    group still serves the hit from the blocks its window reaches."""
    manager = window_manager(num_blocks=9)
    a = make_request("a", 25)
    computed(manager, a, 25)  # blocks 1..7, six full
    manager.free_out_of_window("a", 24)  # behind the window of token 24: blocks 1..4
    assert manager.block_ids("a")[:4] == [0, 0, 0, 0]
    taken = manager.pool.allocate(2)  # the never-used block 8, then the first freed: block 1 (tokens 0..3)
    assert [b.block_id for b in taken] == [8, 1] and manager.pool.num_evictions == 1
    hit = manager.find_cached_prefix(make_request("b", 25))
    assert hit.num_blocks == 6  # 24 tokens; the window of token 24 needs blocks 4 and 5 only
    assert [x.block_id for x in hit.blocks] == [0, 0, 0, 0, 5, 6]


def test_hybrid_groups_keep_their_own_tables():
    manager = KVCacheManager(BlockPool(16), BS, sliding_pool=BlockPool(6, reserve_null_block=True), sliding_window=8)
    assert manager.allocate_slots("a", 12) == [0, 1, 2]
    assert manager.take_new_sliding_block_ids("a") == [1, 2, 3]
    assert manager.take_new_sliding_block_ids("a") == []  # told once
    manager.free_out_of_window("a", 12)
    assert manager.take_sliding_block_ids("a") == [0, 2, 3] and manager.block_ids("a") == [0, 1, 2]
    assert manager.allocate_slots("a", 16) == [3]
    assert manager.take_new_sliding_block_ids("a") == [4]
    assert manager.pools[1].num_free_blocks == 2
    manager.free("a")
    assert manager.pools[0].num_free_blocks == 16 and manager.pools[1].num_free_blocks == 5


def test_hybrid_allocation_changes_nothing_when_either_pool_is_short():
    manager = KVCacheManager(BlockPool(2), BS, sliding_pool=BlockPool(8, reserve_null_block=True), sliding_window=8)
    assert manager.allocate_slots("a", 12) is None
    assert manager.pools[1].num_free_blocks == 7 and manager.take_sliding_block_ids("a") == []


def test_a_window_model_takes_a_request_longer_than_its_pool():
    """The scheduler refuses what could never fit: a full-attention pool of 14 blocks cannot hold
    60 tokens, a window group holds only what its window and one chunk reach."""
    config = EngineConfig(model="unused", max_model_len=256, max_num_batched_tokens=8, block_size=BS)
    long = make_request("long", 40, max_tokens=20)
    full = Scheduler(config, KVCacheManager(BlockPool(14), BS))
    with pytest.raises(ValueError, match="max_tokens: 40 prompt tokens"):
        full.add_request(long)
    windowed = Scheduler(config, window_manager(num_blocks=15))
    windowed.add_request(make_request("long", 40, max_tokens=20))
    assert windowed.requests["long"].prompt_token_ids == prompt(40)


# ---- the split ------------------------------------------------------------------------------------


def _layout(disable: bool = False, num_layers: int = 48) -> KVLayout:
    from types import SimpleNamespace

    spec = SimpleNamespace(
        num_layers=num_layers, sliding_window=1024, sliding_layers=tuple(i for i in range(num_layers) if (i + 1) % 6)
    )
    config = SimpleNamespace(
        block_size=16, max_model_len=32768, max_num_batched_tokens=8192, disable_hybrid_kv_cache_manager=disable
    )
    return KVLayout.of(spec, config)


def test_a_hybrid_split_holds_more_long_sequences_in_the_same_memory():
    """Gemma 3's pattern (five sliding layers to one full), 32k tokens, a 1024-token window: the
    same layer-blocks hold about 4x the sequences when the sliding layers keep only their window."""
    hybrid, uniform = _layout(), _layout(disable=True)
    for num_blocks in (2000, 3000, 10000):
        groups = hybrid.groups(num_blocks)
        full, sliding = groups
        assert full.window is None and sliding.window == 1024
        assert len(full.layers) == 8 and len(sliding.layers) == 40
        assert len(full.layers) * full.num_blocks + len(sliding.layers) * sliding.num_blocks <= 48 * num_blocks
        (one,) = uniform.groups(num_blocks)
        assert one.window is None and one.num_blocks == num_blocks
        ratio = hybrid.max_concurrency(groups) / uniform.max_concurrency([one])
        assert 4.0 < ratio < 5.3, ratio  # 48 / (8 + 40 * 66 / 2048) = 5.06 at most, less the chunk reserve


def test_a_window_in_every_layer_is_one_group():
    layout = _layout(num_layers=1)  # one layer, and it has the window
    (group,) = layout.groups(100)
    assert group.window == 1024 and group.num_blocks == 100 and not layout.is_hybrid


# ---- the engine against HF -----------------------------------------------------------------------

# The families and tiny configs of tests/test_windowed_models.py (windows of 12 tokens).
CASES = {name: WINDOWED_CASES[name] for name in ("mistral", "phi3", "gemma2", "gemma3")}
LONG_PROMPTS = [list(range(3, 48)), [9] * 7 + list(range(60, 100)), list(range(101, 152))]
MAX_TOKENS = 12


def _engine_tokens(engine: LLMEngine, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))], [
        done[str(i)].num_cached_tokens for i in range(len(prompts))
    ]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_cache_smaller_than_one_sequence_serves_it_exactly(tmp_path, case):
    """8-token blocks of 8-token steps; the pool holds fewer blocks than one 63-token sequence
    (8 blocks) of a full-attention layer, yet three run to the end, HF's tokens each, and again
    from the prefix cache (later steps reuse the blocks behind every window)."""
    architecture, overrides = CASES[case]
    model_dir = save_tiny_model(tmp_path / case, architecture, initializer_range=0.2, **overrides)
    hybrid = case.startswith("gemma")
    engine = LLMEngine.from_engine_args(
        str(model_dir),
        dtype="float32",
        block_size=8,
        max_num_batched_tokens=8,
        max_model_len=64,
        # mistral, phi3: 7 blocks of every layer (+ the null block); gemma: the full layers'
        # share holds about two sequences, the sliding layers' a few windows.
        num_kv_blocks=11 if hybrid else 8,
        enable_prefix_caching=True,
    )
    core = engine.core
    assert [g.window for g in core.kv_groups] == ([None, WINDOW] if hybrid else [WINDOW])
    if not hybrid:
        assert core.scheduler.kv_cache.pool.num_blocks < 8  # one whole sequence would not fit
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, MAX_TOKENS, eos_token_id=None) for p in LONG_PROMPTS]
    tokens, _ = _engine_tokens(engine, LONG_PROMPTS)
    assert tokens == expected
    assert core.scheduler.num_preemptions > 0  # three at once do not fit: recomputed after preemption
    again, cached = _engine_tokens(engine, [p[:40] + [7, 7] for p in LONG_PROMPTS[:1]] + LONG_PROMPTS[:1])
    assert again[1] == expected[0] and max(cached) > 0
    assert again[0] == hf_greedy(hf, LONG_PROMPTS[0][:40] + [7, 7], MAX_TOKENS, eos_token_id=None)
    for pool in core.scheduler.kv_cache.pools:
        assert pool.num_free_blocks == pool.num_blocks  # everything went back


def test_disabling_the_hybrid_manager_keeps_every_block_and_the_tokens(tmp_path):
    architecture, overrides = CASES["gemma3"]
    model_dir = save_tiny_model(tmp_path / "g3", architecture, initializer_range=0.2, **overrides)
    args = dict(dtype="float32", block_size=8, max_num_batched_tokens=16, max_model_len=64, num_kv_blocks=40)
    hybrid = LLMEngine.from_engine_args(str(model_dir), **args)
    plain = LLMEngine.from_engine_args(str(model_dir), disable_hybrid_kv_cache_manager=True, **args)
    assert [g.window for g in plain.core.kv_groups] == [None]
    assert plain.core.max_concurrency < hybrid.core.max_concurrency
    assert _engine_tokens(hybrid, LONG_PROMPTS)[0] == _engine_tokens(plain, LONG_PROMPTS)[0]


def test_a_draft_model_for_a_windowed_target_asks_for_every_block(tmp_path):
    from tests.helpers.models import save_tiny_llama

    architecture, overrides = CASES["mistral"]
    target = save_tiny_model(tmp_path / "target", architecture, **overrides)
    draft = save_tiny_llama(tmp_path / "draft")
    speculative = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="needs --disable-hybrid-kv-cache-manager"):
        EngineConfig.create(str(target), device="cpu", speculative_config=speculative)
    config = EngineConfig.create(
        str(target), device="cpu", speculative_config=speculative, disable_hybrid_kv_cache_manager=True
    )
    assert config.speculative_config.model == str(draft)


TP2_CASES = {
    **CASES,
    # Phi-4-mini's kind: LongRoPE over half of each head, pretrained on 32 positions: the
    # prompts run past the switch to the long factors.
    "phi3-longrope": (
        "phi3",
        dict(
            head_dim=16,
            partial_rotary_factor=0.5,
            max_position_embeddings=128,
            original_max_position_embeddings=ORIGINAL_MAX,
            rope_scaling=LONGROPE,
        ),
    ),
}


@pytest.mark.parametrize("case", sorted(TP2_CASES))
def test_every_family_matches_hf_at_tp2(tmp_path, case):
    """Over two worker processes (gloo), prompts past the window (and LongRoPE's switch), 8-token
    steps and a small cache with preemptions: HF's tokens. Gemma's ranks each build the sliding
    layers' table from the same messages."""
    from transformers import AutoModelForCausalLM

    from zllm import LLM

    architecture, overrides = TP2_CASES[case]
    model_dir = save_tiny_model(tmp_path / case, architecture, initializer_range=0.2, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, MAX_TOKENS, eos_token_id=None) for p in LONG_PROMPTS]
    llm = LLM(
        str(model_dir),
        dtype="float32",
        tensor_parallel_size=2,
        block_size=8,
        max_num_batched_tokens=8,
        max_model_len=64,
        num_kv_blocks=11 if architecture.startswith("gemma") else 8,
    )
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in LONG_PROMPTS],
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == expected
