"""The fused MoE kernels (csrc/moe_kernels.cu) against torch, and MoE models on the GPU engine
against transformers: routing, the expert sort, the grouped GEMMs and the GEMV path at batch
sizes 1 to 512 with skewed routings, CUDA-graph replay, and tiny Mixtral / Qwen2-MoE / Qwen3-MoE
checkpoints."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import save_tiny_model

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from zllm import LLMEngine, SamplingParams  # noqa: E402
from zllm.workers.kernels import moe as fused  # noqa: E402
from zllm.workers.layers import moe_route  # noqa: E402
from zllm.workers.models.moe import expert_loop  # noqa: E402

HALF = [torch.bfloat16, torch.float16]


def _operands(tokens, num_experts, top_k, hidden, inter, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(dtype)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, device="cuda", generator=gen) / inter**0.5).to(dtype)
    logits = torch.randn(tokens, num_experts, device="cuda", generator=gen).to(dtype)
    weights, ids = moe_route(logits, top_k, True, True)
    return x, gate_up, down, weights, ids.to(torch.int32)


def _check_against_float64(x, weights, ids, gate_up, down):
    """Each path's error against a float64 evaluation is at most about that of torch's own
    half-precision loop (all round the same intermediates; only summation orders differ)."""
    torch_half = expert_loop(x, weights, ids.long(), gate_up, down).double()
    exact = expert_loop(x.double(), weights.double(), ids.long(), gate_up.double(), down.double())
    scale = exact.abs().max().item()
    torch_err = (torch_half - exact).abs().max().item()
    paths = {"fused": fused.fused_experts}
    for split, bound in fused.GEMV_BUILDS:
        paths[f"gemv-s{split}-{bound}"] = lambda *args, split=split, bound=bound: fused.gemv_experts(
            *args, split=split, bound=bound
        )
    if fused.grouped_mm_available(x.device):
        paths["grouped_mm"] = fused.grouped_mm_experts
    for name, path in paths.items():
        ours_err = (path(x, weights, ids, gate_up, down).double() - exact).abs().max().item()
        assert ours_err <= 2 * torch_err + 2e-3 * scale, (name, ours_err, torch_err, scale)


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "f16"])
@pytest.mark.parametrize(
    "tokens,num_experts,top_k,hidden,inter",
    [
        (1, 128, 8, 2048, 768),  # Qwen3-30B-A3B's layer at batch 1
        (1, 8, 2, 512, 1024),  # Mixtral-like, scaled down
        (2, 8, 2, 4096, 1792),  # Mixtral's H: several unrolled rounds of the GEMVs
        (3, 8, 2, 256, 72),  # I not a multiple of 32: the masked last chunk
        (64, 16, 4, 200, 96),  # H not a multiple of 32
        (257, 60, 4, 128, 56),  # an odd batch over Qwen2-MoE's 60 experts
        (512, 128, 8, 512, 64),  # many tiles of 64 rows
    ],
)
def test_fused_experts_match_torch(dtype, tokens, num_experts, top_k, hidden, inter):
    x, gate_up, down, weights, ids = _operands(tokens, num_experts, top_k, hidden, inter, dtype)
    _check_against_float64(x, weights, ids, gate_up, down)


@pytest.mark.parametrize("tokens", [1, 2, 7, 16, 33, 128, 512])
def test_every_token_on_one_expert_and_none_on_the_others(tokens):
    """All rows in one expert's tiles (many tiles of it), every other expert empty."""
    x, gate_up, down, weights, ids = _operands(tokens, 32, 2, 256, 128, torch.bfloat16)
    ids = torch.stack([torch.full((tokens,), 5), torch.full((tokens,), 30)], dim=1).to(torch.int32).cuda()
    _check_against_float64(x, weights, ids, gate_up, down)


