"""The engine on a GPU: greedy tokens vs HF transformers on the same GPU, graphs vs eager.

The models (model_dir: one per shape) and prompts (prompt_ids) are tests/gpu/conftest.py's
fixtures; the shapes and the helpers are in tests/helpers/gpu.py."""

from __future__ import annotations

import os

import pytest

from tests.helpers.engine import count_row_steps
from tests.helpers.gpu import engine_tokens, hf_tokens, record, share_identical
from zllm import LLMEngine, SamplingParams

pytestmark = pytest.mark.gpu


def _hf_margin(model_dir, prompt: list[int], ours: list[int], theirs: list[int]) -> dict:
    """At the first differing position: HF's logits for its own token and for ours."""
    import torch
    from transformers import AutoModelForCausalLM

    position = next(i for i in range(min(len(ours), len(theirs))) if ours[i] != theirs[i])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + theirs[:position]], device="cuda")).logits[0, -1]
    top = logits.topk(2)
    return {
        "prompt_len": len(prompt),
        "position": position,
        "hf_top2_gap": float(top.values[0] - top.values[1]),
        "hf_minus_ours": float(logits[theirs[position]] - logits[ours[position]]),
    }


def test_fp32_greedy_is_token_identical_to_hf(model_dir, prompt_ids):
    import torch

    ours = engine_tokens(model_dir, prompt_ids, dtype="float32")
    theirs = hf_tokens(model_dir, prompt_ids, torch.float32)
    record(f"fp32_share_identical[{os.path.basename(model_dir)}]", share_identical(ours, theirs))
    for ids, a, b in zip(prompt_ids, ours, theirs):
        if a != b:  # say how close HF's own choice was where the two part
            record(f"fp32_divergence[{os.path.basename(model_dir)}]", _hf_margin(model_dir, ids, a, b))
    assert ours == theirs


def test_bf16_greedy_agrees_with_hf(model_dir, prompt_ids):
    import torch

    ours = engine_tokens(model_dir, prompt_ids, dtype="bfloat16")
    theirs = hf_tokens(model_dir, prompt_ids, torch.bfloat16)
    share = share_identical(ours, theirs)
    record(f"bf16_share_identical[{os.path.basename(model_dir)}]", share)
    # bf16 rounding differs between kernels and a random model's choices are close, so the
    # sequences drift apart once one token differs (reported above). A broken kernel would also
    # lose the first token (the prefill's answer) of most prompts: 1 in 256 by chance.
    first_agree = sum(a[0] == b[0] for a, b in zip(ours, theirs))
    record(f"bf16_first_token_agreement[{os.path.basename(model_dir)}]", f"{first_agree}/{len(ours)}")
    assert first_agree >= 0.75 * len(ours)


def test_cuda_graphs_equal_eager(model_dir, prompt_ids):
    """The decode graphs replay eager decode bit for bit. Steps with prefill stay off the graphs
    here (mixed_graph_max_tokens=0, the pieces off): as decode rows they take other kernels than
    the eager prefill (test_prompt_tokens_as_decode_rows_in_bf16_stay_as_close_as_eager)."""
    graphs = engine_tokens(
        model_dir, prompt_ids, dtype="bfloat16", mixed_graph_max_tokens=0, piecewise_cuda_graphs=False
    )
    eager = engine_tokens(model_dir, prompt_ids, dtype="bfloat16", enforce_eager=True)
    assert graphs == eager


def test_kv_cache_sized_from_gpu_memory(model_dir):
    engine = LLMEngine.from_engine_args(model_dir, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3)
    try:
        blocks = engine.core.num_kv_blocks
        runner = engine.core.executor.runner
        bytes_per_block = runner.kv_cache_bytes_per_block()
    finally:
        engine.shutdown()
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    record(f"kv_cache_fraction_at_0.3[{os.path.basename(model_dir)}]", round(blocks * bytes_per_block / total, 3))
    assert 0.15 * total < blocks * bytes_per_block < 0.3 * total


