"""One configuration object for the whole engine, shared by every process.

`EngineConfig.create(...)` resolves what can be resolved once (the model directory, the context
length) so that each process receives plain values and never re-derives them differently.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

from zllm.ipc.addresses import is_loopback_tcp
from zllm.model_spec import ModelSpec
from zllm.pooling import (
    PoolerConfig,
    classifier_settings,
    converted_classifier,
    declares_pooling,
    read_pooler_config,
)
from zllm.quantization import QUANTIZATION_METHODS, resolve_quantization

# The values of each field with a fixed set of them, defined once: validate() checks them, the
# CLI offers them (zllm/launch/args.py) and docs/configuration.md lists them (a test compares).
DEVICES = ("auto", "cuda", "cpu")
DTYPES = ("auto", "float32", "float16", "bfloat16")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
SCHEDULING_POLICIES = ("fcfs", "priority")
ON_FAILURE_POLICIES = ("restart", "fail")
# What the engine runs (vLLM's --runner): "generate" samples tokens, "pooling" returns one vector per
# input (embeddings, classifier scores); "auto" picks by the checkpoint's architecture. --convert
# names the pooling task of a checkpoint (only encoder architectures are served as pooling models yet).
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
# Who starts and supervises the tp workers (vLLM's --distributed-executor-backend): "mp", child
# processes of the engine core on its node; "ray", actors of a Ray cluster (docs/deployment.md).
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")
# The tool-call parsers' names (--tool-call-parser; None: none). zllm/frontend/openai/tool_parsers.py
# maps each to its parser class (tests/test_tool_parsers.py keeps the two equal).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
# The reasoning parsers' names (--reasoning-parser; None: none), mapped to their classes by
# zllm/frontend/openai/reasoning_parsers.py (tests/test_reasoning.py keeps the two equal).
REASONING_PARSERS = ("deepseek_r1", "qwen3")
# Speculative decoding proposers (vLLM's `method` names).
SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
SERVED_SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
# Those with a model of their own (`model`: a directory), run in the target's workers with a KV
# cache that shares its block tables: each step allocates k slots ahead for their drafts' entries.
MODEL_SPECULATIVE_METHODS = ("draft_model", "eagle", "eagle3")
# Field -> its values. quantization (None or one of QUANTIZATION_METHODS) is checked by
# zllm.quantization.resolve_quantization, which also weighs the checkpoint's own scheme.
CHOICES: dict[str, tuple[str, ...]] = {
    "device": DEVICES,
    "dtype": DTYPES,
    "load_format": LOAD_FORMATS,
    "quantization": QUANTIZATION_METHODS,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "scheduling_policy": SCHEDULING_POLICIES,
    "on_failure": ON_FAILURE_POLICIES,
    "runner": RUNNERS,
    "convert": CONVERTS,
    "distributed_executor_backend": DISTRIBUTED_EXECUTOR_BACKENDS,
}
USAGES = ("serving", "offline")
# Vision-language models: the encoder cache's least tokens (EngineConfig.encoder_cache_tokens);
# vLLM's default is the step's token budget or the largest image, whichever is larger.
MIN_ENCODER_CACHE_TOKENS = 16384
# An offline batch (LLM) on a GPU gains from larger decode batches and prefill chunks than a
# server: nobody waits on a single token, and a decode step of an 8B model at batch 256 is bound
# by its weight reads, so more rows per step cost less than their share of time. Measured W1 on
# the H100 (docs/benchmarks.md, issue 20): 512 / 8192 49.8 req/s, 256 / 8192 47.2, 1024 / 16384
# 43.2 (attention over twice the contexts, and preemption once the cache is full). A server keeps
# the serving defaults above: a big prefill chunk in a step delays every stream's next token.
OFFLINE_GPU_SCHEDULER_DEFAULTS = {"max_num_seqs": 512, "max_num_batched_tokens": 8192}
# custom_all_reduce_max_bytes's default on one node: every decode all-reduce (a few rows of hidden
# state) and a prefill chunk's of up to 64 rows of Llama-3-70B's 8192 in bf16.
DEFAULT_CUSTOM_ALL_REDUCE_BYTES = 1 << 20
# The most tokens mixed_graph_max_tokens gives a step by default: every one is a decode graph row,
# and the decode graphs are captured up to this many rows.
MIXED_GRAPH_TOKENS_CAP = 512
# A server's token budget per step on a GPU follows the model's compute per GPU. A step that
# carries a prefill chunk of B tokens delays every stream's next token by about 2 x B x (linear
# weights per GPU) FLOPs of work, so the budget that keeps Llama-3-8B's tails at tp 1 (2048:
# p99 ITL ~20 ms at Poisson 32 on an H100, issue 40) shrinks in proportion for a bigger share of
# weights per GPU, to a power of two. Measured on 4 x H200 (docs/benchmarks.md, issue 30):
# Llama-3-70B at tp 4 (17.1e9 weights per GPU -> 512) under Poisson 12 req/s had p99 ITL 92 ms
# at 2048, 57 at 512, 61 at 384, and fell behind the arrivals at 256.
SERVING_BUDGET_REFERENCE = (2048, 6.98e9)  # (budget, linear weights per token): Llama-3-8B, tp 1
SERVING_BUDGET_RANGE = (512, 2048)


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's --speculative-config keys): a proposer drafts up to
    `num_speculative_tokens` tokens per request, the target scores them all in one forward and an
    exact rejection sampler keeps the longest run it agrees with, plus one token of its own."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    # draft_model: a checkpoint with the target's vocabulary; eagle / eagle3: the head's directory
    model: str | None = None
    prompt_lookup_min: int = 1  # ngram: the shortest suffix matched against the request's tokens
    prompt_lookup_max: int = 4  # ngram: the longest (tried first)
    draft_tensor_parallel_size: int | None = None  # draft_model: None or the target's tp
    # Steps whose running batch holds at least this many requests run without drafts (a busy
    # batch is compute-bound: verifying drafts would cost more than it saves). None: never off.
    disable_by_batch_size: int | None = None

    @classmethod
    def of(cls, value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        """From vLLM's JSON object (a dict), refusing keys it does not know."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config: must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        if "method" not in value:
            value = {**value, "method": "draft_model" if value.get("model") else "ngram"}
        return cls(**value)

    def validate(self, tensor_parallel_size: int) -> None:
        _require(
            self.method in SPECULATIVE_METHODS,
            "speculative_config.method",
            f"must be one of {SPECULATIVE_METHODS}, got {self.method!r}",
        )
        _require(
            self.method in SERVED_SPECULATIVE_METHODS,
            "speculative_config.method",
            f"{self.method!r} is not served yet; use one of {SERVED_SPECULATIVE_METHODS}",
        )
        k = self.num_speculative_tokens
        _require(
            isinstance(k, int) and 1 <= k <= 16,
            "speculative_config.num_speculative_tokens",
            f"must be 1..16, got {k!r}",
        )
        if self.method == "ngram":
            _require(
                1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
                "speculative_config.prompt_lookup_min",
                f"needs 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= prompt_lookup_max "
                f"({self.prompt_lookup_max})",
            )
        if self.method in MODEL_SPECULATIVE_METHODS:
            _require(bool(self.model), "speculative_config.model", f"is required with method {self.method!r}")
            _require(
                self.draft_tensor_parallel_size in (None, tensor_parallel_size),
                "speculative_config.draft_tensor_parallel_size",
                f"must equal tensor_parallel_size ({tensor_parallel_size}): the draft runs sharded like the target, "
                f"got {self.draft_tensor_parallel_size}",
            )
        _require(
            self.disable_by_batch_size is None or self.disable_by_batch_size >= 1,
            "speculative_config.disable_by_batch_size",
            f"must be >= 1, got {self.disable_by_batch_size}",
        )


