"""Command-line engine arguments: one parser shared by every entry point."""

from __future__ import annotations

import argparse
import json
import re

from zllm import envs
from zllm.config import (
    CONVERTS,
    DEVICES,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    ON_FAILURE_POLICIES,
    REASONING_PARSERS,
    RUNNERS,
    SCHEDULING_POLICIES,
    TOOL_CALL_PARSERS,
    EngineConfig,
)
from zllm.quantization import QUANTIZATION_METHODS

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
}


def parse_size(text: str) -> int:
    """'4GiB', '512MiB', '1.5GB' or a plain byte count -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 4GiB, 512MiB or a byte count)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def parse_json_object(text: str) -> dict:
    """A JSON object given on the command line (e.g. --speculative-config)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def parse_lora_module(text: str) -> tuple[str, str]:
    """--lora-modules NAME=PATH (vLLM's form) -> (name, path)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    """Multi-LoRA serving, as vLLM's flags."""
    defaults = EngineConfig(model="")
    group = parser.add_argument_group("lora")
    group.add_argument("--enable-lora", action="store_true", help="serve PEFT LoRA adapters on the base model")
    group.add_argument(
        "--lora-modules",
        type=parse_lora_module,
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="adapters served from the start; a request's `model` names one",
    )
    group.add_argument(
        "--max-loras", type=int, default=defaults.max_loras, help="distinct adapters in one step (device slots)"
    )
    group.add_argument(
        "--max-lora-rank", type=int, default=defaults.max_lora_rank, help="the largest adapter rank accepted"
    )
    group.add_argument(
        "--max-cpu-loras", type=int, default=None, help="adapters kept in host memory (default: --max-loras)"
    )


