"""The model runner: keeps the persistent batch, turns a StepInput into tensors, runs the model.

The engine core sends each request in full once and then only diffs (new tokens, new blocks), so
the runner keeps every live request's tokens and block table between steps.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from zllm import envs
from zllm.config import EngineConfig
from zllm.ipc.messages import (
    CachedRequestData,
    GrammarBitmask,
    ImageInput,
    NewRequestData,
    StepInput,
    StepOutput,
    TokenLogprobs,
)
from zllm.kv_layout import KVLayout, cache_bytes_per_token, cache_entry
from zllm.model_spec import ModelSpec
from zllm.partition import head_shards
from zllm.quantization import keeps_fp8_blocks, resolve_quantization, weight_only_blocks
from zllm.sampling_params import SamplingParams
from zllm.workers.attention import KV_FP8, AttentionMetadata, pack_prefill, packed_prefill_of
from zllm.workers.distributed import TensorParallel
from zllm.workers.models import build_model
from zllm.workers.models.gpt_oss import GptOssMoeBlock
from zllm.workers.models.moe import SparseMoeBlock
from zllm.workers.multimodal import Chunk, MRopeState, MultimodalRunner, ProfileImages
from zllm.workers.ops import TorchOps, ops_for
from zllm.workers.request_failures import RequestFailures
from zllm.workers.sampler import LogprobsTensors, apply_token_bitmask, compute_logprobs, sample
from zllm.workers.sampling_batch import SamplingBatch
from zllm.workers.spec_decode import make_proposer
from zllm.workers.spec_decode.rejection_sampler import DraftLayout, Verified, verify
from zllm.workers.transfer import to_device
from zllm.workers.weight_loader import finish_loading, init_dummy_weights, load_safetensors

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_GIB = 1 << 30
# A step's prompt tokens become decode rows only while they average at most this many context
# tokens: the decode kernel then reads ~L^2/2 keys for an L-token chunk (from L2, the chunk's own
# blocks), against the GEMMs' and the host's cost of the step; a long prefix is packed prefill's.
_ROWS_MAX_MEAN_CONTEXT = 1024


def moe_graph_safe(spec: ModelSpec, ops: TorchOps, dtype: torch.dtype) -> bool:
    """Whether a decode graph can hold the model's MoE layers (True without any): GPT-OSS's
    experts run graph-safe on CUDA in every dtype (ops.gpt_oss_experts: grouped GEMMs or every
    expert); the others through the fused MoE kernels, which take fp16 and bf16 (DeepSeek's
    grouped / noaux_tc routing is torch arithmetic on the device, no sync)."""
    if spec.moe is None or not spec.moe.layers:  # no MoE layer (DeepSeek's first_k_dense_replace = all)
        return True
    if spec.moe.format.gpt_oss:
        return ops.supports_graphs
    return ops.fuses_moe(dtype)


class OutOfDeviceMemoryError(RuntimeError):
    """The model or its KV cache does not fit; the message has the numbers."""


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt_len: int
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingParams
    row: int = -1  # in the sampling batch
    sliding_block_ids: list[int] = field(default_factory=list)  # a hybrid model's sliding layers' table
    # Prompt logprobs computed so far (chunked prefill); None once sent, or when not wanted.
    prompt_logprobs: list[LogprobsTensors] | None = None
    mm_inputs: list[ImageInput] = field(default_factory=list)  # a vision-language model's images
    mrope: MRopeState | None = None  # their M-RoPE positions
    lora_id: int = 0  # its LoRA adapter; 0: the base model


@dataclass(slots=True)
class PromptSpan:
    """Positions of a request's prompt computed this step whose next prompt token is known."""

    state: RequestState
    first_index: int  # into the step's hidden states
    first_position: int
    count: int