def test_model_too_large_is_a_clear_error(tmp_path):
    from benchmarks.dummy_model import write_dummy_model

    model_dir = write_dummy_model("llama3-70b", tmp_path / "big")  # 141 GB in bf16: fits no single GPU here
    with pytest.raises(RuntimeError, match="GiB"):
        engine = LLMEngine.from_engine_args(str(model_dir), device="cuda", load_format="dummy", max_model_len=2048)
        engine.shutdown()  # reached only when it wrongly started: pytest.raises fails next


def test_chunked_prefill_equals_whole_prefill(model_dir, prompt_ids):
    whole = engine_tokens(model_dir, prompt_ids, dtype="float32")
    chunked = engine_tokens(model_dir, prompt_ids, dtype="float32", max_num_batched_tokens=48)
    assert chunked == whole


def test_piecewise_cuda_graphs_equal_eager_steps(model_dir, prompt_ids):
    """Steps with prefill replayed as pieces (graphs split at attention, padded token counts):
    fp32 tokens equal HF's exactly. In bf16 a padded step may run its GEMMs through other cuBLAS
    kernels than the unpadded eager step (docs/architecture.md, "which outputs are bit-stable"), so
    the prefill's answers must agree and the rest is recorded; the replay itself is checked bit
    for bit below (test_piecewise_graphs_replay_the_forward_of_a_mixed_step)."""
    import torch

    # mixed_graph_max_tokens=0: every step with prefill through the pieces (not decode-graph rows).
    fp32 = engine_tokens(model_dir, prompt_ids, dtype="float32", piecewise_cuda_graphs=True, mixed_graph_max_tokens=0)
    assert fp32 == hf_tokens(model_dir, prompt_ids, torch.float32)
    for budget in (2048, 48):
        pieces = engine_tokens(
            model_dir,
            prompt_ids,
            dtype="bfloat16",
            piecewise_cuda_graphs=True,
            max_num_batched_tokens=budget,
            mixed_graph_max_tokens=0,
        )
        eager = engine_tokens(
            model_dir,
            prompt_ids,
            dtype="bfloat16",
            max_num_batched_tokens=budget,
            piecewise_cuda_graphs=False,
            mixed_graph_max_tokens=0,
        )
        name = os.path.basename(model_dir)
        record(f"bf16_pieces_vs_eager_share_identical[{name}-{budget}]", share_identical(pieces, eager))
        first_agree = sum(p[0] == e[0] for p, e in zip(pieces, eager))
        record(f"bf16_pieces_vs_eager_first_token_agreement[{name}-{budget}]", f"{first_agree}/{len(eager)}")
        # A random model's near-tie may flip one prefill answer (the pieces' own bound against
        # fp32 is test_piecewise_graphs_replay_the_forward_of_a_mixed_step); a broken piece would
        # lose most of them.
        assert first_agree >= len(eager) - 1, budget


def test_prompt_tokens_as_decode_graph_rows_fp32_equal_hf(model_dir, prompt_ids):
    """mixed_graph_max_tokens: steps with prompt tokens replay the decode CUDA graph, every token a
    row of it; fp32 tokens equal HF's, and those steps did run as graph replays."""
    import torch

    engine = LLMEngine.from_engine_args(
        model_dir,
        device="cuda",
        dtype="float32",
        max_model_len=2048,
        max_num_batched_tokens=256,
        mixed_graph_max_tokens=256,
    )
    try:
        runner = engine.core.executor.runner
        assert runner.graphs is not None and runner.graphs.max_batch >= 256
        replays = []
        run = runner.graphs.run

        def counted(input_ids, *args):
            replays.append(input_ids.shape[0])
            return run(input_ids, *args)

        runner.graphs.run = counted
        params = SamplingParams(temperature=0.0, max_tokens=16)
        for i, ids in enumerate(prompt_ids):
            engine.add_request(str(i), {"prompt_token_ids": ids}, params)
            if i % 3 == 2:
                engine.step()
        results = {}
        while engine.has_unfinished_requests():
            results.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    finally:
        engine.shutdown()
    ours = [results[str(i)] for i in range(len(prompt_ids))]
    theirs = [t[:16] for t in hf_tokens(model_dir, prompt_ids, torch.float32)]
    record(f"fp32_rows_share_identical[{os.path.basename(model_dir)}]", share_identical(ours, theirs))
    assert ours == theirs
    assert max(replays) > len(prompt_ids)  # a replay held more rows than there are requests: prompt tokens