def lora_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        enable_lora=args.enable_lora,
        lora_modules=dict(args.lora_modules),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
    )


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig(model="")
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model", default=None, help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)"
    )
    group.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    group.add_argument("--tp", "--tensor-parallel-size", dest="tensor_parallel_size", type=int, default=1)
    group.add_argument(
        "-dp",
        "--dp",
        "--data-parallel-size",
        dest="data_parallel_size",
        type=int,
        default=1,
        help="engine cores behind one frontend, each with its own --tp workers (and GPUs)",
    )
    group.add_argument("--device", choices=DEVICES, default=defaults.device)
    group.add_argument("--dtype", choices=DTYPES, default=defaults.dtype)
    group.add_argument("--seed", type=int, default=defaults.seed)
    group.add_argument("--load-format", choices=LOAD_FORMATS, default=defaults.load_format)
    group.add_argument(
        "--quantization",
        "-q",
        choices=QUANTIZATION_METHODS,
        default=None,
        help="fp8: quantize the linear layers' weights to FP8 while loading (FP8 checkpoints need no flag)",
    )
    group.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=defaults.kv_cache_dtype,
        help="fp8: store keys and values as FP8 E4M3 (twice the tokens per GiB); auto: the model dtype",
    )
    group.add_argument("--max-model-len", type=int, default=0, help="0: the model's max_position_embeddings")
    group.add_argument("--block-size", type=int, default=defaults.block_size)
    group.add_argument("--num-kv-blocks", type=int, default=None, help="override the KV cache size in blocks")
    group.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        default=defaults.kv_cache_memory_bytes,
        help="CPU KV cache size, e.g. 2GiB",
    )
    group.add_argument("--gpu-memory-utilization", type=float, default=defaults.gpu_memory_utilization)
    # Unset (None), the engine picks them for its use (zllm/config.py): a server keeps
    # max_num_seqs 256 and sizes its token budget by the model's weights per GPU (2048 down to 512);
    # an offline run on a GPU takes 512 / 8192.
    group.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help=f"requests in one step (default: {defaults.max_num_seqs} served, 512 offline on a GPU)",
    )
    group.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help=f"tokens in one step (default: {defaults.max_num_batched_tokens}; served on a GPU, 2048 scaled down "
        "by the model's weights per GPU to at least 512; 8192 offline on a GPU)",
    )
    group.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: run every step without CUDA graphs (decode, piecewise, pooling)",
    )
    group.add_argument(
        "--piecewise-cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="steps with prefill run as CUDA graphs split at attention (default: on with CUDA, for dense "
        "and MoE models; --enforce-eager turns every graph off)",
    )
    group.add_argument(
        "--mixed-graph-max-tokens",
        type=int,
        default=None,
        help="steps with prefill of at most N tokens over short contexts run each prompt token as a row of the "
        "decode CUDA graph (default: the step budget up to 512 with CUDA graphs, else 0: off)",
    )
    group.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule the next step while the current one runs (default: on with CUDA, off on CPU)",
    )
    group.add_argument(
        "--speculative-config",
        type=parse_json_object,
        default=None,
        metavar="JSON",
        help='speculative decoding, vLLM\'s keys, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' or '
        '\'{"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}\'; method "eagle" / "eagle3" with '
        "an EAGLE head's directory as model (default: off)",
    )
    group.add_argument("--served-model-name", default=None)
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=defaults.enable_prefix_caching,
        help="reuse the KV cache of identical prompt prefixes across requests (default: on)",
    )
    group.add_argument(
        "--runner",
        choices=RUNNERS,
        default=defaults.runner,
        help="generate: sample tokens; pooling: embeddings, scores, classes (default auto: by the architecture)",
    )
    group.add_argument(
        "--convert",
        choices=CONVERTS,
        default=defaults.convert,
        help="the pooling task of the checkpoint, embed or classify (default auto: its head decides)",
    )
    group.add_argument(
        "--hf-overrides",
        type=parse_json_object,
        default={},
        metavar="JSON",
        help="vLLM's keys that make a generative decoder a classifier, e.g. Qwen3-Reranker's "
        '\'{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], '
        '"is_original_qwen3_reranker": true}\' (default: none)',
    )
    group.add_argument(
        "--disable-hybrid-kv-cache-manager",
        action="store_true",
        default=defaults.disable_hybrid_kv_cache_manager,
        help="keep sliding-window layers' KV blocks for the whole sequence, as full layers' (default: blocks "
        "behind the window are freed)",
    )
    group.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default=defaults.scheduling_policy,
        help="fcfs: arrival order; priority: requests with a lower `priority` value first",
    )
    group.add_argument(
        "--max-logprobs",
        type=int,
        default=defaults.max_logprobs,
        help="the most logprobs / prompt_logprobs a request may ask for",
    )
    group.add_argument("--max-n", type=int, default=defaults.max_n, help="the most completions (n) per request")
    group.add_argument(
        "--distributed-init-method",
        default="",
        help="torch.distributed rendezvous for tp > 1 (default: a file in the runtime dir)",
    )
    group.add_argument(
        "--custom-all-reduce-max-size",
        dest="custom_all_reduce_max_bytes",
        type=parse_size,
        default=defaults.custom_all_reduce_max_bytes,
        metavar="SIZE",
        help="GPU tp: all-reduces up to this size (e.g. 8MiB) use PyTorch's symmetric-memory "
        "one-shot kernel instead of NCCL; 0: NCCL only (default: 1MiB when the tp group is on one node, else 0)",
    )
    group.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="load no tokenizer: prompts are token ids and outputs token ids (for checkpoints without one)",
    )
    group.add_argument(
        "--grammar-cache-size",
        type=int,
        default=defaults.grammar_cache_size,
        help="structured outputs: compiled grammars kept for reuse",
    )
    group.add_argument(
        "--grammar-threads",
        type=int,
        default=defaults.grammar_threads,
        help="structured outputs: threads compiling grammars and filling a step's bitmask",
    )
    group.add_argument(
        "--limit-mm-per-prompt",
        type=parse_json_object,
        default=None,
        help="vision-language models: the most images a prompt may carry, e.g. '{\"image\": 2}'",
    )
    group.add_argument(
        "--mm-processor-kwargs",
        type=parse_json_object,
        default=None,
        help="vision-language models: arguments for the image processor, e.g. '{\"max_pixels\": 1003520}'",
    )
    group.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="the folder under which image URLs may name local files (file:// or a path); none by default",
    )
    add_lora_args(parser)