def test_align_sorts_pairs_into_whole_tiles_of_one_expert():
    tokens, num_experts, top_k = 300, 16, 4
    _, _, _, _, ids = _operands(tokens, num_experts, top_k, 64, 64, torch.bfloat16)
    ids[:50] = 3  # a crowded expert beside sparse ones
    pairs = tokens * top_k
    block_m = fused.tile_rows(pairs, num_experts)
    tiles = fused.max_tiles(pairs, num_experts, block_m)
    sorted_pairs = torch.empty(tiles * block_m, dtype=torch.int32, device="cuda")
    tile_experts = torch.empty(tiles, dtype=torch.int32, device="cuda")
    num_tiles = torch.empty(1, dtype=torch.int32, device="cuda")
    fused.moe_align(sorted_pairs, tile_experts, num_tiles, ids, num_experts, block_m)
    flat = ids.flatten().tolist()
    counts = [flat.count(e) for e in range(num_experts)]
    used = sum(-(-c // block_m) for c in counts)
    assert num_tiles.item() == used
    tile_experts, sorted_pairs = tile_experts.tolist(), sorted_pairs.view(tiles, block_m).tolist()
    assert tile_experts[used:] == [-1] * (tiles - used)
    assert tile_experts[:used] == sorted(tile_experts[:used])  # experts in ascending order
    seen = []
    for expert, rows in zip(tile_experts[:used], sorted_pairs[:used]):
        real = [p for p in rows if p >= 0]
        assert rows[: len(real)] == real  # padding only at the end of an expert's rows
        assert all(flat[p] == expert for p in real)
        seen += real
    assert sorted(seen) == list(range(pairs))


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize(
    "num_experts,top_k,renormalize", [(8, 2, True), (60, 4, False), (128, 8, True), (512, 32, True)]
)
def test_topk_softmax_matches_torch(dtype, num_experts, top_k, renormalize):
    tokens = 333
    logits = (torch.randn(tokens, num_experts, device="cuda") * 3).to(dtype)
    for fp32_weights in (True, False):
        weights = torch.empty(tokens, top_k, device="cuda")
        ids = torch.empty(tokens, top_k, dtype=torch.int32, device="cuda")
        fused.moe_topk_softmax(weights, ids, logits, renormalize, round_weights=not fp32_weights)
        ref_weights, ref_ids = moe_route(logits, top_k, renormalize, fp32_weights)
        # Ties (half-precision logits repeat) may pick other experts of the same probability:
        # the chosen experts' reference probabilities must equal the reference's k largest.
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        torch.testing.assert_close(probs.gather(1, ids.long()), probs.gather(1, ref_ids), rtol=0, atol=0)
        assert (ids.sort(dim=1).values.unique_consecutive(dim=1).shape[1] == top_k) or top_k == 1
        torch.testing.assert_close(weights, ref_weights.float(), rtol=2e-6 if fp32_weights else 1e-2, atol=1e-7)


@pytest.mark.parametrize("path", ["fused_experts", "gemv_experts", "grouped_mm_experts"])
def test_graph_replay_equals_eager(path):
    if path == "grouped_mm_experts" and not fused.grouped_mm_available(torch.device("cuda")):
        pytest.skip("torch._grouped_mm runs on Hopper only")
    x, gate_up, down, _, _ = _operands(24, 64, 8, 512, 256, torch.bfloat16)
    logits = torch.randn(24, 64, device="cuda").to(torch.bfloat16)

    def block():
        weights = torch.empty(24, 8, device="cuda")
        ids = torch.empty(24, 8, dtype=torch.int32, device="cuda")
        fused.moe_topk_softmax(weights, ids, logits, True, round_weights=True)
        return getattr(fused, path)(x, weights, ids, gate_up, down)

    block()  # load the module outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = block()
    for seed in range(3):  # new inputs, new routing: the graph follows them
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
        logits.copy_(torch.randn(logits.shape, device="cuda", generator=gen))
        graph.replay()
        torch.testing.assert_close(captured, block(), rtol=0, atol=0)


def test_bad_arguments_are_refused():
    x, gate_up, down, weights, ids = _operands(4, 8, 2, 64, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="fp16 or bf16"):
        fused.fused_experts(x.float(), weights, ids, gate_up.float(), down.float())
    with pytest.raises(ValueError, match="int32"):
        fused.fused_experts(x, weights, ids.long(), gate_up, down)
    with pytest.raises(ValueError, match="fp16 or bf16"):
        fused.gemv_experts(x, weights, ids, gate_up.float(), down)
    with pytest.raises(ValueError, match="must be \\[4, k\\]"):
        fused.fused_experts(x, weights[:2], ids[:2], gate_up, down)
    with pytest.raises(ValueError, match="experts"):
        fused.moe_topk_softmax(
            torch.empty(4, 2, device="cuda"),
            torch.empty(4, 2, dtype=torch.int32, device="cuda"),
            torch.randn(4, 513, device="cuda"),
            True,
            False,
        )


# ---- the engine ----------------------------------------------------------------------------------

MAX_TOKENS = 24
MODELS = {  # head_dim 64: the decode kernel's sizes; expert sizes multiples of 8 (the fused path)
    "mixtral": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=256)),
    "qwen2-moe": (
        "qwen2_moe",
        dict(
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=72,
            shared_expert_intermediate_size=128,
            intermediate_size=256,
        ),
    ),
    "qwen3-moe": (
        "qwen3_moe",
        dict(
            num_experts=32, num_experts_per_tok=8, moe_intermediate_size=96, norm_topk_prob=True, intermediate_size=256
        ),
    ),
}
PROMPT_LENGTHS = [1, 5, 17, 40, 130]