def _prompt_logprob_error(model_dir, prompt_ids, reference, **engine_args) -> float:
    """Mean |logprob - reference| over every prompt token a bf16 engine scores (prompt_logprobs)."""
    engine = LLMEngine.from_engine_args(
        model_dir, device="cuda", dtype="bfloat16", max_model_len=2048, max_num_batched_tokens=256, **engine_args
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        for i, ids in enumerate(prompt_ids):
            engine.add_request(str(i), {"prompt_token_ids": ids}, params)
        outs = {}
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o.prompt_logprobs for o in engine.step() if o.finished})
    finally:
        engine.shutdown()
    errors = []
    for i, ids in enumerate(prompt_ids):
        ours = [entry[token].logprob for entry, token in zip(outs[str(i)][1:], ids[1:])]
        errors.extend(abs(a - b) for a, b in zip(ours, reference[i]))
    return sum(errors) / len(errors)


def test_prompt_tokens_as_decode_rows_in_bf16_stay_as_close_as_eager(model_dir, prompt_ids, monkeypatch):
    """In bf16 the rows (the decode graph's kernels over the prompt tokens) round otherwise than the
    eager prefill, so their tokens may part after a near-tie; what they promise is to be no further
    from the exact result: each prompt token's logprob against HF fp32's, the rows' mean error
    within twice the eager prefill's (docs/architecture.md, "which outputs are bit-stable")."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    reference = []
    with torch.inference_mode():
        for ids in prompt_ids:
            logprobs = model(torch.tensor([ids], device="cuda")).logits[0].log_softmax(-1)
            reference.append(logprobs[:-1].gather(1, torch.tensor(ids[1:], device="cuda")[:, None])[:, 0].tolist())
    del model
    torch.cuda.empty_cache()
    row_steps = count_row_steps(monkeypatch)
    rows = _prompt_logprob_error(model_dir, prompt_ids, reference, mixed_graph_max_tokens=256)
    assert any(row_steps)  # the prompt tokens did go in as decode rows
    row_steps.clear()
    eager = _prompt_logprob_error(
        model_dir, prompt_ids, reference, mixed_graph_max_tokens=0, piecewise_cuda_graphs=False
    )
    assert not any(row_steps)
    record(f"bf16_prompt_logprob_error_rows_vs_eager[{os.path.basename(model_dir)}]", [rows, eager])
    assert rows <= 2 * eager + 1e-3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_piecewise_graphs_replay_the_forward_of_a_mixed_step(model_dir, prompt_ids, dtype):
    """Every step with prefill (decodes and prefill chunks mixed) through the captured pieces: bit
    for bit what the same pieces compute without graphs (hidden states and cache contents), and
    close to the unpadded eager forward. fp32: within 1e-3 of it. bf16: a GEMM over the padded
    row count may take another cuBLAS kernel, whose other summation order moves a bf16 result by
    an ulp that grows through the layers (on the H100 and H200 1 to 15 of 2M cache values moved
    ~0.12, beyond any fixed tolerance that still means something), so both are compared with the
    step in fp32: over the run the pieces may be no further from it than the eager forward is
    (tests/helpers/pieces.py says by how much; docs/architecture.md, "Which outputs are
    bit-stable")."""
    import torch

    from tests.helpers.pieces import ErrorTally, WideReference, forward_from, unwritten_equal, watch_steps, written_rows
    from zllm.workers.piecewise_graphs import EagerPieces, PiecewiseGraphs

    # A small cache (256 blocks of 16 tokens: every prompt fits), so cloning it per step is cheap.
    engine = LLMEngine.from_engine_args(
        model_dir,
        device="cuda",
        dtype=dtype,
        max_model_len=2048,
        num_kv_blocks=256,
        piecewise_cuda_graphs=True,
        mixed_graph_max_tokens=0,  # every step with prefill through the pieces
        async_scheduling=False,
    )
    try:
        runner = engine.core.executor.runner
        assert isinstance(runner.pieces, PiecewiseGraphs) and runner.pieces.graphs
        uncaptured = EagerPieces(runner.model, runner.kv_caches, runner.pieces.sizes)
        wide = WideReference(runner, torch.float32) if dtype == "bfloat16" else None
        hidden, written = ErrorTally("hidden states"), ErrorTally("cache entries written")

        def check(run, input_ids, positions, meta):
            step = (input_ids.shape[0], meta.num_decodes)
            saved = [c.clone() for c in runner.kv_caches]
            eager, eager_caches = forward_from(
                runner, saved, runner.model, input_ids, positions, runner.kv_caches, meta
            )
            pieces, pieces_caches = forward_from(runner, saved, uncaptured.run, input_ids, positions, meta)
            out, out_caches = forward_from(runner, saved, run, input_ids, positions, meta)
            assert torch.equal(out, pieces), step
            assert all(map(torch.equal, out_caches, pieces_caches)), step
            assert all(unwritten_equal(c, s, meta.slot_mapping) for c, s in zip(out_caches, saved)), step
            if wide is None:  # fp32: strict
                torch.testing.assert_close(out, eager, rtol=1e-3, atol=1e-3)
                for cache, expected in zip(out_caches, eager_caches):
                    torch.testing.assert_close(cache, expected, rtol=1e-3, atol=1e-3)
                return out
            exact, exact_caches = wide.forward(saved, input_ids, positions, meta)
            hidden.add(out, eager, exact)
            for ours, theirs, reference in zip(out_caches, eager_caches, exact_caches):
                written.add(*(written_rows(c, meta.slot_mapping) for c in (ours, theirs, reference)))
            return out

        captured = watch_steps(runner, check)
        params = SamplingParams(temperature=0.0, max_tokens=4)
        for i, ids in enumerate(prompt_ids):
            engine.add_request(str(i), {"prompt_token_ids": ids}, params)
            engine.step()
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.shutdown()
    assert any(decodes and tokens > decodes for tokens, decodes in captured), captured  # a mixed step ran
    if wide is not None:
        name = os.path.basename(model_dir)
        record(f"bf16_pieces_vs_fp32_hidden[{name}]", hidden.summary())
        record(f"bf16_pieces_vs_fp32_cache[{name}]", written.summary())
        hidden.check()
        written.check()


def test_shutdown_gives_the_gpu_memory_back(model_dir):
    """An engine with every kind of graph (decode and piecewise) holds most of the GPU for its KV
    cache; after shutdown() that memory is free again, in this process, for the next engine."""
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    engine = LLMEngine.from_engine_args(
        model_dir, device="cuda", dtype="bfloat16", max_model_len=2048, piecewise_cuda_graphs=True
    )
    try:
        held = torch.cuda.memory_allocated() - before
    finally:
        engine.shutdown()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    left = torch.cuda.memory_allocated() - before
    record(f"allocated_after_shutdown_mib[{os.path.basename(model_dir)}]", round(left / 2**20, 1))
    assert held > 8 << 30, f"the engine held only {held / 2**30:.1f} GiB"
    assert left < 512 << 20, f"{left / 2**20:.0f} MiB still allocated after shutdown ({held / 2**30:.1f} GiB held)"


def _greedy(engine, prompt: list[int], max_tokens: int) -> list[int]:
    engine.add_request("side", {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        tokens = next((o.outputs[0].token_ids for o in engine.step() if o.finished), tokens)
    return list(tokens)


def test_engines_side_by_side_each_take_their_share(model_dir, prompt_ids):
    """Two in-process engines at 0.3 each (benchmarks/spec_e2e.py's rounds): the second's profile
    counts only its own allocations, not the first engine's weights and KV cache, so both start
    with caches of about the same size, and both generate."""
    first = LLMEngine.from_engine_args(model_dir, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3)
    try:
        second = LLMEngine.from_engine_args(model_dir, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3)
        try:
            blocks = [first.core.num_kv_blocks, second.core.num_kv_blocks]
            record(f"side_by_side_kv_blocks[{os.path.basename(model_dir)}]", blocks)
            assert blocks[1] > 0.8 * blocks[0], blocks
            outs = [_greedy(engine, prompt_ids[0], 8) for engine in (first, second)]
            assert outs[0] == outs[1] and len(outs[0]) == 8, outs
        finally:
            second.shutdown()
    finally:
        first.shutdown()