def add_http_args(group) -> None:
    """The OpenAI-compatible HTTP API's flags (served by the frontend)."""
    defaults = EngineConfig(model="")
    group.add_argument("--host", default=defaults.host, help="HTTP API address")
    group.add_argument("--port", type=int, default=defaults.port, help="HTTP API port (0: any free port)")
    group.add_argument(
        "--api-server-count",
        type=int,
        default=defaults.api_server_count,
        help="frontend processes serving the HTTP API on the same host:port, each driving -dp / count "
        "of the engines (must divide -dp); more than 1 lifts the one-CPU limit on streamed tokens",
    )
    group.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1 routes, "
        "and the key in every ZMQ client request (default: $ZLLM_API_KEY if set)",
    )
    group.add_argument(
        "--max-request-body",
        dest="max_request_body_bytes",
        type=parse_size,
        default=defaults.max_request_body_bytes,
        help="largest HTTP request body, e.g. 8MiB (413 above)",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let tool_choice "auto" read tool calls out of the output (needs --tool-call-parser)',
    )
    group.add_argument(
        "--tool-call-parser",
        choices=list(TOOL_CALL_PARSERS),
        default=None,
        help="the model's tool-call format, as vLLM names it",
    )
    group.add_argument(
        "--reasoning-parser",
        choices=list(REASONING_PARSERS),
        default=None,
        help="split a reasoning model's thinking from its answer (reasoning_content), as vLLM names the format",
    )
    group.add_argument(
        "--enable-responses-store",
        action="store_true",
        help="/v1/responses: keep recent responses in memory so that previous_response_id can continue them",
    )


