"""EAGLE and EAGLE-3 speculation: heads written in their published checkpoint layouts (random
weights, config.json + safetensors), loaded from their directory.

- The drafts the workers propose equal those of a reference built from transformers' own Llama
  modules over transformers' target hidden states (tiny target, fp32): the published layouts,
  the features each head reads (final hidden state; three aux layers), d2t, and the head's own
  features fed back for the later drafts.
- On the real SmolLM2-135M-Instruct (fp32, CPU): greedy output equals decoding without
  speculation, token for token, for both methods, with chunked prefill and preemption, n = 2, and
  at tp 2. Correctness never depends on the head being good (a random head's drafts are mostly
  rejected).
- Heads that cannot feed on the target are refused at start.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.models import save_tiny_llama
from zllm import LLM, SamplingParams
from zllm.config import EngineConfig

# ---- heads in the published layouts ------------------------------------------------------------


def save_eagle_head(
    directory: Path,
    method: str,
    target_config: dict,
    *,
    draft_vocab_size: int | None = None,
    aux_layer_ids: list[int] | None = None,
    hidden_size: int | None = None,
    vocab_size: int | None = None,
    head_dim: int = 32,
    seed: int = 0,
) -> Path:
    """A random head as SafeAILab publishes them: EAGLE-1 (yuhuili/EAGLE-LLaMA3-Instruct-8B):
    fc [h, 2h] with bias, `layers.0.*` without input_layernorm, no embeddings or lm_head (the
    target's); EAGLE-3 (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): fc [h, 3h], `midlayer.*` with q/k/v
    over 2h inputs and a hidden_norm, `norm`, its own lm_head over draft_vocab_size tokens, d2t
    (draft id -> target id - draft id) and t2d (target tokens the head can draft)."""
    from safetensors.torch import save_file

    h = hidden_size or target_config["hidden_size"]
    vocab = vocab_size or target_config["vocab_size"]
    heads, kv_heads, inter = 4, 2, 96
    config = {
        "architectures": ["LlamaForCausalLMEagle3" if method == "eagle3" else "LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": target_config.get("rope_theta", 10000.0),
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    prefix = "midlayer" if method == "eagle3" else "layers.0"
    attn_in = 2 * h if method == "eagle3" else h
    tensors = {
        f"{prefix}.self_attn.q_proj.weight": rand(heads * head_dim, attn_in),
        f"{prefix}.self_attn.k_proj.weight": rand(kv_heads * head_dim, attn_in),
        f"{prefix}.self_attn.v_proj.weight": rand(kv_heads * head_dim, attn_in),
        f"{prefix}.self_attn.o_proj.weight": rand(h, heads * head_dim),
        f"{prefix}.mlp.gate_proj.weight": rand(inter, h),
        f"{prefix}.mlp.up_proj.weight": rand(inter, h),
        f"{prefix}.mlp.down_proj.weight": rand(h, inter),
        f"{prefix}.post_attention_layernorm.weight": 1 + rand(h),
    }
    if method == "eagle3":
        draft_vocab = draft_vocab_size or vocab
        config["draft_vocab_size"] = draft_vocab
        if aux_layer_ids is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids}
        kept = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values  # the head's tokens
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[kept] = True
        tensors |= {
            "fc.weight": rand(h, 3 * h, std=0.05),
            f"{prefix}.input_layernorm.weight": 1 + rand(h),
            f"{prefix}.hidden_norm.weight": 1 + rand(h),
            "norm.weight": 1 + rand(h),
            "lm_head.weight": rand(draft_vocab, h, std=0.5),
            "d2t": kept - torch.arange(draft_vocab),
            "t2d": t2d,
        }
    else:
        tensors |= {"fc.weight": rand(h, 2 * h, std=0.05), "fc.bias": rand(h)}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    return directory


# ---- the drafts against a transformers reference (tiny target) ---------------------------------


class ReferenceHead:
    """The head's math from transformers' own modules: a 1-layer LlamaModel fed inputs_embeds
    (EAGLE-1: fc(concat(embed, feature)); EAGLE-3: the feature, with the layer's input norm
    replaced by concat(input_layernorm(embed), hidden_norm(feature)) and q/k/v widened), the
    final norm applied outside the model so the pre-norm output can be fed back."""

    def __init__(self, head_dir: Path, method: str, target) -> None:
        import transformers
        from safetensors.torch import load_file

        self.method, self.target = method, target
        tensors = load_file(str(head_dir / "model.safetensors"))
        raw = json.loads((head_dir / "config.json").read_text())
        raw.pop("architectures")
        config = transformers.LlamaConfig(**{k: v for k, v in raw.items() if k != "eagle_config"})
        config._attn_implementation = "eager"
        model = transformers.LlamaModel(config).eval()
        h = config.hidden_size
        prefix = "midlayer." if method == "eagle3" else "layers.0."
        layer = model.layers[0]
        if method == "eagle3":
            for name in ("q_proj", "k_proj", "v_proj"):
                old = getattr(layer.self_attn, name)
                setattr(layer.self_attn, name, torch.nn.Linear(2 * h, old.out_features, bias=False))
            self.input_norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(h, config.rms_norm_eps)
            self.hidden_norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(h, config.rms_norm_eps)
            self.final_norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(h, config.rms_norm_eps)
            self.input_norm.weight.data.copy_(tensors[prefix + "input_layernorm.weight"])
            self.hidden_norm.weight.data.copy_(tensors[prefix + "hidden_norm.weight"])
            self.final_norm.weight.data.copy_(tensors["norm.weight"])
            self.lm_head, self.d2t = tensors["lm_head.weight"], tensors["d2t"]
            layer.input_layernorm = _ConcatEmbeds(self)
        else:
            layer.input_layernorm = torch.nn.Identity()
        model.norm = torch.nn.Identity()
        state = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
        missing, unexpected = layer.load_state_dict(
            {k: v for k, v in state.items() if not k.startswith(("input_layernorm", "hidden_norm"))}, strict=False
        )
        assert not unexpected and all(k.startswith("input_layernorm") for k in missing), (missing, unexpected)
        self.fc_weight, self.fc_bias = tensors["fc.weight"], tensors.get("fc.bias")
        self.model = model
        self.embeds: torch.Tensor | None = None

    def fc(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.fc_weight, self.fc_bias)

    @torch.no_grad()
    def drafts(self, token_ids: list[int], target_features: torch.Tensor, k: int) -> list[int]:
        """k greedy drafts after token_ids: position p takes token p + 1 and the target's feature
        of p; each draft position the previous draft and the head's own pre-norm output."""
        embed = self.target.model.embed_tokens
        tokens = list(token_ids[1:])
        features = self.fc(target_features) if self.method == "eagle3" else target_features
        drafts = []
        for _ in range(k):
            ids = torch.tensor([tokens])
            embeds = embed(ids)[0]
            if self.method == "eagle3":
                self.embeds, inputs = embeds, features
            else:
                inputs = self.fc(torch.cat([embeds, features], dim=-1))
            out = self.model(inputs_embeds=inputs[None], position_ids=torch.arange(len(tokens))[None])
            pre = out.last_hidden_state[0]
            if self.method == "eagle3":
                draft = int(torch.nn.functional.linear(self.final_norm(pre[-1]), self.lm_head).argmax())
                draft += int(self.d2t[draft])
            else:
                draft = int(self.target.lm_head(pre[-1]).argmax())
            drafts.append(draft)
            tokens.append(draft)
            features = torch.cat([features, pre[-1:]])
        return drafts


class _ConcatEmbeds(torch.nn.Module):
    """EAGLE-3's layer input in place of HF's input_layernorm: concat(norm(embeds), norm(feature))."""

    def __init__(self, head: ReferenceHead) -> None:
        super().__init__()
        self.head = [head]

    def forward(self, feature: torch.Tensor) -> torch.Tensor:
        head = self.head[0]
        return torch.cat([head.input_norm(head.embeds[None]), head.hidden_norm(feature)], dim=-1)


def _runner_steps(
    target_dir: Path,
    head_dir: Path,
    method: str,
    prompt: list[int],
    k: int,
    scored: list[list[int]],
    device: str,
    pieces: bool = False,
):
    """The workers' answers (a ModelRunner on `device`) to a prefill step, then one step per entry
    of `scored`: the request's last token and those drafts. [(tokens gained, drafts proposed)].
    pieces: the target runs as the piecewise graphs' pieces (eagerly on the CPU)."""
    from zllm.ipc.messages import CachedRequestData, NewRequestData, StepInput
    from zllm.workers.model_runner import ModelRunner

    config = EngineConfig.create(
        str(target_dir),
        device=device,
        dtype="float32",
        num_kv_blocks=16,
        piecewise_cuda_graphs=pieces,
        # Synchronous steps score the drafts each step names; async ones (the default with CUDA)
        # score the worker's own latest proposals in their place.
        async_scheduling=False,
        speculative_config={"method": method, "model": str(head_dir), "num_speculative_tokens": k},
    )
    runner = ModelRunner(config, torch.device(device))
    runner.load_model()
    runner.initialize_kv_cache(16)
    runner.capture_graphs()
    assert (runner.pieces is not None) == pieces
    blocks = [3, 7, 1, 5]  # not in order: the head's cache must follow the table
    new = NewRequestData("r", len(prompt), list(prompt), SamplingParams(temperature=0.0), blocks, 0)
    step = StepInput(
        step_id=1, new_requests=[new], cached_requests=[], scheduled_ids=["r"], num_scheduled_tokens=[len(prompt)]
    )
    answers = []
    computed = 0
    for step_id, drafts in enumerate([None, *scored], start=1):
        if drafts is not None:
            step = StepInput(
                step_id=step_id,
                new_requests=[],
                cached_requests=[CachedRequestData("r", [], computed)],
                scheduled_ids=["r"],
                num_scheduled_tokens=[1 + len(drafts)],
                spec_token_ids={"r": drafts} if drafts else {},
            )
        out = runner.execute_step(step)
        computed = runner.requests["r"].num_computed_tokens
        answers.append((list(out.sampled_token_ids), out.draft_token_ids["r"]))
    return answers


@pytest.mark.parametrize("pieces", [False, True], ids=["forward", "pieces"])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_drafts_equal_a_transformers_reference_head(tmp_path, method, pieces):
    """pieces: the target's forward split at attention (what the piecewise CUDA graphs capture),
    which keeps EAGLE-3's aux layers in a static buffer of its own."""
    check_drafts_against_reference(tmp_path, method, "cpu", pieces=pieces)


def check_drafts_against_reference(
    tmp_path: Path, method: str, device: str, shape: dict | None = None, head_dim: int = 32, pieces: bool = False
) -> None:
    """Tiny target of 8 layers (EAGLE-3 reads the input of layers 1, 4 and 6, as the head's config
    names), EAGLE-3's head over a reduced vocabulary mapped by d2t. After the prefill, after a
    step that accepts both drafts (the head catches up on three verified positions), after one
    that rejects the second, and after a plain decode, the drafts equal the reference's (run in
    fp32 on the CPU; the workers on `device`)."""
    import transformers

    target_dir = save_tiny_llama(
        tmp_path / "target", **{"hidden_size": 64, **(shape or {}), "num_hidden_layers": 8, "vocab_size": 256}
    )
    target_config = json.loads((target_dir / "config.json").read_text())
    aux = [1, 4, 6] if method == "eagle3" else None
    head_dir = save_eagle_head(
        tmp_path / "head", method, target_config, draft_vocab_size=96, aux_layer_ids=aux, head_dim=head_dim
    )
    target = transformers.LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    reference = ReferenceHead(head_dir, method, target)
    prompt = [5, 17, 200, 33, 9, 250, 71, 4, 120, 18, 3, 99, 41]
    with torch.no_grad():
        greedy = target.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, attention_mask=torch.ones(1, len(prompt))
        )[0, len(prompt) :].tolist()
    wrong = (greedy[4] + 1) % 256
    scored = [greedy[1:3], [greedy[4], wrong], []]  # accepted twice; once then rejected; none
    k = 3
    answers = _runner_steps(target_dir, head_dir, method, prompt, k, scored, device, pieces)
    assert [t for gained, _ in answers for t in gained] == greedy[:7]  # 1 + 3 + 2 + 1: the target's own
    tokens = list(prompt)
    for gained, drafts in answers:
        tokens += gained
        with torch.no_grad():
            hidden = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        # hidden_states[i]: the input of layer i; [-1]: the final (normed) output.
        if method == "eagle3":
            features = torch.cat([hidden[i][0] for i in aux], dim=-1)[:-1]
        else:
            features = hidden[-1][0][:-1]
        assert drafts == reference.drafts(tokens, features, k)
        if method == "eagle3":  # d2t applied: every draft is one of the head's tokens
            assert set(drafts) <= set((torch.arange(96) + reference.d2t).tolist())