@dataclass(slots=True)
class EngineConfig:
    """Every knob of the engine. Sizes are in tokens unless the name says bytes."""

    model: str  # a HF model directory (config.json + safetensors + tokenizer); a .gguf is converted to one
    tokenizer: str | None = None  # defaults to the model directory
    # No tokenizer at all (vLLM's skip_tokenizer_init): prompts are token ids, outputs token ids
    # only (empty text); what needs text (stop strings, bad words, grammars, chat) is refused.
    skip_tokenizer_init: bool = False
    dtype: str = "auto"  # auto: float32 on CPU; on CUDA the checkpoint's fp16/bf16, else bfloat16
    device: str = "auto"
    seed: int = 0
    load_format: str = "auto"
    # "fp8": quantize an unquantized checkpoint's linear layers to FP8 while loading (as vLLM's
    # --quantization fp8). FP8 checkpoints are recognised from their config without it.
    quantization: str | None = None
    # "fp8" (or "fp8_e4m3"): keys and values stored as FP8 E4M3, scaled by the checkpoint's
    # k_scale/v_scale when its config declares a kv_cache_scheme (else 1.0): twice the tokens of a
    # 16-bit cache in the same memory. "auto": the model dtype.
    kv_cache_dtype: str = "auto"
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    block_size: int = 16
    num_kv_blocks: int | None = None  # override the size derived from memory
    kv_cache_memory_bytes: int = 1 << 30  # CPU: memory for the KV cache
    gpu_memory_utilization: float = 0.9
    # Scheduler limits: requests in a step, and tokens in a step (prefill chunks included). These
    # are the serving defaults; EngineConfig.create(usage="offline") on a GPU raises the ones the
    # caller left unset (OFFLINE_GPU_SCHEDULER_DEFAULTS).
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    tensor_parallel_size: int = 1  # worker processes, one model shard (and GPU) each
    # Data parallelism: this many engine cores behind one frontend, each with its own tp group of
    # workers (GPUs dp_rank * tp ... dp_rank * tp + tp - 1). The frontend sets data_parallel_rank
    # in the config it hands each engine core.
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    distributed_init_method: str = ""  # torch.distributed rendezvous; empty: a file in runtime_dir
    # "ray": each tp rank is an actor of a Ray cluster (zllm/enginecore/ray_executor.py), which
    # places it (one placement-group bundle per rank) and watches it; the steps still go over
    # ZeroMQ. ray_address: the cluster to join ("auto", "ray://...", host:port); empty: Ray's own
    # choice (RAY_ADDRESS, a cluster started on this machine, else a new local one).
    distributed_executor_backend: str = "mp"
    ray_address: str = ""
    # GPU tp: all-reduces of at most this many bytes (in the model's bf16/fp32 dtype) go through
    # PyTorch's symmetric-memory one-shot kernel instead of NCCL (zllm/workers/symmetric_all_reduce.py);
    # 0: NCCL only. None: DEFAULT_CUSTOM_ALL_REDUCE_BYTES where one node's GPUs hold the whole tp
    # group (its engine tests passed at tp 2 and 4 on H200s, and it took 70B at tp 4 from 11.74 to
    # 11.26 ms a token), else 0.
    custom_all_reduce_max_bytes: int | None = None
    enforce_eager: bool = False  # CUDA: no CUDA graphs (decode, piecewise, pooling)
    # Steps that carry prefill run the forward as pieces split at attention, each piece a CUDA graph
    # at a padded token count (zllm/workers/piecewise_graphs.py); on CPU the same pieces run
    # eagerly. None: on where CUDA graphs run (CUDA, not enforce_eager), for dense and MoE models
    # (they halved the serving tails on the H100 and H200, issue 40). The runner leaves them off
    # where a layer syncs with the host (MoE experts in the torch loop, MLA's cache write).
    piecewise_cuda_graphs: bool | None = None
    # Steps with prefill of at most this many tokens, over short contexts, run every prompt token
    # as a decode row (it attends to the cache up to its own position) and replay the decode CUDA
    # graph: no per-layer host work. A piecewise step launches each layer's attention from Python
    # (~0.2-0.3 ms of host per layer), which outlasts a layer's GPU work in a step of a few hundred
    # tokens: on an H200 a 70B tp-4 shard's mixed step took 25.3 ms as pieces and 17.9 ms as rows;
    # Llama-3-8B, a 256-token prompt every other step at batch 128: 13.2 against 11.2 ms a step
    # (docs/benchmarks.md). 0: off. None: where CUDA graphs run, the budget up to MIXED_GRAPH_TOKENS_CAP.
    mixed_graph_max_tokens: int | None = None
    # Schedule step N+1 while step N runs on the device, so host work hides behind GPU work.
    # None: on when the workers run on CUDA (on CPU the compute is synchronous: nothing to hide).
    async_scheduling: bool | None = None
    # Speculative decoding (None: off).
    speculative_config: SpeculativeConfig | None = None
    served_model_name: str | None = None
    enable_prefix_caching: bool = True  # reuse the KV blocks of identical prompt prefixes
    # vLLM's name: keep every block of sliding-window layers as of full ones (one block table, no
    # freeing behind the window; zllm/kv_layout.py). For comparisons; off by default.
    disable_hybrid_kv_cache_manager: bool = False
    scheduling_policy: str = "fcfs"  # fcfs: arrival order; priority: lower `priority` value first
    max_logprobs: int = 20  # the most SamplingParams.logprobs / prompt_logprobs may ask for
    max_n: int = 128  # the most completions (SamplingParams.n) one request may ask for
    # Processes and sockets.
    runtime_dir: str = ""  # private 0700 directory for ipc sockets; made at launch when empty
    client_endpoint: str = ""  # ZMQ endpoint for clients; empty: zllm.ipc.addresses.default_client_endpoint()
    socket_hwm: int = 10_000  # messages queued per socket before senders block
    heartbeat_interval_s: float = 1.0  # liveness checks between processes
    startup_timeout_s: float = 900.0  # model load + KV set-up, per process
    client_timeout_s: float = 30.0  # a client silent this long (no ping) loses its requests
    # The OpenAI-compatible HTTP API, served by the frontend beside the ZMQ client endpoint.
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the ready line says which)
    api_key: str | None = None  # required on /v1 routes (Bearer) and on every ZMQ client request when set
    max_request_body_bytes: int = 8 << 20  # larger HTTP bodies get 413
    # Several frontends (API servers) instead of one, so that detokenizing and streaming are not
    # bound to one process's CPU (zllm/launch/api_servers.py): frontend k (api_server_rank)
    # drives the data-parallel engines k * dp / count .. (k + 1) * dp / count - 1, and all of them
    # listen on host:port (SO_REUSEPORT). vllm-launch sets api_server_rank in each one's config.
    api_server_count: int = 1
    api_server_rank: int = 0
    # Reliability and security (docs/deployment.md).
    on_failure: str = "restart"  # engine core or worker died: "restart" (replay requests) or "fail"
    max_restarts: int = 5  # engine restarts allowed within restart_window_s before giving up
    restart_window_s: float = 600.0
    engine_hang_timeout_s: float = 60.0  # an engine core silent this long (no step, no pong) is restarted
    shutdown_timeout_s: float = 30.0  # SIGTERM: how long in-flight requests may take to finish
    max_waiting: int = 1024  # requests queued in the engine core beyond which new ones are refused
    curve_dir: str = ""  # CURVE keys of a tcp:// client endpoint: server.key(_secret), clients/*.key
    allow_insecure_tcp: bool = False  # serve a tcp:// client endpoint without CURVE (trusted networks only)
    client_max_message_bytes: int = 64 << 20  # a bigger client frame drops that client's connection
    # The largest frame between zllm's own processes. A socket that accepts connections (the
    # frontend's from the core, the core's from the workers) drops a peer that sends a bigger one
    # before buffering it; a connecting socket (core and worker inputs) drops the frame itself.
    # NOTE: a fixed, generous bound rather than one derived per message kind: the peers are our own
    # processes, and a legitimate message cut off would lose a step. The largest ones stay far below
    # it: a step's prompt logprobs are ~15 bytes x (max_logprobs + 1) per prompt token (41 MB for a
    # full 131072-token prompt at 20); a request carries at most one client frame's content, which
    # tokenizing can grow (bad words: ~5 bytes per token), hence at least 8x the client bound.
    internal_max_message_bytes: int = 1 << 30
    # OpenAI tool calling, as vLLM's flags: tool_choice "auto" reads calls with this parser
    # (a name of zllm.frontend.openai.tool_parsers.PARSERS, which the HTTP API checks when it is
    # built); "required" and named choices need neither.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # Reasoning models: the parser that splits the thinking from the answer (vLLM's names).
    reasoning_parser: str | None = None
    # /v1/responses: keep finished responses (a bounded number, in memory) so that a later request
    # can continue one by previous_response_id. Off by default, as in vLLM: it holds user data.
    enable_responses_store: bool = False
    # Structured outputs (xgrammar in the engine core): compiled grammars kept for reuse, and the
    # threads that compile one and fill a step's bitmask rows.
    grammar_cache_size: int = 1024
    grammar_threads: int = 4
    # Vision-language models (docs/api.md, "Images"): the most items of each modality one prompt
    # may carry ({"image": 2}; a modality left out: no limit), keyword arguments for the model's
    # image processor (Qwen's min_pixels / max_pixels), the folder under which the HTTP API may
    # read local images (None: none), and the bounds on fetching an image by URL.
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)
    allowed_local_media_path: str | None = None
    media_fetch_timeout_s: float = 10.0
    max_media_bytes: int = 20 << 20
    # Tensor parallelism across nodes: the tp ranks split evenly over `nnodes` machines; node 0
    # (the head) runs the frontend, the engine core and ranks 0 .. tp/nnodes - 1, every other node
    # runs `vllm-launch --headless` (its workers only). torch.distributed meets at
    # tcp://master_addr:master_port; the head's node channel listens on master_port + 1, the
    # engine core's worker sockets on master_port + 2 (outputs) and master_port + 3 + rank (inputs
    # of remote ranks), all with CURVE (curve_dir) unless allow_insecure_tcp.
    # Data parallelism across nodes instead: with data_parallel_size_local set (< dp), node k runs
    # the whole engines k * local .. (k + 1) * local - 1 (each with its tp ranks on its own GPUs),
    # and engine d talks to the head's frontend on master_port + 2 + 2d (in) and + 3 + 2d (out).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = ""
    master_port: int = 29500
    headless: bool = False
    node_join_timeout_s: float = 300.0  # the head gives up when a node has not joined by then
    data_parallel_size_local: int = 0  # engines per node when engines split over nodes; 0: all on the head
    # Pooling models (zllm/pooling.py): "auto" resolves to "generate" or "pooling" from the
    # architecture; the pooler is what the checkpoint declares (resolved by create()).
    runner: str = "auto"
    convert: str = "auto"
    # vLLM's --hf-overrides, for what turns a generative decoder into a classifier only
    # (zllm/pooling.py CLASSIFIER_KEYS): e.g. Qwen3-Reranker's {"architectures":
    # ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
    # "is_original_qwen3_reranker": true}.
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    pooler: PoolerConfig | None = None
    # Multi-LoRA serving (vLLM's flags; zllm/lora.py, zllm/workers/lora.py): PEFT adapters on the
    # base model, a step mixing requests of several adapters and of the base model.
    enable_lora: bool = False
    lora_modules: dict[str, str] = field(default_factory=dict)  # adapter name -> PEFT directory, served from the start
    max_loras: int = 1  # distinct adapters in one step: the device slots each worker keeps
    max_lora_rank: int = 16  # the largest rank an adapter may have (slots are sized for it)
    max_cpu_loras: int | None = None  # adapters each worker keeps in host memory (LRU); None: max_loras

    @classmethod
    def create(cls, model: str | None = None, usage: str = "serving", **kwargs) -> EngineConfig:
        """Resolve the model (None: the embedded default; a .gguf file: converted once), check that
        its architecture is supported, and validate every field. usage: "serving" (vllm-launch)
        or "offline" (LLM), which picks the scheduler limits the caller leaves unset."""
        from zllm.model_files import gguf_model_name, resolve_model_dir

        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        if usage not in USAGES:
            raise ValueError(f"usage: must be one of {USAGES}, got {usage!r}")
        unset_limits = [name for name in OFFLINE_GPU_SCHEDULER_DEFAULTS if kwargs.get(name) is None]
        for name in unset_limits:
            kwargs.pop(name, None)  # None, as absent: the default for this use
        served_name = kwargs.pop("served_model_name", None) or gguf_model_name(model)
        kwargs["speculative_config"] = SpeculativeConfig.of(kwargs.get("speculative_config"))
        config = cls(model=str(resolve_model_dir(model)), served_model_name=served_name, **kwargs)
        if usage == "offline" and unset_limits and runs_on_cuda(config):
            for name in unset_limits:
                setattr(config, name, OFFLINE_GPU_SCHEDULER_DEFAULTS[name])
        spec = ModelSpec.from_pretrained(config.model)
        _resolve_runner(config, spec)
        if (
            usage == "serving"
            and "max_num_batched_tokens" in unset_limits
            and config.runner == "generate"
            and runs_on_cuda(config)
        ):
            config.max_num_batched_tokens = serving_token_budget(spec, config.tensor_parallel_size)
        config.max_model_len = _resolve_max_model_len(spec, config.max_model_len, config.pooler)
        if config.runner == "pooling":  # a pooling input runs in one step: the budget holds the longest
            config.max_num_batched_tokens = max(config.max_num_batched_tokens, config.max_model_len)
        config.validate()
        resolve_quantization(
            spec.quantization, config.quantization, config.load_format == "dummy", spec.moe is not None
        )
        _check_tensor_parallel(config, spec)
        _require(
            spec.mla is None or not config.kv_cache_dtype.startswith("fp8"),
            "kv_cache_dtype",
            f"{config.kv_cache_dtype}: {spec.architecture}'s latent (MLA) cache is kept in the model dtype",
        )
        if config.speculative_config is not None:
            # Async scheduling works with drafts too: the workers propose them for the steps the
            # core schedules ahead (zllm/enginecore/scheduler.py).
            _resolve_draft_model(config, spec)
        if config.async_scheduling is None:
            config.async_scheduling = runs_on_cuda(config)
        if config.piecewise_cuda_graphs is None:
            # Dense and MoE alike: the runner keeps them off where a model's layers cannot be
            # captured (ModelRunner._set_up_pieces logs why).
            config.piecewise_cuda_graphs = runs_on_cuda(config) and not config.enforce_eager
        if config.custom_all_reduce_max_bytes is None:
            # Ray may place the ranks on several nodes, where no rank can map a peer's memory.
            one_node_tp = (
                config.tensor_parallel_size > 1
                and not config.tp_spans_nodes
                and config.distributed_executor_backend == "mp"
            )
            config.custom_all_reduce_max_bytes = (
                DEFAULT_CUSTOM_ALL_REDUCE_BYTES if one_node_tp and runs_on_cuda(config) else 0
            )
        if config.mixed_graph_max_tokens is None:
            graphs = runs_on_cuda(config) and not config.enforce_eager and config.runner == "generate"
            config.mixed_graph_max_tokens = min(config.max_num_batched_tokens, MIXED_GRAPH_TOKENS_CAP) if graphs else 0
        # No step holds more tokens than the budget: more rows would only capture graphs (and size
        # buffers, LoRA's token slots among them) that never run.
        config.mixed_graph_max_tokens = min(config.mixed_graph_max_tokens, config.max_num_batched_tokens)
        if config.enable_lora:
            _check_lora(config, spec)
        return config

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model

    @property
    def model_name(self) -> str:
        return self.served_model_name or os.path.basename(os.path.normpath(self.model))

    def validate(self) -> None:
        _require_choice(self, "device")
        _require_choice(self, "dtype")
        _require_choice(self, "load_format")
        _require_choice(self, "kv_cache_dtype")
        _require(
            self.block_size in (8, 16, 32, 64, 128),
            "block_size",
            f"must be 8, 16, 32, 64 or 128, got {self.block_size}",
        )
        _require(self.max_model_len >= 2, "max_model_len", f"must be >= 2, got {self.max_model_len}")
        _require_choice(self, "runner")
        _require_choice(self, "convert")
        _require(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _require(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            f"must be >= 1, got {self.max_num_batched_tokens}",
        )
        if self.num_kv_blocks is not None:
            _require(self.num_kv_blocks >= 1, "num_kv_blocks", f"must be >= 1, got {self.num_kv_blocks}")
        _require(self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes", "must be > 0")
        _require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            f"must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        _require_choice(self, "scheduling_policy")
        _require(self.max_logprobs >= 0, "max_logprobs", f"must be >= 0, got {self.max_logprobs}")
        _require(self.max_n >= 1, "max_n", f"must be >= 1, got {self.max_n}")
        _require(self.socket_hwm >= 1, "socket_hwm", f"must be >= 1, got {self.socket_hwm}")
        _require(self.heartbeat_interval_s > 0, "heartbeat_interval_s", "must be > 0")
        _require(0 <= self.port <= 65535, "port", f"must be in [0, 65535], got {self.port}")
        _require(self.api_key is None or self.api_key != "", "api_key", "must not be empty")
        _require(self.max_request_body_bytes >= 1024, "max_request_body_bytes", "must be >= 1024")
        self._validate_reliability()
        _require(
            self.tool_call_parser is None or self.tool_call_parser in TOOL_CALL_PARSERS,
            "tool_call_parser",
            f"must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}",
        )
        _require(
            self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSERS,
            "reasoning_parser",
            f"must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}",
        )
        _require(
            not self.enable_auto_tool_choice or self.tool_call_parser is not None,
            "enable_auto_tool_choice",
            "needs tool_call_parser (--tool-call-parser)",
        )
        _require(self.grammar_cache_size >= 1, "grammar_cache_size", f"must be >= 1, got {self.grammar_cache_size}")
        _require(self.grammar_threads >= 1, "grammar_threads", f"must be >= 1, got {self.grammar_threads}")
        _require(
            set(self.limit_mm_per_prompt) <= {"image"}
            and all(isinstance(n, int) and n >= 0 for n in self.limit_mm_per_prompt.values()),
            "limit_mm_per_prompt",
            f'must map "image" to a count >= 0, got {self.limit_mm_per_prompt!r}',
        )
        _require(self.media_fetch_timeout_s > 0, "media_fetch_timeout_s", "must be > 0")
        _require(self.max_media_bytes > 0, "max_media_bytes", "must be > 0")
        _require(
            self.tensor_parallel_size >= 1, "tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size}"
        )
        _require(self.data_parallel_size >= 1, "data_parallel_size", f"must be >= 1, got {self.data_parallel_size}")
        _require(
            0 <= self.data_parallel_rank < self.data_parallel_size,
            "data_parallel_rank",
            f"must be in [0, {self.data_parallel_size}), got {self.data_parallel_rank}",
        )
        self._validate_nodes()
        self._validate_api_servers()
        # Every engine would meet its workers at the same address: only per-engine files can work.
        _require(
            self.data_parallel_size == 1 or not self.distributed_init_method,
            "distributed_init_method",
            "cannot be shared by several data-parallel engines; leave it empty (a file in each engine's runtime dir)",
        )
        _require(self.enable_lora or not self.lora_modules, "lora_modules", "needs enable_lora (--enable-lora)")
        _require(
            self.custom_all_reduce_max_bytes is None or self.custom_all_reduce_max_bytes >= 0,
            "custom_all_reduce_max_bytes",
            f"must be >= 0 (0: NCCL only), got {self.custom_all_reduce_max_bytes}",
        )
        _require(
            self.mixed_graph_max_tokens is None or self.mixed_graph_max_tokens >= 0,
            "mixed_graph_max_tokens",
            f"must be >= 0 (0: off), got {self.mixed_graph_max_tokens}",
        )

    def _validate_api_servers(self) -> None:
        count = self.api_server_count
        _require(count >= 1, "api_server_count", f"must be >= 1, got {count}")
        _require(
            self.data_parallel_size % count == 0,
            "api_server_count",
            f"{count} API servers cannot split --data-parallel-size {self.data_parallel_size} evenly: "
            "each serves dp / count engines of its own (give -dp a multiple of it)",
        )
        _require(
            0 <= self.api_server_rank < count, "api_server_rank", f"must be in [0, {count}), got {self.api_server_rank}"
        )
        _require(
            count == 1 or self.nnodes == 1,
            "api_server_count",
            "several API servers run on one node only: leave --nnodes at 1",
        )

    @property
    def frontend_dp_ranks(self) -> range:
        """The data-parallel engines this frontend (API server api_server_rank) drives."""
        per_server = self.data_parallel_size // self.api_server_count
        return range(self.api_server_rank * per_server, (self.api_server_rank + 1) * per_server)

    def _validate_nodes(self) -> None:
        _require(self.nnodes >= 1, "nnodes", f"must be >= 1, got {self.nnodes}")
        _require(0 <= self.node_rank < self.nnodes, "node_rank", f"must be in [0, {self.nnodes}), got {self.node_rank}")
        _require(
            not self.headless or self.node_rank > 0,
            "headless",
            "node 0 is the head: a headless node has --node-rank >= 1",
        )
        _require(
            self.headless or self.node_rank == 0,
            "node_rank",
            f"{self.node_rank} is not the head (0): the other nodes run `vllm-launch --headless`",
        )
        _require(self.node_join_timeout_s > 0, "node_join_timeout_s", "must be > 0")
        self._validate_executor_backend()
        _require(self.data_parallel_size_local >= 0, "data_parallel_size_local", "must be >= 0")
        if self.nnodes == 1:
            _require(
                self.data_parallel_size_local in (0, self.data_parallel_size),
                "data_parallel_size_local",
                "splits the engines over nodes: it needs --nnodes > 1",
            )
            return
        _require(bool(self.master_addr), "master_addr", "is required with nnodes > 1: the head node's address")
        _require(
            not self.distributed_init_method,
            "distributed_init_method",
            "is set by zllm with nnodes > 1; leave it empty",
        )
        _require(
            bool(self.curve_dir) or self.allow_insecure_tcp,
            "nnodes",
            _insecure_tcp(
                f"tcp://{self.master_addr}:{self.master_port + 1}", "the node channel and the engines' sockets"
            ),
        )
        if self.dp_spans_nodes:
            _require(
                self.data_parallel_size_local * self.nnodes == self.data_parallel_size,
                "data_parallel_size_local",
                f"{self.data_parallel_size_local} engines on each of {self.nnodes} nodes is not "
                f"--data-parallel-size {self.data_parallel_size}",
            )
            last_port = self.master_port + 3 + 2 * (self.data_parallel_size - 1)
        else:
            _require(
                self.data_parallel_size == 1,
                "data_parallel_size",
                "engines spread over nodes with --data-parallel-size-local; without it the nodes split one "
                "engine's tp ranks (dp 1)",
            )
            _require(
                self.tensor_parallel_size % self.nnodes == 0,
                "tensor_parallel_size",
                f"{self.tensor_parallel_size} ranks do not split evenly over {self.nnodes} nodes",
            )
            last_port = self.master_port + 2 + self.tensor_parallel_size
        _require(
            1 <= self.master_port and last_port <= 65535,
            "master_port",
            f"{self.master_port}: zllm uses the ports up to {last_port}, beyond 65535",
        )

    def _validate_reliability(self) -> None:
        _require_choice(self, "on_failure")
        _require(self.max_restarts >= 0, "max_restarts", f"must be >= 0, got {self.max_restarts}")
        _require(self.restart_window_s > 0, "restart_window_s", "must be > 0")
        _require(self.engine_hang_timeout_s > 0, "engine_hang_timeout_s", "must be > 0")
        _require(self.shutdown_timeout_s >= 0, "shutdown_timeout_s", "must be >= 0")
        _require(self.max_waiting >= 1, "max_waiting", f"must be >= 1, got {self.max_waiting}")
        _require(self.client_max_message_bytes >= 1 << 16, "client_max_message_bytes", "must be >= 64 KiB")
        _require(
            self.internal_max_message_bytes >= 8 * self.client_max_message_bytes,
            "internal_max_message_bytes",
            f"must be >= 8 x client_max_message_bytes ({8 * self.client_max_message_bytes}), got "
            f"{self.internal_max_message_bytes}",
        )
        if self.client_endpoint.startswith("tcp://"):
            _require(
                bool(self.curve_dir) or self.allow_insecure_tcp, "client_endpoint", _insecure_tcp(self.client_endpoint)
            )

    @property
    def dp_spans_nodes(self) -> bool:
        """Whole engines run on several nodes (data_parallel_size_local < data_parallel_size)."""
        return self.nnodes > 1 and 0 < self.data_parallel_size_local < self.data_parallel_size

    @property
    def tp_spans_nodes(self) -> bool:
        """One engine's tp ranks run on several nodes."""
        return self.nnodes > 1 and not self.dp_spans_nodes

    @property
    def local_engines(self) -> int:
        """Engines per node."""
        return self.data_parallel_size_local if self.dp_spans_nodes else self.data_parallel_size

    def node_of_engine(self, dp_rank: int) -> int:
        return dp_rank // self.local_engines if self.dp_spans_nodes else 0

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes if self.tp_spans_nodes else self.tensor_parallel_size

    def local_ranks(self, node_rank: int | None = None) -> range:
        """The tp ranks of this engine whose workers run on that node (default: this one)."""
        if not self.tp_spans_nodes:
            return range(self.tensor_parallel_size)
        node = self.node_rank if node_rank is None else node_rank
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def _validate_executor_backend(self) -> None:
        _require_choice(self, "distributed_executor_backend")
        if self.distributed_executor_backend != "ray":
            _require(not self.ray_address, "ray_address", "is for --distributed-executor-backend ray")
            return
        _require(
            importlib.util.find_spec("ray") is not None,
            "distributed_executor_backend",
            "ray needs the ray package: pip install zllm[ray]",
        )
        _require(
            self.nnodes == 1,
            "distributed_executor_backend",
            "ray places the ranks itself: leave --nnodes (zllm's own node agents) at 1",
        )

    @property
    def first_gpu(self) -> int:
        """The GPU index that tp rank 0 would have on this node: each data-parallel engine has its
        own tp GPUs (counted from the node's first engine); on node k of a multi-node tp group,
        rank k * ranks_per_node takes GPU 0."""
        if self.tp_spans_nodes:
            return -self.node_rank * self.ranks_per_node
        return (self.data_parallel_rank - self.node_rank * self.local_engines) * self.tensor_parallel_size

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def encoder_cache_tokens(self) -> int:
        """Tokens of encoder output the workers keep at most (zllm/enginecore/encoder_cache.py), and
        the most image tokens a step may encode: the engine core's account, and what the workers'
        memory profile holds (zllm/workers/multimodal.py)."""
        return max(MIN_ENCODER_CACHE_TOKENS, self.max_num_batched_tokens)


def _insecure_tcp(endpoint: str, what: str = "") -> str:
    """Why a tcp:// endpoint without CURVE is refused, and how to serve it anyway."""
    fix = "give --zmq-curve-dir DIR (CURVE keys, see docs/deployment.md) or"
    name = f"{endpoint} ({what})" if what else endpoint
    if is_loopback_tcp(endpoint):
        return (
            f"{name} without CURVE lets any local user connect (no file permissions guard a tcp port, "
            f"as they guard an ipc:// socket): {fix}, if every user of this machine is trusted, --allow-insecure-tcp"
        )
    return f"{name} is reachable from the network: {fix}, on a trusted network only, --allow-insecure-tcp"


def _resolve_max_model_len(spec: ModelSpec, requested: int, pooler: PoolerConfig | None = None) -> int:
    """The context length: the model's max_position_embeddings unless a shorter one is asked for;
    a sentence-transformers model's own max_seq_length where it declares one.

    Sliding-window layers attend within their window at any length (zllm/workers/attention.py);
    their KV blocks behind the window are freed (zllm/kv_layout.py).
    """
    limit = spec.max_position_embeddings
    if requested > limit:
        raise ValueError(f"max_model_len: {requested} exceeds the model's max_position_embeddings ({limit})")
    if not requested and pooler is not None and pooler.max_seq_length:
        return min(limit, pooler.max_seq_length)
    return requested or limit


def _resolve_runner(config: EngineConfig, spec: ModelSpec) -> None:
    """runner "auto" -> "generate" or "pooling" by the architecture; a pooling engine runs
    without prefix caching (nothing is cached) and without the decoder's piecewise graphs."""
    _require_choice(config, "runner")
    _require_choice(config, "convert")
    settings = classifier_settings(config.model, config.hf_overrides)
    _convert_by_architectures(config, spec, settings.get("architectures"))
    pooling = spec.pooling
    if config.runner == "auto":
        converting = config.convert in ("embed", "classify") or declares_pooling(config.model) or spec.bidirectional
        config.runner = "pooling" if pooling is not None or converting else "generate"
    if config.runner == "generate":
        _require(
            pooling is None,
            "runner",
            f"{spec.architecture} is a pooling model (embeddings, scores): it cannot generate; "
            "leave --runner unset or use --runner pooling",
        )
        _require(config.convert in ("auto", "none"), "convert", "applies to --runner pooling only")
        _require(
            not spec.bidirectional,
            "runner",
            f"{spec.architecture} declares is_causal: false (bidirectional attention, an embedding model): "
            "it cannot generate; serve it with --runner pooling",
        )
        return
    pooling = pooling or _converted_decoder(config, spec)
    _require(
        (spec.sliding_window is None or spec.encoder) and spec.attn_logit_softcap is None,
        "runner",
        f"pooling with {spec.architecture}'s sliding windows or soft-capped attention is not supported yet",
    )
    _require(
        config.convert in ("auto", "none", pooling.kind),
        "convert",
        f"{spec.architecture} is a {pooling.kind} model; --convert {config.convert} does not apply",
    )
    _require(config.speculative_config is None, "speculative_config", "does not apply to a pooling model")
    config.pooler = read_pooler_config(config.model, pooling.kind, pooling.default_pooling, spec.num_labels)
    if pooling.kind == "classify" and spec.pooling is None:  # a generative decoder made a classifier
        num_labels, token_ids, method = converted_classifier(config.model, config.tokenizer or config.model, settings)
        _require(num_labels >= 1, "hf_overrides", f"num_labels must be >= 1, got {num_labels}")
        _require(
            bool(token_ids) or _has_tensor(config.model, "score.weight"),
            "convert",
            f"classify: the {spec.architecture} checkpoint has no score.weight (a classification head); "
            "name the tokens whose LM-head rows make one with hf_overrides' classifier_from_token and method",
        )
        config.pooler = read_pooler_config(config.model, "classify", pooling.default_pooling, num_labels)
        config.pooler.classifier_token_ids, config.pooler.classifier_method = token_ids, method
    # NOTE: async scheduling stays as resolved (on with CUDA): pooling steps never depend on each
    # other's answers, so the core schedules step N+1 while N runs and the device never waits on
    # the host's bookkeeping between steps.
    config.piecewise_cuda_graphs = False
    config.enable_prefix_caching = False


def _converted_decoder(config: EngineConfig, spec: ModelSpec):
    """A generative decoder served with --runner pooling: its final hidden state at the last
    token (vLLM's --convert embed), or a classifier over it (--convert classify: vLLM's
    as_seq_cls_model, the checkpoint's `score` head or one made from LM-head rows)."""
    from zllm.model_spec import PoolingArchitecture

    kind = "classify" if config.convert == "classify" else "embed"
    return PoolingArchitecture("decoder", kind, "last", spec.architecture)


def _convert_by_architectures(config: EngineConfig, spec: ModelSpec, architectures) -> None:
    """hf_overrides' architectures naming a pooling class of the checkpoint's own decoder
    (Qwen3ForCausalLM -> Qwen3ForSequenceClassification) is --convert of its kind."""
    from zllm.model_spec import POOLING_REGISTRY

    if architectures is None:
        return
    name = architectures[0] if isinstance(architectures, list) and len(architectures) == 1 else None
    target = POOLING_REGISTRY.get(name)
    _require(
        target is not None and target.decoder == spec.architecture and spec.pooling is None,
        "hf_overrides",
        f"architectures {architectures!r}: only a pooling class of the checkpoint's own decoder "
        f"({spec.architecture}) is supported",
    )
    _require(
        config.convert in ("auto", "none", target.kind),
        "convert",
        f"{config.convert} contradicts hf_overrides' {name} (a {target.kind} model)",
    )
    config.convert = target.kind
    if config.runner == "auto":
        config.runner = "pooling"


def _has_tensor(model_dir: str, name: str) -> bool:
    """Whether the checkpoint holds a tensor of that name (its safetensors headers only)."""
    from safetensors import safe_open

    from zllm.model_files import checkpoint_files

    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            if name in f.keys():
                return True
    return False


def _resolve_draft_model(config: EngineConfig, target: ModelSpec) -> None:
    """Check the speculative config; resolve a draft model's directory and refuse one whose
    vocabulary is not the target's (its token ids would mean other tokens)."""
    from zllm.model_files import resolve_model_dir

    speculative = config.speculative_config
    speculative.validate(config.tensor_parallel_size)
    if speculative.method not in MODEL_SPECULATIVE_METHODS:
        return
    speculative.model = str(resolve_model_dir(speculative.model))
    # NOTE: the draft's cache shares group 0's block tables, sized for one group of every layer;
    # the window-aware groups (zllm/kv_layout.py) would free or resize blocks under it.
    _require(
        not target.sliding_layers or config.disable_hybrid_kv_cache_manager,
        "speculative_config",
        f"a {speculative.method} proposer with a sliding-window target needs --disable-hybrid-kv-cache-manager "
        "(every block kept); the ngram method needs nothing",
    )
    if speculative.method != "draft_model":
        _check_eagle_head(config, target)
        return
    draft = ModelSpec.from_pretrained(speculative.model)
    _require(
        draft.vocab_size == target.vocab_size,
        "speculative_config.model",
        f"the draft's vocabulary ({draft.vocab_size} tokens) differs from the target's ({target.vocab_size}); "
        "a draft must share the target's tokenizer",
    )
    from zllm.partition import head_shards

    try:
        head_shards(draft.num_heads, draft.num_kv_heads, config.tensor_parallel_size)
    except ValueError as error:
        raise ValueError(
            f"speculative_config.model: the draft cannot be split over the target's ranks: {error}"
        ) from None


def _check_eagle_head(config: EngineConfig, target: ModelSpec) -> None:
    """Refuse an EAGLE head that cannot feed on the target (hidden size, vocabulary, aux layers,
    its heads over the ranks) before any process starts."""
    from zllm.eagle_spec import EagleSpec
    from zllm.partition import head_shards

    speculative = config.speculative_config
    where = "speculative_config.model"
    _require(
        target.vision is None and target.mla is None,
        "speculative_config.method",
        f"{speculative.method} heads are not served for {target.architecture} yet",
    )
    head = EagleSpec.read(speculative.model, speculative.method, target, with_weights=config.load_format != "dummy")
    try:
        head_shards(head.layer.num_heads, head.layer.num_kv_heads, config.tensor_parallel_size)
    except ValueError as error:
        raise ValueError(f"{where}: the head cannot be split over the target's ranks: {error}") from None


def _check_lora(config: EngineConfig, spec: ModelSpec) -> None:
    """LoRA limits, the model it applies to, and every --lora-modules adapter (refused at start
    when broken: a clear error beats one per request)."""
    from zllm.lora import check_adapter

    _require(config.max_loras >= 1, "max_loras", f"must be >= 1, got {config.max_loras}")
    _require(config.max_lora_rank >= 1, "max_lora_rank", f"must be >= 1, got {config.max_lora_rank}")
    if config.max_cpu_loras is None:
        config.max_cpu_loras = config.max_loras
    _require(
        config.max_cpu_loras >= config.max_loras,
        "max_cpu_loras",
        f"must be >= max_loras ({config.max_loras}), got {config.max_cpu_loras}",
    )
    _require(config.runner == "generate", "enable_lora", "applies to generative models only")
    _require(spec.moe is None, "enable_lora", "Mixture-of-Experts models take no LoRA adapters yet")
    _require(not spec.fused_checkpoint, "enable_lora", f"{spec.architecture} (fused q/k/v) takes no LoRA adapters yet")
    _require(config.quantization is None and spec.quantization is None, "enable_lora", "needs an unquantized model")
    for name, path in config.lora_modules.items():
        _require(bool(name) and name != config.model_name, "lora_modules", f"bad adapter name {name!r}")
        try:
            check_adapter(path, spec, config.max_lora_rank)
        except ValueError as error:
            raise ValueError(f"lora_modules: {name}: {error}") from None


def serving_token_budget(spec: ModelSpec, tensor_parallel_size: int) -> int:
    """A server's default max_num_batched_tokens on a GPU (SERVING_BUDGET_REFERENCE's comment)."""
    reference_budget, reference_weights = SERVING_BUDGET_REFERENCE
    per_gpu = spec.linear_weights_per_token() / tensor_parallel_size
    scaled = reference_budget * reference_weights / max(per_gpu, 1.0)
    low, high = SERVING_BUDGET_RANGE
    power = 1 << max(int(scaled), 1).bit_length() - 1  # the power of two at or below
    return min(max(power, low), high)


def runs_on_cuda(config: EngineConfig) -> bool:
    """Whether the engine's workers run on CUDA devices (device "auto": where torch sees one)."""
    if config.device != "auto":
        return config.device == "cuda"
    import torch

    return torch.cuda.is_available()


def _check_tensor_parallel(config: EngineConfig, spec: ModelSpec) -> None:
    """Refuse a split that cannot work before any process starts."""
    from zllm.partition import head_shards

    head_shards(spec.num_heads, spec.num_kv_heads, config.tensor_parallel_size)
    needed = config.ranks_per_node * config.local_engines  # on this node
    if needed == 1 or config.device == "cpu":
        return
    import torch

    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if config.device == "cuda" or available:
        if config.local_engines == 1:
            _require(
                needed <= available,
                "tensor_parallel_size",
                f"{needed} ranks need {needed} GPUs, but {available} are visible",
            )
        _require(
            needed <= available,
            "data_parallel_size",
            f"{config.local_engines} engines x "
            f"{config.ranks_per_node} rank(s) need {needed} GPUs, but {available} are visible",
        )


def _require_choice(config: EngineConfig, field: str) -> None:
    """The field holds one of its CHOICES."""
    value, choices = getattr(config, field), CHOICES[field]
    _require(value in choices, field, f"must be one of {choices}, got {value!r}")


def _require(ok: bool, field: str, reason: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {reason}")