def http_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        host=args.host,
        port=args.port,
        api_server_count=args.api_server_count,
        api_key=args.api_key or envs.ZLLM_API_KEY,
        max_request_body_bytes=args.max_request_body_bytes,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        enable_responses_store=args.enable_responses_store,
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig.create keyword arguments from parsed arguments (model excluded)."""
    return dict(
        tokenizer=args.tokenizer,
        skip_tokenizer_init=args.skip_tokenizer_init,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        load_format=args.load_format,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        piecewise_cuda_graphs=args.piecewise_cuda_graphs,
        mixed_graph_max_tokens=args.mixed_graph_max_tokens,
        async_scheduling=args.async_scheduling,
        speculative_config=args.speculative_config,
        served_model_name=args.served_model_name,
        enable_prefix_caching=args.enable_prefix_caching,
        disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
        scheduling_policy=args.scheduling_policy,
        runner=args.runner,
        convert=args.convert,
        hf_overrides=args.hf_overrides,
        max_logprobs=args.max_logprobs,
        max_n=args.max_n,
        distributed_init_method=args.distributed_init_method,
        custom_all_reduce_max_bytes=args.custom_all_reduce_max_bytes,
        grammar_cache_size=args.grammar_cache_size,
        grammar_threads=args.grammar_threads,
        limit_mm_per_prompt=args.limit_mm_per_prompt or {},
        mm_processor_kwargs=args.mm_processor_kwargs or {},
        allowed_local_media_path=args.allowed_local_media_path,
        **lora_kwargs(args),
    )


def add_reliability_args(parser: argparse.ArgumentParser) -> None:
    """Supervision, graceful shutdown, overload and client-endpoint security (docs/deployment.md)."""
    defaults = EngineConfig(model="")
    group = parser.add_argument_group("reliability and security")
    group.add_argument(
        "--on-failure",
        choices=ON_FAILURE_POLICIES,
        default=defaults.on_failure,
        help="when the engine core or a worker dies: restart it and replay the requests in "
        "flight (default), or fail them all with an engine-dead error and exit",
    )
    group.add_argument(
        "--max-restarts",
        type=int,
        default=defaults.max_restarts,
        help="engine restarts allowed within --restart-window before giving up",
    )
    group.add_argument("--restart-window", type=float, default=defaults.restart_window_s, metavar="SECONDS")
    group.add_argument(
        "--engine-hang-timeout",
        type=float,
        default=defaults.engine_hang_timeout_s,
        metavar="SECONDS",
        help="restart an engine core that neither steps nor answers for this long",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=defaults.shutdown_timeout_s,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long requests in flight may take to finish",
    )
    group.add_argument(
        "--max-waiting",
        type=int,
        default=defaults.max_waiting,
        help="requests that may wait for a slot; beyond it new ones get a retry-later error",
    )
    group.add_argument(
        "--zmq-curve-dir",
        default=defaults.curve_dir,
        metavar="DIR",
        help="CURVE keys for a tcp:// client endpoint (server key pair, clients/*.key)",
    )
    group.add_argument(
        "--allow-insecure-tcp",
        action="store_true",
        help="serve a tcp:// client endpoint without CURVE: anyone who reaches it connects (on 127.0.0.1, "
        "any local user; elsewhere, the network: trusted networks only)",
    )
    group.add_argument(
        "--max-client-message-size",
        type=parse_size,
        default=defaults.client_max_message_bytes,
        help="a client sending a bigger message is disconnected (default 64MiB)",
    )
    group.add_argument(
        "--max-internal-message-size",
        type=parse_size,
        default=defaults.internal_max_message_bytes,
        help="the largest message between zllm's own processes; a bigger one drops the sender's "
        "connection (default 1GiB; at least 8x --max-client-message-size)",
    )


def reliability_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        on_failure=args.on_failure,
        max_restarts=args.max_restarts,
        restart_window_s=args.restart_window,
        engine_hang_timeout_s=args.engine_hang_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
        max_waiting=args.max_waiting,
        curve_dir=args.zmq_curve_dir,
        allow_insecure_tcp=args.allow_insecure_tcp,
        client_max_message_bytes=args.max_client_message_size,
        internal_max_message_bytes=args.max_internal_message_size,
    )


def add_node_args(parser: argparse.ArgumentParser) -> None:
    """Tensor or data parallelism across nodes (docs/deployment.md)."""
    defaults = EngineConfig(model="")
    group = parser.add_argument_group("several nodes")
    group.add_argument(
        "--nnodes",
        type=int,
        default=defaults.nnodes,
        help="machines the --tp ranks (with -dpl: the -dp engines) split over",
    )
    group.add_argument("--node-rank", type=int, default=defaults.node_rank, help="0: the head (frontend, engine core)")
    group.add_argument("--master-addr", default=defaults.master_addr, help="the head node's address (an IP)")
    group.add_argument(
        "--master-port",
        type=int,
        default=defaults.master_port,
        help="torch.distributed's port on the head; zllm also uses the next 2 + tp ports "
        "(with -dpl: the next 3 + 2 (dp - 1))",
    )
    group.add_argument(
        "--headless",
        action="store_true",
        help="run only this node's part (tp ranks, or engines) for the head (needs --node-rank >= 1)",
    )
    group.add_argument(
        "--node-join-timeout",
        type=float,
        default=defaults.node_join_timeout_s,
        metavar="SECONDS",
        help="how long the head waits for every node to join (and a node for the head's answer)",
    )
    group.add_argument(
        "-dpl",
        "--data-parallel-size-local",
        dest="data_parallel_size_local",
        type=int,
        default=defaults.data_parallel_size_local,
        help="engines per node: the -dp engines spread over the --nnodes nodes (each engine's "
        "--tp ranks stay on one node) instead of one engine's ranks",
    )
    group.add_argument(
        "--distributed-executor-backend",
        choices=DISTRIBUTED_EXECUTOR_BACKENDS,
        default=defaults.distributed_executor_backend,
        help="who starts and watches the --tp workers: mp, child processes on this node (with "
        "--nnodes, zllm's node agents); ray, actors of a Ray cluster (pip install zllm[ray])",
    )
    group.add_argument(
        "--ray-address",
        default=defaults.ray_address,
        help="the Ray cluster to join (auto, host:port, ray://...); default: RAY_ADDRESS, a cluster "
        "started on this machine, else a new local one",
    )


def node_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        node_join_timeout_s=args.node_join_timeout,
        data_parallel_size_local=args.data_parallel_size_local,
        distributed_executor_backend=args.distributed_executor_backend,
        ray_address=args.ray_address,
    )