@dataclass(slots=True)
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionMetadata
    logits_indices: torch.Tensor  # the last token of each request that samples this step (and its drafts')
    sampling_states: list[RequestState]
    prompt_spans: list[PromptSpan] = field(default_factory=list)
    scheduled_states: list[RequestState] = field(default_factory=list)
    # Speculative decoding: the drafts each sampling request is scored with (None: a step without).
    layout: DraftLayout | None = None
    # A vision-language model's image tokens: (rows of the step, their embeddings).
    mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    token_lora_ids: np.ndarray | None = None  # with LoRA: each token's adapter id (0: the base model)
    # Request id -> (its first position computed this step, that token's row): an EAGLE head's features.
    feature_rows: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class LaunchedStep:
    """A step whose device work is queued: `sample_step` adds its tokens (on the device, with a
    copy to the host on its way), `finish_step` waits for them."""

    step_id: int
    sampling_states: list[RequestState] = field(default_factory=list)
    scheduled_states: list[RequestState] = field(default_factory=list)
    layout: DraftLayout | None = None  # speculative decoding: tokens are [requests, width], -1 padded
    prompt_logprobs: dict[str, list[LogprobsTensors]] = field(default_factory=dict)
    logits: torch.Tensor | None = None  # rank 0, until sampled
    tokens: torch.Tensor | None = None  # sampled, on the device (every rank)
    host_tokens: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None  # recorded after the copy to the host
    logprobs: LogprobsTensors | None = None


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str | None = None) -> torch.dtype:
    """The serving dtype. "auto": float32 on CPU; on a GPU the checkpoint's half-precision dtype,
    and bfloat16 for float32 (or unspecified) checkpoints, as vLLM does."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES[checkpoint_dtype] if checkpoint_dtype in ("float16", "bfloat16") else torch.bfloat16


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device, tp: TensorParallel | None = None) -> None:
        self.config = config
        self.device = device
        # What other engines of this process hold already (LLM objects side by side): the profile
        # counts only this engine's own allocations against its gpu_memory_utilization.
        self._allocated_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        self.tp = tp or TensorParallel()
        self.sync_wait_s = 0.0  # how long the last finish_step waited for its tokens
        self.spec = ModelSpec.from_pretrained(config.model)
        self.dtype = resolve_dtype(config.dtype, device, self.spec.checkpoint_dtype)
        self.quant = resolve_quantization(
            self.spec.quantization, config.quantization, config.load_format == "dummy", self.spec.moe is not None
        )
        if self.spec.block_fp8 is not None and keeps_fp8_blocks(envs.ZLLM_FP8_BLOCKS, device.type == "cuda"):
            # The layers hold the stored FP8 weights; the loader reads them as stored.
            self.quant = weight_only_blocks(self.spec.block_fp8, config.load_format == "dummy")
            self.spec = dataclasses.replace(self.spec, dequantize_fp8_blocks=False)
        heads = head_shards(self.spec.num_heads, self.spec.num_kv_heads, self.tp.size)[self.tp.rank]
        self.num_heads = heads.q_heads.count  # on this rank
        self.num_kv_heads = heads.kv_heads.count
        self.block_size = config.block_size
        self.kv_cache_dtype = KV_FP8 if config.kv_cache_dtype.startswith("fp8") else self.dtype
        self.kv_layout = KVLayout.of(self.spec, config)
        self.hybrid = self.kv_layout.is_hybrid  # two block tables a request (zllm/kv_layout.py)
        self.ops = ops_for(device)
        self.packs_prefill = self.ops.packs_prefill(self.dtype, self.spec.head_dim)
        self.is_cuda = device.type == "cuda"
        # The CUDA kernels take int32 block tables; torch indexing takes int64.
        self.index_dtype = torch.int32 if self.is_cuda else torch.long
        self.model = None
        self.kv_caches: list[torch.Tensor] = []
        self.requests: dict[str, RequestState] = {}
        self.sampling = SamplingBatch(config.max_num_seqs, self.spec.vocab_size, device)
        self.awaiting_prompt_logprobs: dict[str, RequestState] = {}  # prefill not done yet
        # The last sampled step's tokens while they are on their way to the host: request id ->
        # (its state, its index in those tokens).
        self._in_flight: dict[str, tuple[RequestState, int]] = {}
        self._in_flight_tokens: torch.Tensor | None = None
        self.failures = RequestFailures()  # new requests this worker could not take, until reported
        self.graphs = None
        self.pieces = None  # EagerPieces / PiecewiseGraphs: steps with prefill (piecewise_cuda_graphs)
        self.proposer = None  # speculative decoding: drafts for the requests that sampled (load_model)
        # The latest drafts proposed for each request, which async steps ask for (-1 placeholders).
        self.drafts: dict[str, list[int]] = {}
        self.mm: MultimodalRunner | None = None  # a vision-language model's images (load_model)
        self.lora = None  # LoRAManager with enable_lora (load_model)

    # ---- set-up --------------------------------------------------------------------------------

    def load_model(self) -> None:
        try:
            with _default_dtype(self.dtype), torch.device(self.device):
                model = build_model(self.spec, self.ops, self.tp, self.quant, self.config.max_model_len)
            if self.config.load_format == "dummy":
                init_dummy_weights(model, self.config.seed)
            else:
                load_safetensors(model, self.config.model)
            finish_loading(model)
        except torch.cuda.OutOfMemoryError:
            raise OutOfDeviceMemoryError(self._weights_do_not_fit()) from None
        self.model = model.eval()
        if hasattr(model, "carry_norms"):  # ZLLM_NORM_GEMV: before LoRA's slots, after the weights
            model.carry_norms(self.config.enable_lora)
        if self.config.enable_lora:
            from zllm.workers.lora import LoRAManager

            self.lora = LoRAManager(self.model, self.config, self.spec, self.tp)
        self.proposer = make_proposer(self)
        if self.spec.vision is not None:
            self.mm = MultimodalRunner(self.model, self.spec.vision, self.device, self.dtype)

    def _weights_do_not_fit(self) -> str:
        spec = self.spec
        moe = spec.moe
        sparse = len(moe.layers) if moe else 0
        params = (
            spec.num_layers
            * (
                spec.hidden_size * (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
                + spec.num_heads * spec.head_dim * spec.hidden_size
            )
            + (spec.num_layers - sparse) * 3 * spec.hidden_size * spec.intermediate_size
        )
        if moe:  # every expert, the router, the shared expert and its gate
            params += (
                sparse
                * spec.hidden_size
                * (moe.num_experts * (3 * moe.intermediate_size + 1) + 3 * moe.shared_expert_intermediate_size + 1)
            )
        params += spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
        free, total = torch.cuda.mem_get_info(self.device)
        size = params * self.dtype.itemsize
        if self.quant is not None:  # the projections in one byte per weight, the rest in the dtype
            projections = params - spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
            size -= projections * (self.dtype.itemsize - 1)
        return (
            f"rank {self.tp.rank}: model weights need about {size / _GIB:.1f} GiB with "
            f"{self.dtype}{' and fp8' if self.quant else ''} ({size / self.tp.size / _GIB:.1f} GiB per rank at tp "
            f"{self.tp.size}), but only {free / _GIB:.1f} GiB of {total / _GIB:.1f} GiB are free on {self.device}"
        )

    def kv_cache_bytes_per_block(self) -> int:
        per_token = cache_bytes_per_token(self.spec, self.num_kv_heads, self.kv_cache_dtype.itemsize)
        draft = self.proposer.kv_cache_bytes_per_block() if self.proposer is not None else 0
        return per_token * self.block_size + draft

    def determine_num_kv_blocks(self) -> int:
        if not self.is_cuda:
            num_blocks = self.config.kv_cache_memory_bytes // self.kv_cache_bytes_per_block()
            logger.info(
                "KV cache %.2f GiB %s: %d blocks",
                self.config.kv_cache_memory_bytes / _GIB,
                self._kv_cache_dtype_note(),
                num_blocks,
            )
            return num_blocks
        return self._profile_kv_blocks()

    def _kv_cache_dtype_note(self) -> str:
        """What the KV cache holds per value, and what FP8 gains over the model dtype."""
        if self.kv_cache_dtype == self.dtype:
            return f"in {_dtype_name(self.dtype)}"
        ratio = self.dtype.itemsize / self.kv_cache_dtype.itemsize
        return (
            f"in {_dtype_name(self.kv_cache_dtype)} ({self.kv_cache_dtype.itemsize} byte per value: "
            f"{ratio:g}x the tokens of a {_dtype_name(self.dtype)} cache)"
        )

    def _model_bytes(self) -> int:
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors if t.device.type == "cuda")

    def _profile_kv_blocks(self) -> int:
        """Blocks that fit in gpu_memory_utilization after weights and a forward at the token budget."""
        if self.ops.supports_graphs:
            self._reserve_decode_workspace()  # counted below with the weights
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        allocated = torch.cuda.memory_allocated(self.device)
        # This engine's weights and buffers; never less than its model's own tensors, should another
        # engine of this process have freed memory since this one began.
        weights = max(allocated - self._allocated_before, self._model_bytes())
        profile_kv = self._profile_forward()
        torch.cuda.synchronize(self.device)
        activations = torch.cuda.max_memory_allocated(self.device) - allocated - profile_kv
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        not_torch = (total - free) - torch.cuda.memory_reserved(self.device)  # CUDA context, cuBLAS, other processes
        # Never more than is free beside the activations: engines whose shares add up past the GPU
        # fail here, not when the cache is allocated.
        budget = min(total * self.config.gpu_memory_utilization - weights - activations - not_torch, free - activations)
        num_blocks = int(budget // self.kv_cache_bytes_per_block())
        logger.info(
            "memory: %.2f GiB total x %.2f; weights %.2f GiB, activation peak %.2f GiB, other %.2f GiB -> "
            "KV cache %.2f GiB %s (%d blocks)",
            total / _GIB,
            self.config.gpu_memory_utilization,
            weights / _GIB,
            activations / _GIB,
            not_torch / _GIB,
            max(budget, 0) / _GIB,
            self._kv_cache_dtype_note(),
            max(num_blocks, 0),
        )
        if num_blocks < 1:
            raise OutOfDeviceMemoryError(
                f"no room for a KV cache: weights {weights / _GIB:.2f} GiB + activations {activations / _GIB:.2f} GiB "
                f"+ other {not_torch / _GIB:.2f} GiB exceed {self.config.gpu_memory_utilization:.0%} of "
                f"{total / _GIB:.1f} GiB; raise --gpu-memory-utilization or lower --max-num-batched-tokens"
            )
        return num_blocks

    @torch.inference_mode()
    def _profile_forward(self) -> int:
        """Run one forward over max_num_batched_tokens prompt tokens (a vision-language model's
        largest images encoded first and held in its encoder cache meanwhile: ProfileImages);
        returns the bytes of the scratch KV cache it used (not an activation)."""
        tokens = min(self.config.max_num_batched_tokens, self.config.max_model_len * self.config.max_num_seqs)
        per_request = min(tokens, self.config.max_model_len)
        blocks_per_request = -(-per_request // self.block_size)
        num_requests = -(-tokens // per_request)
        self.initialize_kv_cache(blocks_per_request * num_requests, split=False)
        step = StepInput(step_id=0, new_requests=[], cached_requests=[], scheduled_ids=[], num_scheduled_tokens=[])
        sampling = SamplingParams(temperature=0.0)
        images = ProfileImages.plan(self.spec.vision, self.config) if self.mm is not None else None
        for r in range(num_requests):
            count = min(per_request, tokens - r * per_request)
            blocks = list(range(r * blocks_per_request, (r + 1) * blocks_per_request))
            step.new_requests.append(
                NewRequestData(
                    f"profile-{r}",
                    count,
                    [0] * count,
                    sampling,
                    blocks,
                    0,
                    sliding_block_ids=blocks if self.hybrid else [],
                    mm_inputs=self.mm.profile_spans(images, count) if images is not None else [],
                )
            )
            step.scheduled_ids.append(f"profile-{r}")
            step.num_scheduled_tokens.append(count)
        if images is not None:
            logger.info(
                "memory profile: %d image(s) of %d tokens (grid %s) in the encoder cache, one encoded",
                images.count,
                images.tokens,
                images.grid,
            )
            self.mm.hold_profile_images(images)
        self.execute_step(step)
        if images is not None:
            self.mm.drop_profile_images()
        if self.proposer is not None:
            for request_id in self.requests:
                self.proposer.forget(request_id)
        self.requests.clear()
        self.drafts.clear()
        self.sampling.clear()
        self.awaiting_prompt_logprobs.clear()
        self._in_flight, self._in_flight_tokens = {}, None
        scratch = sum(c.numel() * c.element_size() for c in self.kv_caches)
        if self.proposer is not None:
            scratch += self.proposer.release_kv_cache()
        self.kv_caches = []
        return scratch

    def initialize_kv_cache(self, num_blocks: int, split: bool = True) -> None:
        """num_blocks blocks of every layer's bytes; split: divided between a hybrid model's full
        and sliding layers as the engine core divides its pools (else num_blocks in each layer).
        Zero-filled: a sliding table's null block (and any slot never written) reads as zeros."""
        blocks_of = [num_blocks] * self.spec.num_layers
        if split:
            for group in self.kv_layout.groups(num_blocks):
                for layer in group.layers:
                    blocks_of[layer] = group.num_blocks
        parts, heads, values = cache_entry(self.spec, self.num_kv_heads)
        try:
            self.kv_caches = [
                torch.zeros(
                    (parts, blocks, self.block_size, heads, values),
                    dtype=self.kv_cache_dtype,
                    device=self.device,
                )
                for blocks in blocks_of
            ]
            if self.proposer is not None:
                self.proposer.initialize_kv_cache(num_blocks)
        except torch.cuda.OutOfMemoryError:
            raise OutOfDeviceMemoryError(
                f"KV cache of {num_blocks} blocks needs {num_blocks * self.kv_cache_bytes_per_block() / _GIB:.2f} GiB, "
                "more than is free"
            ) from None

    def release_device_memory(self) -> None:
        """Drop everything that holds device memory: the graphs (decode and piecewise: both keep the
        KV cache and the model alive), the KV cache, the model and the in-flight step."""
        self.graphs = None
        self.pieces = None
        self.kv_caches = []
        self.model = None
        self.proposer = None
        self.mm = None
        self.lora = None
        self._in_flight, self._in_flight_tokens = {}, None
        if getattr(self.ops, "workspace", None) is not None:
            self.ops.workspace = None  # the decode attention's scratch (a graph held its address)

    def capture_graphs(self) -> None:
        """Capture decode CUDA graphs (after the KV cache exists), and the piecewise ones where
        asked for."""
        self._set_up_pieces()
        if not (self.is_cuda and self.ops.supports_graphs):
            return
        self._reserve_decode_workspace()
        if self.config.enforce_eager:
            return
        if getattr(self.model, "aux_hidden_layers", ()):
            logger.info(
                "decode CUDA graphs off: EAGLE-3 reads the target's inner layers, which they do not keep "
                "(the piecewise graphs do)"
            )
            return
        if self.lora is not None and not self.lora.graph_safe:
            logger.info("decode CUDA graphs off: LoRA's torch path groups each step's rows on the host")
            return
        if (blocker := self._moe_graph_blocker()) is not None:
            logger.info("decode CUDA graphs off: %s", blocker)
            return
        from zllm.workers.cuda_graphs import DecodeGraphs

        max_blocks = -(-self.config.max_model_len // self.block_size)
        self.graphs = DecodeGraphs(
            self.model, self.kv_caches, self.decode_rows_capacity, max_blocks, self.block_size, self.hybrid
        )
        with torch.inference_mode():
            self.graphs.capture()

    def _reserve_decode_workspace(self) -> None:
        """The decode attention's split-K scratch, once (a captured graph holds its address). It is
        reserved before the KV cache is sized, so the memory profile counts it."""
        if self.ops.workspace is not None:
            return
        from zllm.workers.cuda_graphs import graph_batch_sizes

        window = self.spec.sliding_window
        # A graph's grid covers the block table's capacity: max_model_len in whole blocks.
        capacity = -(-self.config.max_model_len // self.block_size) * self.block_size
        self.ops.reserve_decode_workspace(
            self.config.max_num_seqs,
            self.num_heads,
            self.spec.head_dim,
            capacity,
            self.device,
            graph_sizes=tuple(graph_batch_sizes(self.decode_rows_capacity)),
            kv_heads=self.num_kv_heads,
            windows=(window,) if window else (),
            eager_shapes=self._proposer_attention_shapes(),
        )

    def _proposer_attention_shapes(self) -> tuple[tuple[int, int, int, int], ...]:
        """(rows, heads, kv heads, head_dim) of a draft model's or EAGLE head's attention on this
        rank: it decodes through these ops and their workspace, eagerly, up to a row per position
        a step holds."""
        shape = getattr(self.proposer, "attention_shape", None)
        return () if shape is None else ((self.decode_rows_capacity, *shape),)

    @property
    def decode_rows_capacity(self) -> int:
        """The most rows a decode step holds: a request each, or a mixed step's every token
        (mixed_graph_max_tokens)."""
        return max(self.config.max_num_seqs, self.config.mixed_graph_max_tokens or 0)

    def _prefill_as_rows(self, step: StepInput) -> bool:
        """mixed_graph_max_tokens: this step's prompt tokens go in as decode rows, one per token
        (row p attends to the cache up to position p: causal by its length), so the whole step
        replays a decode CUDA graph instead of launching each layer's attention from the host.
        Only for short contexts: each row reads its whole context, where packed prefill reads a
        request's once (_ROWS_MAX_MEAN_CONTEXT)."""
        limit = self.config.mixed_graph_max_tokens
        if not limit or self.mm is not None or (self.is_cuda and self.graphs is None):
            return False
        tokens = sum(step.num_scheduled_tokens)
        if tokens > limit or (self.graphs is not None and self.graphs.bucket(tokens) is None):
            return False
        drafted = step.spec_token_ids or {}
        rows = keys = 0
        for request_id, count in zip(step.scheduled_ids, step.num_scheduled_tokens):
            if count > 1 and request_id not in drafted:
                start = self.requests[request_id].num_computed_tokens
                rows += count
                keys += count * start + count * (count + 1) // 2  # row p reads p + 1 keys
        return rows > 0 and keys <= rows * _ROWS_MAX_MEAN_CONTEXT

    def _set_up_pieces(self) -> None:
        """piecewise_cuda_graphs: steps with prefill run the forward as pieces split at attention,
        captured as CUDA graphs on a GPU; on CPU the same pieces run eagerly (what tests check)."""
        if not self.config.piecewise_cuda_graphs or self.config.enforce_eager:
            return
        if self.spec.mla is not None:
            # MLA's cache write drops padded rows by a value read on the host (models/deepseek.py
            # write_latent), and its queries and attention output differ in width, where the
            # pieces keep one [tokens, heads, head_dim] buffer for both.
            logger.info("piecewise CUDA graphs off: not yet for %s's latent attention", self.spec.architecture)
            return
        from zllm.workers.piecewise_graphs import EagerPieces, PiecewiseGraphs, piecewise_sizes

        sizes = piecewise_sizes(self.config.max_num_batched_tokens)
        if not (self.is_cuda and self.ops.supports_graphs) or (self.lora is not None and not self.lora.graph_safe):
            self.pieces = EagerPieces(self.model, self.kv_caches, sizes, self.hybrid)
            return
        if (blocker := self._moe_graph_blocker()) is not None:
            logger.info("piecewise CUDA graphs off: %s", blocker)
            return
        self.pieces = PiecewiseGraphs(self.model, self.kv_caches, sizes, self.hybrid)
        with torch.inference_mode():
            self.pieces.capture()

    def _moe_graph_blocker(self) -> str | None:
        """Why no CUDA graph, decode or piecewise, can hold this model's MoE layers (None: one can).
        Graphs hold them where the experts run fused (ops.fuses_experts): every shape then follows
        the token count alone. The torch expert loop reads which tokens chose each expert on the
        host (nonzero, tolist): a sync that no capture survives."""
        blocks = [m for m in self.model.modules() if isinstance(m, (SparseMoeBlock, GptOssMoeBlock))]
        if moe_graph_safe(self.spec, self.ops, self.dtype) and all(block.graph_safe for block in blocks):
            return None
        return (
            f"{self.spec.architecture}'s experts run in the torch loop in {self.dtype}, which syncs with the "
            "host (the fused MoE kernels take float16 and bfloat16, H and I multiples of 8, at most 512 "
            "experts and top 32; GPT-OSS's experts need CUDA)"
        )

    # ---- one step ------------------------------------------------------------------------------
    #
    # A step is launched (inputs, forward, logits: device work queued, no host sync), then sampled
    # (its tokens stay on the device, where the next step reads them), then finished (the tokens
    # reach the host). Under async scheduling the worker launches step N+1 before it finishes
    # step N, so the device always has the next forward queued while the host catches up.

    @torch.inference_mode()
    def execute_step(self, step: StepInput) -> StepOutput:
        """Launch, sample and finish one step (synchronous)."""
        launched = self.launch_step(step)
        self.sample_step(launched)
        return self.finish_step(launched)

    @torch.inference_mode()
    def launch_step(self, step: StepInput) -> LaunchedStep:
        self._update_states(step)
        if self.mm is not None:
            self.mm.update_cache(step, self._images_of)
        launched = LaunchedStep(step_id=step.step_id)
        if step.is_empty:
            return launched
        if step.spec_token_ids and self.config.async_scheduling:
            step = self._with_own_drafts(step)
        batch = self._prepare_inputs(step)
        if self.lora is not None:
            self.lora.prepare(batch.token_lora_ids)
        hidden = self._forward(batch)
        if self.proposer is not None and self.proposer.needs_features:
            self.proposer.keep_features(hidden, batch.feature_rows)
        if batch.prompt_spans:
            self._compute_prompt_logprobs(hidden, batch.prompt_spans)
        launched.prompt_logprobs = self._finished_prompt_logprobs()
        launched.sampling_states = batch.sampling_states
        launched.scheduled_states = batch.scheduled_states
        launched.layout = batch.layout
        if batch.sampling_states:
            # Every rank takes part in the gather; only rank 0 gets logits.
            launched.logits = self.model.compute_logits(hidden[batch.logits_indices])
        return launched

    def _with_own_drafts(self, step: StepInput) -> StepInput:
        """Async speculative decoding: the step asks for up to n drafts per request (-1
        placeholders); it scores the drafts proposed here after the request's last step, at most n,
        and the request computes that many fewer tokens when there are fewer (the core's
        answer-time roll-back covers the difference)."""
        resolved = copy.copy(step)  # the message itself stays as sent (in-process, the core's object)
        resolved.spec_token_ids, resolved.num_scheduled_tokens = {}, list(step.num_scheduled_tokens)
        index = {request_id: i for i, request_id in enumerate(step.scheduled_ids)}
        for request_id, wanted in step.spec_token_ids.items():
            own = self.drafts.get(request_id, [])[: len(wanted)]
            resolved.num_scheduled_tokens[index[request_id]] -= len(wanted) - len(own)
            if own:
                resolved.spec_token_ids[request_id] = own
        return resolved

    @torch.inference_mode()
    def sample_step(self, launched: LaunchedStep, grammar: GrammarBitmask | None = None) -> None:
        """Sample on rank 0 (the rows of structured requests under `grammar`'s bitmask) and share
        the tokens with every rank, on the device; start copying them to the host. The host-side
        token lists must be current (finish the previous step first)."""
        states = launched.sampling_states
        if not states:
            return
        if launched.layout is not None:
            self._verify_drafts(launched, grammar)
        elif launched.logits is not None:
            if grammar is not None:
                self._mask_by_grammar(launched.logits, states, grammar)
            meta = self.sampling.metadata([s.row for s in states])
            tokens = sample(launched.logits, meta)
            if meta.max_num_logprobs is not None:
                launched.logprobs = compute_logprobs(launched.logits, tokens, meta.max_num_logprobs)
            launched.tokens = tokens
        else:
            launched.tokens = torch.empty(len(states), dtype=torch.long, device=self.device)
        launched.logits = None
        launched.tokens = self.tp.broadcast_from_first(launched.tokens)
        if launched.layout is None:  # steps with drafts are never pipelined (synchronous scheduling)
            self._in_flight = {state.request_id: (state, index) for index, state in enumerate(states)}
            self._in_flight_tokens = launched.tokens
        launched.host_tokens = self._copy_to_host(launched.tokens)
        if self.is_cuda:
            launched.ready = torch.cuda.Event()
            launched.ready.record()

    def _verify_drafts(self, launched: LaunchedStep, grammar: GrammarBitmask | None) -> None:
        """Rank 0 scores every sampling request's drafts with the rejection sampler; the tokens
        each gains are [requests, width], -1 padded (every rank gets them)."""
        states, layout = launched.sampling_states, launched.layout
        if launched.logits is None:
            launched.tokens = torch.empty((len(states), layout.width), dtype=torch.long, device=self.device)
            return
        if grammar is not None:  # a constrained request's rows from its first: one bitmask row per position
            self._mask_by_grammar(launched.logits, states, grammar, layout.first_row)
        rows = [state.row for state, drafts in zip(states, layout.drafts) for _ in range(len(drafts) + 1)]
        meta = self.sampling.metadata(rows, layout.drafted_before())
        verified: Verified = verify(launched.logits, meta, layout)
        if meta.max_num_logprobs is not None:
            launched.logprobs = compute_logprobs(launched.logits, verified.row_tokens(), meta.max_num_logprobs)
        launched.tokens = verified.tokens

    @torch.inference_mode()
    def finish_step(self, launched: LaunchedStep) -> StepOutput:
        """Wait for the step's tokens, add them to the requests it sampled, and answer."""
        waited = time.monotonic()
        if launched.ready is not None:
            launched.ready.synchronize()
        self.sync_wait_s = time.monotonic() - waited  # ZLLM_STEP_TRACE's sync_s: the device was still busy
        states = launched.sampling_states
        gained = self._tokens_gained(launched)
        rows, kept, answered_ids, answered_tokens, logprob_rows = [], [], [], [], []
        for index, (state, tokens) in enumerate(zip(states, gained)):
            answered_ids.extend([state.request_id] * len(tokens))
            answered_tokens.extend(tokens)
            first_row = launched.layout.first_row[index] if launched.layout is not None else index
            logprob_rows.extend(range(first_row, first_row + len(tokens)))
            # A request dropped (finished, preempted) since may have a new owner of its row.
            if self.requests.get(state.request_id) is state:
                state.token_ids.extend(tokens)
                rows.extend([state.row] * len(tokens))
                kept.extend(tokens)
                if launched.layout is not None:  # its rejected drafts were computed, but are not its tokens
                    state.num_computed_tokens -= len(launched.layout.drafts[index]) - (len(tokens) - 1)
        self.sampling.append_sampled(rows, kept)
        if self._in_flight_tokens is launched.tokens:
            self._in_flight, self._in_flight_tokens = {}, None
        drafts = self._propose(launched) if self.proposer is not None else {}
        if self.drafts:  # what these requests drafted before is stale now
            for state in states:
                self.drafts.pop(state.request_id, None)
        self.drafts.update(drafts)
        scored = {}
        if launched.layout is not None:
            scored = {s.request_id: len(d) for s, d in zip(states, launched.layout.drafts) if d}
        logprobs = launched.logprobs
        if logprobs is not None and launched.layout is not None:
            logprobs = _select_rows(logprobs, logprob_rows)
        return StepOutput(
            step_id=launched.step_id,
            request_ids=answered_ids if self.tp.is_first else [],
            sampled_token_ids=answered_tokens if self.tp.is_first else [],
            logprobs=None if logprobs is None else _to_message(logprobs),
            prompt_logprobs={rid: _concat_to_message(parts) for rid, parts in launched.prompt_logprobs.items()},
            failed_requests=self.failures.take(),  # new requests it could not take, since the last answer
            # Under async scheduling the next step is on its way already: these tell the core which
            # requests to ask drafts for in the step after it.
            draft_token_ids=drafts if self.tp.is_first else {},
            num_drafts_scored=scored if self.tp.is_first else {},
        )

    def _tokens_gained(self, launched: LaunchedStep) -> list[list[int]]:
        """Per sampling request, the tokens this step gave it (one, or with drafts up to k + 1)."""
        if not launched.sampling_states:
            return []
        host = launched.host_tokens.tolist()
        if launched.layout is None:
            return [[token] for token in host]
        return [[token for token in row if token >= 0] for row in host]

    def _propose(self, launched: LaunchedStep) -> dict[str, list[int]]:
        """Drafts for the next step of each request that sampled and goes on here, unless the
        batch is past the speculative config's disable_by_batch_size."""
        off_at = self.config.speculative_config.disable_by_batch_size
        if off_at is not None and len(self.requests) >= off_at:
            return {}
        live = [s for s in launched.sampling_states if self.requests.get(s.request_id) is s]
        scheduled = [s for s in launched.scheduled_states if self.requests.get(s.request_id) is s]
        return self.proposer.propose(scheduled, live)

    def _mask_by_grammar(
        self,
        logits: torch.Tensor,
        states: list[RequestState],
        grammar: GrammarBitmask,
        logit_rows: list[int] | None = None,
    ) -> None:
        """-inf, in place, for every token a request's grammar does not allow next. The logprobs
        are then those of the constrained distribution, as in vLLM. logit_rows: each state's row
        of `logits` (default: the i-th state's row i)."""
        index = {state.request_id: (logit_rows[i] if logit_rows else i) for i, state in enumerate(states)}
        present, targets, seen = [], [], {}
        for k, request_id in enumerate(grammar.request_ids):
            if request_id in index:  # a request scored with drafts has a row per position, in order
                present.append(k)
                targets.append(index[request_id] + seen.get(request_id, 0))
                seen[request_id] = seen.get(request_id, 0) + 1
        if not present:
            return  # each was dropped here (it failed on this worker)
        rows = self._to_device(targets)
        bitmask = to_device(np.ascontiguousarray(grammar.rows()[present]), self.device)
        apply_token_bitmask(logits, rows, bitmask)

    def _copy_to_host(self, tokens: torch.Tensor) -> torch.Tensor:
        if not self.is_cuda:
            return tokens
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        return host.copy_(tokens, non_blocking=True)

    def _to_device(self, values: np.ndarray | list[int]) -> torch.Tensor:
        return to_device(np.asarray(values, dtype=np.int64), self.device)

    def _compute_prompt_logprobs(self, hidden: torch.Tensor, spans: list[PromptSpan]) -> None:
        """Logprobs of each prompt token given the tokens before it, for the positions computed
        this step; kept on the request (on the device) until its prefill completes."""
        indices = np.concatenate([np.arange(s.first_index, s.first_index + s.count) for s in spans])
        targets = [t for s in spans for t in s.state.token_ids[s.first_position + 1 : s.first_position + 1 + s.count]]
        num_top = max(s.state.sampling.prompt_logprobs for s in spans)
        logits = self.model.compute_logits(hidden[self._to_device(indices)])  # every rank; rank 0 gets them
        if logits is None:
            return
        result = compute_logprobs(logits, self._to_device(targets), num_top)
        start = 0
        for span in spans:
            rows = slice(start, start + span.count)
            span.state.prompt_logprobs.append(
                LogprobsTensors(result.token_ids[rows], result.logprobs[rows], result.ranks[rows])
            )
            start += span.count

    def _finished_prompt_logprobs(self) -> dict[str, list[LogprobsTensors]]:
        """The prompt logprobs of the requests whose prefill completed this step."""
        done = {}
        for request_id, state in list(self.awaiting_prompt_logprobs.items()):
            if state.num_computed_tokens >= state.prompt_len:
                done[request_id] = state.prompt_logprobs
                state.prompt_logprobs = None
                del self.awaiting_prompt_logprobs[request_id]
        return done

    def _images_of(self, request_id: str) -> list[ImageInput] | None:
        state = self.requests.get(request_id)
        return None if state is None else state.mm_inputs

    def _forward(self, batch: BatchInputs) -> torch.Tensor:
        meta = batch.attention
        if batch.mm_embeds is not None or batch.positions.dim() == 2:  # images or M-RoPE: eager
            return self.model(batch.input_ids, batch.positions, self.kv_caches, meta, mm_embeds=batch.mm_embeds)
        num_tokens = batch.input_ids.shape[0]
        # EAGLE-3 reads inner layers: the pieces keep them (aux buffer), the decode graphs do not
        # (none are captured then).
        if self.graphs is not None and meta.num_decodes == num_tokens and self.graphs.bucket(num_tokens):
            return self.graphs.run(
                batch.input_ids, batch.positions, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.sliding
            )
        if self.pieces is not None and self.pieces.bucket(num_tokens):
            return self.pieces.run(batch.input_ids, batch.positions, meta)
        return self.model(batch.input_ids, batch.positions, self.kv_caches, meta)

    def _update_states(self, step: StepInput) -> None:
        for request_id in (*step.finished_ids, *step.preempted_ids):
            self._discard_request(request_id)
            self.failures.forget(request_id)
        for new in step.new_requests:
            self.failures.admit(new, self._add_request, self._discard_request)  # a failure fails it alone
        self.failures.drop_failed(step)
        for cached in step.cached_requests:
            if self.failures.is_dropped(cached.request_id):
                continue  # scheduled (async) before the core heard that it failed here
            state = self.requests[cached.request_id]
            # With drafts, this worker's count is the exact one: it rolled back the rejected drafts
            # itself, while an async step's count assumed every draft in flight was accepted.
            _apply_diff(state, cached, keep_computed=self.proposer is not None)

    def _add_request(self, new: NewRequestData) -> None:
        state = _state_from_new(new)
        if self.mm is not None:
            state.mrope = self.mm.mrope_of(state.token_ids, state.prompt_len, state.mm_inputs)
        state.row = self.sampling.add(
            new.request_id, new.sampling, state.token_ids, new.prompt_len, new.eos_token_ids, new.bad_words_token_ids
        )
        if new.lora is not None:
            if self.lora is None:
                raise ValueError("lora_request: this engine serves no LoRA adapters")
            self.lora.add_request(new.lora)  # last: a failure before it holds no adapter
            state.lora_id = new.lora.lora_int_id
        self.requests[new.request_id] = state
        if self.proposer is not None:
            self.proposer.track(new.request_id, new.num_computed_tokens)
        if state.prompt_logprobs is not None:
            self.awaiting_prompt_logprobs[new.request_id] = state

    def _discard_request(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None and state.lora_id:
            self.lora.release(state.lora_id)
        if self.proposer is not None:
            self.proposer.forget(request_id)
        self.sampling.remove(request_id)
        self.awaiting_prompt_logprobs.pop(request_id, None)
        self.drafts.pop(request_id, None)
        self._in_flight.pop(request_id, None)  # a token in flight for it is stale now

    def _prepare_inputs(self, step: StepInput) -> BatchInputs:
        # Decodes (one query token) first, shortest context first: attention batches them, and
        # neighbours of similar length waste little padding. A decode with drafts is one attention
        # row per token (row j sees the context up to its own token: causal by its length), so a
        # verifying step is a pure decode step too, and replays the decode CUDA graph.
        def decode_first(i: int) -> tuple[bool, int]:
            is_decode = step.num_scheduled_tokens[i] == 1 or step.scheduled_ids[i] in step.spec_token_ids
            return (not is_decode, self.requests[step.scheduled_ids[i]].num_computed_tokens if is_decode else 0)

        order = sorted(range(len(step.scheduled_ids)), key=decode_first)
        as_rows = self._prefill_as_rows(step)  # every token a decode row (mixed_graph_max_tokens)
        token_ids: list[int] = []
        starts: list[int] = []
        seq_lens: list[int] = []
        query_start_loc = [0]
        logits_indices: list[int] = []
        fill_at: list[int] = []  # input positions whose token is still on the device...
        fill_from: list[int] = []  # ...at this index of the previous step's sampled tokens
        sampling_states: list[RequestState] = []
        sampling_drafts: list[list[int]] = []
        prompt_spans: list[PromptSpan] = []
        states = []  # per attention row: a request with drafts has one per scored token
        scheduled_states = []  # per request
        chunks: list[Chunk] = []  # a vision-language model's: each request's rows
        feature_rows: dict[str, tuple[int, int]] = {}  # only for a proposer that reads the target's features
        keeps_features = self.proposer is not None and self.proposer.needs_features
        for i in order:
            state = self.requests[step.scheduled_ids[i]]
            drafts = step.spec_token_ids.get(state.request_id, []) if step.spec_token_ids else []
            start, count = state.num_computed_tokens, step.num_scheduled_tokens[i]
            end, known = start + count, len(state.token_ids)
            end_of_known = end - len(drafts)
            in_flight = self._in_flight.get(state.request_id)
            if keeps_features:
                feature_rows[state.request_id] = (start, query_start_loc[-1])
            if state.prompt_logprobs is not None and start < state.prompt_len - 1:
                # Position p predicts prompt token p + 1; the last prompt position predicts the output.
                span_count = min(end, state.prompt_len - 1) - start
                prompt_spans.append(PromptSpan(state, query_start_loc[-1], start, span_count))
            token_ids.extend(state.token_ids[start:end_of_known])
            if end_of_known > known:  # the one token the previous step sampled, not on the host yet
                if in_flight is None or in_flight[0] is not state or end_of_known != known + 1:
                    raise RuntimeError(
                        f"request {state.request_id}: step computes up to token {end_of_known}, only {known} known"
                    )
                fill_at.append(len(token_ids))
                fill_from.append(in_flight[1])
                token_ids.append(0)
            token_ids.extend(drafts)  # scored after the request's last token
            if self.mm is not None:
                chunks.append(Chunk(state.request_id, state.mm_inputs, state.mrope, start, end, query_start_loc[-1]))
            for row_start, row_count in [(p, 1) for p in range(start, end)] if drafts or as_rows else [(start, count)]:
                starts.append(row_start)
                seq_lens.append(row_start + row_count)
                query_start_loc.append(query_start_loc[-1] + row_count)
                states.append(state)
            state.num_computed_tokens = end
            scheduled_states.append(state)
            if end_of_known == known + (in_flight is not None and in_flight[0] is state):
                # Its last known token's logits, and each draft's.
                logits_indices.extend(range(query_start_loc[-1] - 1 - len(drafts), query_start_loc[-1]))
                sampling_states.append(state)
                sampling_drafts.append(drafts)
        counts = np.diff(query_start_loc)
        num_decodes = int(np.argmin(counts == 1)) if (counts != 1).any() else len(counts)  # the leading 1-token rows
        positions = np.arange(query_start_loc[-1]) + np.repeat(np.asarray(starts) - query_start_loc[:-1], counts)
        rope_positions = positions if self.mm is None else self.mm.rope_positions(chunks, positions)
        block_tables = self._block_tables([s.block_ids for s in states])
        rows = np.repeat(np.arange(len(states)), counts)
        slot_mapping = block_tables[rows, positions // self.block_size] * self.block_size + positions % self.block_size
        packs_prefill = self.packs_prefill and num_decodes < len(states)
        context_slots, cu_seqs = (
            pack_prefill(block_tables, seq_lens, query_start_loc, num_decodes, self.block_size)
            if packs_prefill
            else ([], [])
        )
        # A hybrid model's sliding layers: the same rows over their own tables.
        sliding_tables = self._block_tables([s.sliding_block_ids for s in states]) if self.hybrid else np.zeros((0, 0))
        sliding_slots = (
            sliding_tables[rows, positions // self.block_size] * self.block_size + positions % self.block_size
            if self.hybrid
            else []
        )
        sliding_context_slots = (
            pack_prefill(sliding_tables, seq_lens, query_start_loc, num_decodes, self.block_size)[0]
            if self.hybrid and packs_prefill
            else []
        )
        # One host-to-device copy for every integer input of the step.
        parts = [
            token_ids,
            rope_positions.ravel(),
            slot_mapping,
            seq_lens,
            logits_indices,
            fill_at,
            fill_from,
            block_tables.ravel(),
            context_slots,
            cu_seqs,
            sliding_slots,
            sliding_tables.ravel(),
            sliding_context_slots,
        ]
        bounds = np.cumsum([0] + [len(p) for p in parts])
        packed = self._to_device(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]))
        (
            input_ids,
            positions_t,
            slots,
            seq_lens_t,
            logits_t,
            fill_at_t,
            fill_from_t,
            tables,
            context_slots_t,
            cu_seqs_t,
            sliding_slots_t,
            sliding_tables_t,
            sliding_context_slots_t,
        ) = (packed[bounds[k] : bounds[k + 1]] for k in range(len(parts)))
        if fill_at:
            input_ids.index_copy_(0, fill_at_t, self._in_flight_tokens[fill_from_t])
        if rope_positions.ndim == 2:
            positions_t = positions_t.view(3, -1)
        attention = AttentionMetadata(
            slot_mapping=slots,
            block_tables=tables.view(block_tables.shape).to(self.index_dtype),
            seq_lens=seq_lens_t.to(self.index_dtype),
            seq_lens_list=seq_lens,
            query_start_loc=query_start_loc,
            num_decodes=num_decodes,
            block_size=self.block_size,
        )
        if packs_prefill:
            attention.prefill = packed_prefill_of(context_slots_t, cu_seqs_t, seq_lens, query_start_loc, num_decodes)
        if self.hybrid:
            attention.sliding = dataclasses.replace(
                attention,
                slot_mapping=sliding_slots_t,
                block_tables=sliding_tables_t.view(sliding_tables.shape).to(self.index_dtype),
                prefill=(
                    packed_prefill_of(sliding_context_slots_t, cu_seqs_t, seq_lens, query_start_loc, num_decodes)
                    if packs_prefill
                    else None
                ),
            )
        return BatchInputs(
            input_ids=input_ids,
            positions=positions_t,
            attention=attention,
            logits_indices=logits_t,
            sampling_states=sampling_states,
            prompt_spans=prompt_spans,
            scheduled_states=scheduled_states,
            layout=DraftLayout.of(sampling_drafts) if step.spec_token_ids else None,
            mm_embeds=self.mm.embeddings(chunks) if self.mm is not None else None,
            token_lora_ids=np.asarray([s.lora_id for s in states])[rows] if self.lora is not None else None,
            feature_rows=feature_rows,
        )

    @staticmethod
    def _block_tables(tables: list[list[int]]) -> np.ndarray:
        width = max(len(t) for t in tables)
        table = np.zeros((len(tables), width), dtype=np.int64)
        for row, ids in enumerate(tables):
            table[row, : len(ids)] = ids
        return table


def _state_from_new(new: NewRequestData) -> RequestState:
    # Prompt logprobs only for a request that starts from its first token and has no output yet
    # (one resumed after preemption sent them already).
    fresh = new.num_computed_tokens == 0 and len(new.token_ids) == new.prompt_len
    return RequestState(
        request_id=new.request_id,
        prompt_len=new.prompt_len,
        token_ids=list(new.token_ids),
        block_ids=list(new.block_ids),
        sliding_block_ids=list(new.sliding_block_ids),
        num_computed_tokens=new.num_computed_tokens,
        sampling=new.sampling,
        prompt_logprobs=[] if new.sampling.prompt_logprobs is not None and fresh else None,
        mm_inputs=list(new.mm_inputs),
    )


def _select_rows(logprobs: LogprobsTensors, rows: list[int]) -> LogprobsTensors:
    index = torch.tensor(rows, dtype=torch.long, device=logprobs.token_ids.device)
    return LogprobsTensors(logprobs.token_ids[index], logprobs.logprobs[index], logprobs.ranks[index])


def _to_message(logprobs: LogprobsTensors) -> TokenLogprobs:
    return TokenLogprobs(logprobs.token_ids.tolist(), logprobs.logprobs.tolist(), logprobs.ranks.tolist())


def _concat_to_message(parts: list[LogprobsTensors]) -> TokenLogprobs:
    if not parts:  # a one-token prompt has no prompt logprobs
        return TokenLogprobs([], [], [])
    return _to_message(
        LogprobsTensors(
            torch.cat([p.token_ids for p in parts]),
            torch.cat([p.logprobs for p in parts]),
            torch.cat([p.ranks for p in parts]),
        )
    )


def _apply_diff(state: RequestState, diff: CachedRequestData, keep_computed: bool = False) -> None:
    state.block_ids.extend(diff.new_block_ids)
    state.sliding_block_ids.extend(diff.new_sliding_block_ids)
    if not keep_computed:
        state.num_computed_tokens = diff.num_computed_tokens


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Build parameters directly in the serving dtype (no float32 copy of a large model)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _dtype_name(dtype: torch.dtype) -> str:
    return "fp8_e4m3" if dtype == KV_FP8 else str(dtype).removeprefix("torch.")