# ---- the engine on the real SmolLM2-135M-Instruct (fp32, CPU) ----------------------------------

ENGINE = dict(device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=96)
PROMPTS = [
    "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
    "Count from 1 to 25, separated by commas: 1, 2, 3, 4, 5,",
    "Fix the spelling and repeat the text: Teh shop opnes at nine and closses at six every day.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
PAIR = SamplingParams(temperature=0.0, max_tokens=8, n=2)


def _tokens(llm: LLM, prompts, params) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def smollm() -> dict:
    """SmolLM2's directory, its config, and its greedy tokens without speculation."""
    model_dir = EngineConfig.create(None, device="cpu").model
    with LLM(**ENGINE) as llm:
        expected = {"greedy": _tokens(llm, PROMPTS, GREEDY), "pair": _tokens(llm, PROMPTS[:1], PAIR)}
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return {"dir": model_dir, "config": config, **expected}


@pytest.fixture(scope="module")
def heads(smollm, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("heads")
    return {
        "eagle": save_eagle_head(root / "eagle", "eagle", smollm["config"]),
        "eagle3": save_eagle_head(root / "eagle3", "eagle3", smollm["config"], draft_vocab_size=2048),
    }


@pytest.mark.slow
def test_eagle_greedy_output_equals_decoding_without_speculation(smollm, heads):
    """With chunked prefill and preemption: a 24-token budget splits every prompt into chunks
    (the head catches up chunk by chunk); 6 blocks of 16 tokens cannot hold the three requests
    to their end, so requests are preempted and recomputed. And n = 2."""
    small = dict(ENGINE, num_kv_blocks=6, max_num_batched_tokens=24)
    spec = {"method": "eagle", "model": str(heads["eagle"]), "num_speculative_tokens": 2}
    with LLM(**small, speculative_config=spec) as llm:
        assert _tokens(llm, PROMPTS, GREEDY) == smollm["greedy"]
        assert _tokens(llm, PROMPTS[:1], PAIR) == smollm["pair"]
        stats = llm.engine.core.stats()
    assert stats.num_preemptions > 0
    assert stats.spec_decode_num_draft_tokens > 0  # decode steps scored drafts
    assert len(stats.spec_decode_num_accepted_tokens_per_pos) <= 2


@pytest.mark.slow
def test_eagle3_greedy_output_at_tensor_parallel_2_equals_decoding_without_speculation(smollm, heads):
    spec = {"method": "eagle3", "model": str(heads["eagle3"]), "num_speculative_tokens": 2}
    with LLM(**ENGINE, tensor_parallel_size=2, speculative_config=spec) as llm:
        assert _tokens(llm, PROMPTS, GREEDY) == smollm["greedy"]
        assert llm.engine.core.stats().spec_decode_num_draft_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_heads_under_async_scheduling_equal_decoding_without_speculation(smollm, heads, method):
    """Under async scheduling the workers propose each step's drafts themselves, from the target's
    features of the step they just answered; chunked prefill and preemption as above."""
    small = dict(ENGINE, num_kv_blocks=6, max_num_batched_tokens=24, async_scheduling=True)
    spec = {"method": method, "model": str(heads[method]), "num_speculative_tokens": 2}
    with LLM(**small, speculative_config=spec) as llm:
        assert _tokens(llm, PROMPTS, GREEDY) == smollm["greedy"]
        stats = llm.engine.core.stats()
    assert stats.spec_decode_num_draft_tokens > 0


# ---- bad heads, refused at start ---------------------------------------------------------------


@pytest.mark.parametrize(
    "method, head, message",
    [
        (
            "eagle",
            {"hidden_size": 32},
            r"the head's hidden size \(32, target features 32\) does not match the target's \(64\)",
        ),
        ("eagle3", {"hidden_size": 32}, r"hidden size \(32, target features 32\) does not match the target's \(64\)"),
        ("eagle", {"vocab_size": 300}, r"the head's vocabulary \(300 tokens\) differs from the target's \(256\)"),
        ("eagle3", {"aux_layer_ids": [1, 2, 9]}, r"EAGLE-3 reads three target layers in 1..7, got \[1, 2, 9\]"),
    ],
)
def test_heads_that_cannot_feed_on_the_target_are_refused(tmp_path, method, head, message):
    target_dir = save_tiny_llama(tmp_path / "target", num_hidden_layers=8)
    target_config = json.loads((target_dir / "config.json").read_text())
    head_dir = save_eagle_head(tmp_path / "head", method, target_config, **head)
    with pytest.raises(ValueError, match=message):
        EngineConfig.create(
            str(target_dir), device="cpu", speculative_config={"method": method, "model": str(head_dir)}
        )


def test_an_eagle3_head_with_a_reduced_vocabulary_needs_d2t(tmp_path):
    from safetensors.torch import load_file, save_file

    target_dir = save_tiny_llama(tmp_path / "target", num_hidden_layers=8)
    head_dir = save_eagle_head(
        tmp_path / "head", "eagle3", json.loads((target_dir / "config.json").read_text()), draft_vocab_size=96
    )
    tensors = load_file(str(head_dir / "model.safetensors"))
    del tensors["d2t"]
    save_file(tensors, str(head_dir / "model.safetensors"))
    with pytest.raises(ValueError, match="draft_vocab_size 96 < vocab_size needs its d2t tensor"):
        EngineConfig.create(
            str(target_dir), device="cpu", speculative_config={"method": "eagle3", "model": str(head_dir)}
        )


def test_a_head_published_as_pytorch_model_bin_drafts_the_same(tmp_path):
    """The EAGLE authors publish pytorch_model.bin: read (weights only) as the safetensors are."""
    from safetensors.torch import load_file

    target_dir = save_tiny_llama(tmp_path / "target", num_hidden_layers=8)
    config = json.loads((target_dir / "config.json").read_text())
    head_dir = save_eagle_head(tmp_path / "head", "eagle3", config, draft_vocab_size=96)
    prompt = [5, 17, 200, 33, 9, 250, 71]
    expected = _runner_steps(target_dir, head_dir, "eagle3", prompt, 2, [[]], "cpu")
    tensors = load_file(str(head_dir / "model.safetensors"))
    torch.save(tensors, head_dir / "pytorch_model.bin")
    (head_dir / "model.safetensors").unlink()
    assert _runner_steps(target_dir, head_dir, "eagle3", prompt, 2, [[]], "cpu") == expected