@pytest.fixture(scope="module", params=sorted(MODELS))
def moe_model(request, tmp_path_factory):
    architecture, overrides = MODELS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    save_tiny_model(
        directory,
        architecture,
        vocab_size=256,
        hidden_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        initializer_range=0.2,
        **overrides,
    )
    return str(directory)


@pytest.fixture(scope="module")
def prompts():
    import random

    rng = random.Random(1)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in PROMPT_LENGTHS]


def _engine_tokens(model_dir, prompts, **engine_args):
    """The engine's greedy tokens, and whether it ran decode graphs and captured pieces."""
    from zllm.workers.piecewise_graphs import PiecewiseGraphs

    engine = LLMEngine.from_engine_args(
        model_dir, device="cuda", max_model_len=512, gpu_memory_utilization=0.3, **engine_args
    )
    try:
        runner = engine.core.executor.runner
        graphed = runner.graphs is not None, isinstance(runner.pieces, PiecewiseGraphs)
        return _run(engine, prompts), graphed
    finally:
        engine.shutdown()


def _run(engine, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
        if i % 2:
            engine.step()  # staggered arrivals
    results = {}
    while engine.has_unfinished_requests():
        results.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return [results[str(i)] for i in range(len(prompts))]


def _hf_ranks(model_dir, prompts, generated, dtype):
    """Teacher-forced: for each token the engine generated, its rank among transformers' logits
    given the same prefix (0: HF's own greedy choice) and HF's top-2 gap there."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, experts_implementation="eager").cuda().eval()
    ranks, gaps = [], []
    with torch.inference_mode():
        for prompt, ours in zip(prompts, generated):
            logits = model(torch.tensor([prompt + ours], device="cuda")).logits[0, len(prompt) - 1 : -1].float()
            chosen = logits.gather(1, torch.tensor(ours, device="cuda")[:, None])
            ranks += (logits > chosen).sum(dim=1).tolist()
            top2 = logits.topk(2).values
            gaps += (top2[:, 0] - top2[:, 1]).tolist()
    del model
    torch.cuda.empty_cache()
    return ranks, gaps


def _hf_choices(model_dir, prompts, generated, dtype):
    """HF's greedy choice at each step given the engine's tokens as the prefix."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, experts_implementation="eager").cuda().eval()
    choices = []
    with torch.inference_mode():
        for prompt, ours in zip(prompts, generated):
            logits = model(torch.tensor([prompt + ours], device="cuda")).logits[0, len(prompt) - 1 : -1]
            choices += logits.argmax(dim=-1).tolist()
    del model
    torch.cuda.empty_cache()
    return choices


def _record(name, value):
    print(f"{name}: {value}")


def test_fp32_engine_follows_transformers(moe_model, prompts):
    """fp32 runs the torch expert loop (no graphs). Token-identical free runs are not a fair bar
    for random MoE models on a GPU: a near-tie between the k-th and (k+1)-th expert in any layer
    flips under a different summation order and moves the logits by a whole expert's output, and
    the runs part from there. So every generated token is checked against HF given the same
    prefix: HF's greedy choice at (nearly) every step, never worse than its second."""
    ours, graphed = _engine_tokens(moe_model, prompts, dtype="float32")
    assert graphed == (False, False)  # neither decode graphs nor pieces: the loop syncs
    ranks, gaps = _hf_ranks(moe_model, prompts, ours, torch.float32)
    _record(f"fp32 rank>0 [{moe_model}]", [(r, round(g, 4)) for r, g in zip(ranks, gaps) if r])
    assert max(ranks) <= 1 and sum(r == 0 for r in ranks) >= 0.97 * len(ranks)


def test_bf16_fused_engine_follows_transformers(moe_model, prompts):
    """bf16 through the fused kernels inside the decode graphs, teacher-forced against HF fp32,
    with HF's own bf16 model on the same tokens as the bar: routing near-ties flip in bf16 and
    move a step's logits by a whole expert, so neither agrees with fp32 at every step."""
    ours, graphed = _engine_tokens(moe_model, prompts, dtype="bfloat16")
    assert graphed == (True, True)  # the fused kernels let decode graphs and pieces hold the MoE layers
    hf_bf16 = _hf_choices(moe_model, prompts, ours, torch.bfloat16)
    hf_fp32 = _hf_choices(moe_model, prompts, ours, torch.float32)
    ours_flat = [t for tokens in ours for t in tokens]
    ours_top1 = sum(a == b for a, b in zip(ours_flat, hf_fp32)) / len(hf_fp32)
    hf_top1 = sum(a == b for a, b in zip(hf_bf16, hf_fp32)) / len(hf_fp32)
    _record(f"bf16 top-1 share vs HF fp32 [{moe_model}]: zllm, HF bf16", (round(ours_top1, 3), round(hf_top1, 3)))
    assert ours_top1 >= hf_top1 - 0.1


def test_bf16_graphs_equal_eager(moe_model, prompts):
    """The decode graphs (the pieces and the decode-graph rows off: their steps with prefill take
    other kernels than the eager prefill; the pieces' are test_bf16_pieces_* below)."""
    graphs, graphed = _engine_tokens(
        moe_model, prompts, dtype="bfloat16", piecewise_cuda_graphs=False, mixed_graph_max_tokens=0
    )
    eager, _ = _engine_tokens(moe_model, prompts, dtype="bfloat16", enforce_eager=True)
    assert graphed == (True, False) and graphs == eager


def test_bf16_pieces_replay_the_forward_of_mixed_steps(moe_model, prompts):
    """Issue 40: the MoE layers inside the piecewise graphs. Each step with prefill through the
    captured pieces is bit for bit what the same pieces compute without graphs (hidden states
    and caches, padded rows writing nowhere), and no further from the step in fp32 than the
    unpadded bf16 eager forward: a padded step routes more rows, so the experts may take another
    kernel (gemv / register tiles / grouped GEMM, tile size: kernels/moe.py experts) and the
    dense GEMMs another cuBLAS kernel, each another summation order. A routing near-tie that one
    bf16 path flips and the other does not moves that token by a whole expert, in either path,
    so the bar is each path's median error per token over the run, not the largest."""
    from tests.helpers.pieces import WideReference, forward_from, row_errors, unwritten_equal, watch_steps, written_rows
    from zllm.workers.piecewise_graphs import EagerPieces, PiecewiseGraphs

    engine = LLMEngine.from_engine_args(  # a small cache: each step copies it a few times
        moe_model,
        device="cuda",
        dtype="bfloat16",
        max_model_len=512,
        num_kv_blocks=128,
        async_scheduling=False,
        mixed_graph_max_tokens=0,  # every step with prefill through the pieces, not decode-graph rows
    )
    errors = {"pieces": [], "eager": []}
    try:
        runner = engine.core.executor.runner
        assert isinstance(runner.pieces, PiecewiseGraphs) and runner.pieces.graphs  # on by default
        uncaptured = EagerPieces(runner.model, runner.kv_caches, runner.pieces.sizes)
        wide = WideReference(runner, torch.float32)

        def check(run, input_ids, positions, meta):
            step = (input_ids.shape[0], meta.num_decodes)
            saved = [c.clone() for c in runner.kv_caches]
            eager, eager_caches = forward_from(
                runner, saved, runner.model, input_ids, positions, runner.kv_caches, meta
            )
            exact, exact_caches = wide.forward(saved, input_ids, positions, meta)
            pieces, pieces_caches = forward_from(runner, saved, uncaptured.run, input_ids, positions, meta)
            out, out_caches = forward_from(runner, saved, run, input_ids, positions, meta)
            assert torch.equal(out, pieces) and all(map(torch.equal, out_caches, pieces_caches)), step
            assert all(unwritten_equal(c, s, meta.slot_mapping) for c, s in zip(out_caches, saved)), step
            errors["pieces"].append(row_errors(out, exact))
            errors["eager"].append(row_errors(eager, exact))
            for ours, theirs, reference in zip(out_caches, eager_caches, exact_caches):
                ours, theirs, reference = (
                    written_rows(c, meta.slot_mapping).transpose(0, 1) for c in (ours, theirs, reference)
                )
                errors["pieces"].append(row_errors(ours, reference))
                errors["eager"].append(row_errors(theirs, reference))
            return out

        steps = watch_steps(runner, check)
        _run(engine, prompts)
    finally:
        engine.shutdown()
    assert any(decodes and tokens > decodes for tokens, decodes in steps), steps  # a mixed step ran
    pieces, eager = (torch.cat(errors[name]).median().item() for name in ("pieces", "eager"))
    _record(f"bf16 median error per token vs fp32 [{moe_model}]: pieces, eager", (pieces, eager))
    # Both round the same arithmetic in bf16: their medians over some thousand rows agree to a
    # few percent; twice the eager's, plus one bf16 ulp (relative), is a clear bar.
    assert pieces <= 2 * eager + torch.finfo(torch.bfloat16).eps, (pieces, eager)


def test_bf16_pieces_greedy_tokens_equal_eager_at_the_first_token(moe_model, prompts):
    """The prefill's answers (the first token of each prompt) through the pieces equal the eager
    engine's; later tokens may part after a routing near-tie (recorded)."""
    pieces, graphed = _engine_tokens(moe_model, prompts, dtype="bfloat16")
    eager, _ = _engine_tokens(moe_model, prompts, dtype="bfloat16", enforce_eager=True)
    assert graphed[1]
    _record(f"bf16 pieces vs eager identical sequences [{moe_model}]", sum(map(list.__eq__, pieces, eager)))
    assert [p[0] for p in pieces] == [e[0] for e in eager]
