"""Tensor parallelism on CPU (gloo): the split arithmetic, per-rank loading, and tp N = tp 1
greedy output through LLM and through vllm-launch + Client, with real worker processes."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import torch

from tests.helpers.models import save_tiny_llama
from tests.helpers.server import start_server
from zllm import LLM, Client, SamplingParams
from zllm.partition import even_split, head_shards, vocab_shard
from zllm.workers.distributed import TensorParallel

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea:",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
]


# ---- the split ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,tp",
    [(9, 3, 2), (9, 3, 3), (9, 3, 4), (32, 8, 2), (32, 8, 3), (64, 8, 4), (64, 8, 16), (8, 8, 3), (4, 1, 3)],
)
def test_head_shards_cover_every_head_once_with_its_kv_head(num_heads, num_kv_heads, tp):
    group = num_heads // num_kv_heads
    shards = head_shards(num_heads, num_kv_heads, tp)
    assert len(shards) == tp
    owned = [h for s in shards for h in range(s.q_heads.start, s.q_heads.stop)]
    assert owned == list(range(num_heads))
    for shard in shards:
        assert shard.q_heads.count >= 1
        # Uniform grouping on the rank: local q head i uses local kv head i // local_group.
        local_group = shard.q_heads.count // shard.kv_heads.count
        assert local_group * shard.kv_heads.count == shard.q_heads.count
        for i, head in enumerate(range(shard.q_heads.start, shard.q_heads.stop)):
            assert head // group == shard.kv_heads.start + i // local_group


def test_head_shards_refuse_more_ranks_than_heads():
    with pytest.raises(ValueError, match="tensor_parallel_size: 10 ranks exceed the model's 9 attention heads"):
        head_shards(9, 3, 10)


def test_even_and_vocab_splits_tile_the_range():
    spans = [even_split(10, 3, r) for r in range(3)]
    assert [(s.start, s.count) for s in spans] == [(0, 4), (4, 3), (7, 3)]
    vocab = [vocab_shard(49152 + 1, 4, r) for r in range(4)]
    assert [v.start for v in vocab] == [0, 12289, 24578, 36867]
    assert sum(v.count for v in vocab) == 49153


def test_each_rank_loads_only_its_slice_and_the_slices_rebuild_the_model(tmp_path):
    """Ranks of tp 3 (uneven: 4 heads, 2 KV heads) hold exactly the matching slices of HF's tensors."""
    from safetensors.torch import load_file

    from zllm.model_spec import ModelSpec
    from zllm.workers.models import build_model
    from zllm.workers.weight_loader import load_safetensors

    model_dir = save_tiny_llama(tmp_path / "m", num_attention_heads=4, num_key_value_heads=2, vocab_size=250)
    hf = load_file(str(model_dir / "model.safetensors"))
    spec = ModelSpec.from_pretrained(str(model_dir))
    ranks = []
    for rank in range(3):
        model = build_model(spec, tp=TensorParallel(rank=rank, size=3))
        load_safetensors(model, str(model_dir))
        ranks.append(dict(model.named_parameters()))
    d = spec.head_dim
    layer = "model.layers.1"
    for rank, shard in enumerate(head_shards(4, 2, 3)):
        q_rows = slice(shard.q_heads.start * d, shard.q_heads.stop * d)
        kv_rows = slice(shard.kv_heads.start * d, shard.kv_heads.stop * d)
        expected_qkv = torch.cat(
            [
                hf[f"{layer}.self_attn.{n}_proj.weight"][rows]
                for n, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))
            ]
        )
        assert torch.equal(ranks[rank][f"{layer}.self_attn.qkv_proj.weight"], expected_qkv)
        o = ranks[rank][f"{layer}.self_attn.o_proj.weight"]
        assert torch.equal(o, hf[f"{layer}.self_attn.o_proj.weight"][:, q_rows])
    down = torch.cat([r[f"{layer}.mlp.down_proj.weight"] for r in ranks], dim=1)
    assert torch.equal(down, hf[f"{layer}.mlp.down_proj.weight"])
    embed = torch.cat([r["model.embed_tokens.weight"] for r in ranks])  # padded to 3 x 84 rows
    assert torch.equal(embed[:250], hf["model.embed_tokens.weight"]) and not embed[250:].any()


# ---- whole engines -----------------------------------------------------------------------------


def _greedy_tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def smollm2_tp1_tokens(smollm2_dir):
    llm = LLM(smollm2_dir, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 << 20)
    try:
        return _greedy_tokens(llm, PROMPTS)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("tp, async_scheduling", [(2, False), (4, False), (2, True)], ids=["tp2", "tp4", "tp2-async"])
def test_llm_tp_n_matches_tp_1_on_smollm2(smollm2_dir, smollm2_tp1_tokens, tp, async_scheduling):
    # Async: the core sends step N+1 before step N's answer; every rank feeds rank 0's broadcast
    # tokens of step N into step N+1 itself.
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    llm = LLM(
        smollm2_dir,
        dtype="float32",
        max_model_len=1024,
        kv_cache_memory_bytes=64 << 20,
        tensor_parallel_size=tp,
        async_scheduling=async_scheduling,
    )
    workers = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert len(workers) == tp
    try:
        assert _greedy_tokens(llm, PROMPTS) == smollm2_tp1_tokens
    finally:
        llm.shutdown()
    assert _wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers), 10)


def test_llm_tp_8_matches_hf_with_replicated_kv_heads_and_padded_vocab(tmp_path):
    """Issue 38's eight ranks on a tiny Llama: 8 heads over 2 KV heads (each KV head replicated on
    4 ranks), a 250-token vocabulary in 8 padded blocks of 32, an intermediate size of 100 (ranks
    of 13 and 12 rows). Equal to transformers' fp32 greedy tokens, hence to tp 1..4's
    (test_llm_tp_n_matches_tp_1_on_smollm2)."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.models import greedy_engine_tokens, hf_greedy

    config = dict(num_attention_heads=8, num_key_value_heads=2, vocab_size=250, intermediate_size=100)
    model_dir = save_tiny_llama(tmp_path / "m", **config)
    prompts = [[7, 3, 9, 11, 5], list(range(3, 40))]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, 8, eos_token_id=None) for p in prompts]
    tokens, _ = greedy_engine_tokens(model_dir, prompts, 8, tensor_parallel_size=8, kv_cache_memory_bytes=4 << 20)
    assert tokens == expected


def test_dummy_weights_are_the_same_model_at_every_tp(tmp_path):
    model_dir = save_tiny_llama(tmp_path / "m", num_attention_heads=4, num_key_value_heads=2)
    kwargs = dict(dtype="float32", load_format="dummy", max_model_len=256, kv_cache_memory_bytes=8 << 20)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10] * 4}]
    tokens = []
    for tp in (1, 2):
        llm = LLM(str(model_dir), tensor_parallel_size=tp, **kwargs)
        try:
            tokens.append(_greedy_tokens(llm, prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)))
        finally:
            llm.shutdown()
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("scheduling", ["--no-async-scheduling", "--async-scheduling"])
def test_vllm_launch_tp_2_serves_the_client_like_tp_1(tmp_path, smollm2_dir, smollm2_tp1_tokens, scheduling):
    handle = start_server(tmp_path, smollm2_dir, "--tp", "2", "--dtype", "float32", scheduling)
    try:
        workers = [p for p in handle.children() if "zllm.workers.process" in " ".join(p.cmdline())]
        assert len(workers) == 2
        with Client(handle.endpoint) as client:
            got = [client.generate(p, GREEDY).outputs[0].token_ids for p in PROMPTS]
        assert got == smollm2_tp1_tokens
        # Concurrent requests: one batch, requests finishing while the next step is in flight.
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            concurrent = list(pool.map(lambda p: _generate_once(handle.endpoint, p), PROMPTS))
        assert concurrent == smollm2_tp1_tokens
    finally:
        assert handle.stop() == 0


def _generate_once(endpoint: str, prompt: str) -> list[int]:
    with Client(endpoint) as client:
        return client.generate(prompt, GREEDY).outputs[0].token_ids


# ---- bad input and failures --------------------------------------------------------------------


def test_tp_that_cannot_split_the_heads_fails_before_anything_starts(tmp_path, smollm2_dir):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "zllm.launch.cli",
            "--model",
            smollm2_dir,
            "--tp",
            "10",
            "--zmq-endpoint",
            f"ipc://{tmp_path}/c.sock",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "tensor_parallel_size: 10 ranks exceed the model's 9 attention heads" in result.stderr
    assert "zllm.workers" not in result.stderr  # refused in the launcher, no worker ever ran


def test_more_ranks_than_gpus_is_refused(smollm2_dir):
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 ranks need 2 GPUs, but 0 are visible"):
        LLM(smollm2_dir, device="cuda", tensor_parallel_size=2)


def test_a_rank_that_fails_to_start_is_named_and_no_process_is_left(tmp_path):
    """Rank 1 cannot load its shard (the checkpoint is truncated in its half of a tensor)."""
    from safetensors.torch import load_file, save_file

    model_dir = save_tiny_llama(tmp_path / "m")
    tensors = load_file(str(model_dir / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()  # wrong shape: every rank notices
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(
        RuntimeError,
        match=r"rank [01]: ValueError: model: .*/model.safetensors: tensor "
        r"'model.layers.0.mlp.down_proj.weight' has shape \(64, 127\)",
    ):
        LLM(str(model_dir), dtype="float32", tensor_parallel_size=2, max_model_len=256, kv_cache_memory_bytes=8 << 20)
    assert _wait_until(lambda: not _live_children(before), 10), _live_children(before)


def test_a_rank_that_dies_later_is_detected(tmp_path):
    from zllm.enginecore.executor import WorkerDiedError

    model_dir = save_tiny_llama(tmp_path / "m")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    llm = LLM(str(model_dir), dtype="float32", tensor_parallel_size=2, max_model_len=256, kv_cache_memory_bytes=8 << 20)
    try:
        rank1 = next(p for p in _live_children(before) if "--rank" in p.cmdline() and p.cmdline()[-1] == "1")
        rank1.kill()
        rank1.wait(10)
        time.sleep(0.5)  # rank 1's socket has seen it go: a blocking send to it would wait forever
        started = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"rank 1 \(pid \d+\) exited"):
            llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(max_tokens=8), use_tqdm=False)
        assert time.monotonic() - started < 5
    finally:
        llm.shutdown()
    assert _wait_until(lambda: not _live_children(before), 10), _live_children(before)


def _live_children(before: set[int]) -> list[psutil.Process]:
    alive = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


# ---- leaving the process group at exit ---------------------------------------------------------
# NCCL warns at exit ("destroy_process_group() was not called before program exit") unless a
# worker leaves its group; gloo does not warn, so these tests look for the worker's own log line.


def _single_rank_group(tmp_path) -> None:
    torch.distributed.init_process_group(
        backend="gloo", init_method=f"file://{tmp_path / 'rendezvous'}", world_size=1, rank=0
    )


def test_leave_process_group_destroys_the_group_once_and_keeps_a_later_alarm(tmp_path, caplog):
    import signal

    from zllm.workers.distributed import leave_process_group

    assert not leave_process_group()  # no group: nothing to do
    _single_rank_group(tmp_path)
    handler = signal.getsignal(signal.SIGALRM)  # pytest-timeout's, where it runs
    before = signal.setitimer(signal.ITIMER_REAL, 100)
    try:
        with caplog.at_level("INFO", logger="zllm.workers.distributed"):
            assert leave_process_group(limit_s=5)
        assert not torch.distributed.is_initialized()
        assert "rank 0: left the gloo group" in caplog.text
        assert not leave_process_group()  # once
        assert signal.getsignal(signal.SIGALRM) == handler
    finally:
        left, _ = signal.setitimer(signal.ITIMER_REAL, *before)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert 95 < left <= 100


def test_leave_process_group_logs_a_failure_instead_of_raising(tmp_path, monkeypatch, caplog):
    from zllm.workers.distributed import leave_process_group

    real_destroy = torch.distributed.destroy_process_group
    _single_rank_group(tmp_path)
    try:

        def failing_destroy(*args, **kwargs):
            raise RuntimeError("the communicator is gone")

        monkeypatch.setattr(torch.distributed, "destroy_process_group", failing_destroy)
        assert not leave_process_group(limit_s=5)
        assert "rank 0: destroy_process_group() failed" in caplog.text
        assert "the communicator is gone" in caplog.text
    finally:
        real_destroy()


def test_a_hung_destroy_process_group_ends_the_process_within_its_limit(tmp_path):
    script = f"""
import time, torch
from zllm.workers.distributed import leave_process_group
torch.distributed.init_process_group(
    backend="gloo", init_method="file://{tmp_path / "rendezvous"}", world_size=1, rank=0
)
torch.distributed.destroy_process_group = lambda *args, **kwargs: time.sleep(60)
leave_process_group(limit_s=1)
print("not reached")
"""
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == -14, result.stderr  # SIGALRM
    assert "not reached" not in result.stdout
    assert time.monotonic() - started < 30


def _tp2_llm(tmp_path) -> LLM:
    model_dir = save_tiny_llama(tmp_path / "m", num_attention_heads=4, num_key_value_heads=2)
    return LLM(
        str(model_dir), dtype="float32", tensor_parallel_size=2, max_model_len=256, kv_cache_memory_bytes=8 << 20
    )


def _worker_processes(llm: LLM) -> dict[int, subprocess.Popen]:
    return dict(llm.engine.core.executor.executor.processes)  # LLM -> EngineCore -> WorkerProcessGroup


def test_tp_2_workers_leave_the_group_and_exit_0_on_shutdown(tmp_path, capfd):
    """The executor's shutdown call reaches each rank before any SIGTERM: each releases its model,
    leaves the group and exits 0 by itself."""
    llm = _tp2_llm(tmp_path)
    workers = _worker_processes(llm)
    try:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        llm.shutdown()
    assert {rank: process.returncode for rank, process in workers.items()} == {0: 0, 1: 0}
    stderr = capfd.readouterr().err
    assert "rank 0: left the gloo group" in stderr and "rank 1: left the gloo group" in stderr
    assert "destroy_process_group() was not called" not in stderr


def test_a_sigtermed_tp_worker_leaves_the_group_too(tmp_path, capfd):
    """SIGTERM (the core's stop_children after the grace, or the parent's death) takes the same path."""
    llm = _tp2_llm(tmp_path)
    workers = _worker_processes(llm)
    try:
        for process in workers.values():
            process.terminate()
        codes = {rank: process.wait(30) for rank, process in workers.items()}
    finally:
        llm.shutdown()
    assert codes == {0: 143, 1: 143}
    stderr = capfd.readouterr().err
    assert "rank 0: left the gloo group" in stderr and "rank 1: left the gloo group" in stderr


@pytest.mark.parametrize("code, status", [("0", 0), ("None", 0), ("3", 3), ("'bad rank'", 1)])
def test_a_worker_ends_with_its_status_and_its_logs_without_finalizing(code, status):
    """The worker process ends through exit_without_finalizing (no interpreter teardown, where a
    library thread's destructor aborted a clean rank once): the status as sys.exit reads it, the
    log lines and a message still written."""
    script = (
        "import logging; from zllm.workers.process import exit_without_finalizing; "
        "logging.basicConfig(); logging.getLogger('w').warning('last words'); "
        f"exit_without_finalizing({code})"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == status
    assert "last words" in done.stderr
    if status == 1:
        assert "bad rank" in done.stderr


def test_a_worker_started_without_its_rank_exits_2_with_argparse_usage():
    done = subprocess.run([sys.executable, "-m", "zllm.workers.process"], input=b"", capture_output=True, timeout=60)
    assert done.returncode == 2
    assert b"--rank" in done.stderr


# ---- the symmetric-memory all-reduce flag (GPU only; checked and ignored here) -----------------


def test_custom_all_reduce_size_flag_is_parsed_and_a_negative_one_refused():
    import argparse

    from zllm.launch.args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["custom_all_reduce_max_bytes"] is None  # the config's default
    args = parser.parse_args(["--custom-all-reduce-max-size", "8MiB"])
    assert engine_kwargs(args)["custom_all_reduce_max_bytes"] == 8 << 20
    with pytest.raises(SystemExit):
        parser.parse_args(["--custom-all-reduce-max-size", "-1"])


def test_negative_custom_all_reduce_size_is_refused_before_anything_starts(smollm2_dir):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match=r"^custom_all_reduce_max_bytes: must be >= 0 \(0: NCCL only\), got -1$"):
        LLM(smollm2_dir, tensor_parallel_size=2, custom_all_reduce_max_bytes=-1)
    assert not _live_children(before)


def test_custom_all_reduce_default_is_on_for_one_node_gpu_tp_only(smollm2_dir, monkeypatch):
    """None resolves to 1 MiB for tp > 1 on CUDA with the tp group on one node (mp), else 0."""
    from zllm import config as config_module
    from zllm.config import DEFAULT_CUSTOM_ALL_REDUCE_BYTES, EngineConfig

    def resolved(**kwargs) -> int:
        return EngineConfig.create(smollm2_dir, **kwargs).custom_all_reduce_max_bytes

    assert resolved(tensor_parallel_size=2) == 0  # CPU: gloo
    monkeypatch.setattr(config_module, "runs_on_cuda", lambda config: True)
    assert resolved(tensor_parallel_size=2) == DEFAULT_CUSTOM_ALL_REDUCE_BYTES == 1 << 20
    assert resolved(tensor_parallel_size=1) == 0
    assert resolved(tensor_parallel_size=2, custom_all_reduce_max_bytes=0) == 0  # asked off
    assert (
        resolved(tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1", allow_insecure_tcp=True) == 0
    )  # the tp group spans two nodes
    assert resolved(tensor_parallel_size=2, distributed_executor_backend="ray") == 0


def test_mixed_graph_default_is_on_with_cuda_graphs(smollm2_dir, monkeypatch):
    """mixed_graph_max_tokens None resolves to the step budget up to 512 where CUDA graphs run, else 0."""
    from zllm import config as config_module
    from zllm.config import MIXED_GRAPH_TOKENS_CAP, EngineConfig

    def resolved(**kwargs) -> int:
        return EngineConfig.create(smollm2_dir, **kwargs).mixed_graph_max_tokens

    assert resolved(tensor_parallel_size=2) == 0  # CPU: no graphs
    monkeypatch.setattr(config_module, "runs_on_cuda", lambda config: True)
    assert resolved(tensor_parallel_size=2, max_num_batched_tokens=2048) == MIXED_GRAPH_TOKENS_CAP == 512
    assert resolved(tensor_parallel_size=2, max_num_batched_tokens=256) == 256
    assert resolved(tensor_parallel_size=1, max_num_batched_tokens=256) == 256
    assert resolved(tensor_parallel_size=2, enforce_eager=True) == 0
    assert resolved(tensor_parallel_size=2, mixed_graph_max_tokens=64) == 64
    assert resolved(mixed_graph_max_tokens=4096, max_num_batched_tokens=256) == 256  # never past the budget
    with pytest.raises(ValueError, match=r"^mixed_graph_max_tokens: must be >= 0 \(0: off\), got -1$"):
        EngineConfig.create(smollm2_dir, mixed_graph_max_tokens=-1)


def test_symmetric_all_reduce_set_up_is_a_no_op_on_cpu():
    """No collective at all on CPU (none could run here: no process group exists)."""
    from zllm.config import EngineConfig
    from zllm.workers.symmetric_all_reduce import attach_symmetric_all_reduce

    tp = TensorParallel(rank=0, size=2)
    config = EngineConfig(model="", custom_all_reduce_max_bytes=8 << 20)
    attach_symmetric_all_reduce(tp, config, torch.device("cpu"), torch.float32)
    assert tp.fast is None and not torch.distributed.is_initialized()


def test_tp_2_on_gloo_with_the_custom_all_reduce_flag_matches_tp_1(tmp_path):
    model_dir = save_tiny_llama(tmp_path / "m", num_attention_heads=4, num_key_value_heads=2)
    kwargs = dict(dtype="float32", load_format="dummy", max_model_len=256, kv_cache_memory_bytes=8 << 20)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10] * 4}]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = []
    for tp, limit in ((1, 0), (2, 8 << 20)):
        llm = LLM(str(model_dir), tensor_parallel_size=tp, custom_all_reduce_max_bytes=limit, **kwargs)
        try:
            tokens.append(_greedy_tokens(llm, prompts, params))
        finally:
            llm.shutdown()
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize(
    "shape, dtype, offset, accepted",
    [
        ((1, 4096), torch.bfloat16, 0, True),
        ((16, 4096), torch.bfloat16, 0, True),  # exactly the buffer's 128 KiB
        ((17, 4096), torch.bfloat16, 0, False),  # larger than the buffer: NCCL
        ((1, 4096), torch.float32, 0, False),  # another dtype: NCCL
        ((1, 3), torch.bfloat16, 0, False),  # 6 bytes: not a whole 16-byte vector
        ((1, 4096), torch.bfloat16, 3, False),  # starts 6 bytes into its storage
        ((1, 4096), torch.bfloat16, 8, True),  # 16 bytes in: aligned
    ],
)
def test_symmetric_path_takes_only_tensors_the_one_shot_kernel_can_load(shape, dtype, offset, accepted):
    """The choice depends on shape, dtype and layout alone, so every rank makes the same one."""
    from zllm.workers.symmetric_all_reduce import SymmetricAllReduce

    fast = SymmetricAllReduce(torch.empty(64 << 10, dtype=torch.bfloat16), group_name="")
    numel = shape[0] * shape[1]
    x = torch.empty(numel + offset, dtype=dtype)[offset:].view(shape)
    assert fast.accepts(x) == accepted
    assert not fast.accepts(torch.empty(8, 4096, dtype=torch.bfloat16).t())  # not contiguous


def _vote_rank(rank: int, init_file: str, failing_rank: int, results) -> None:
    """A set-up phase that raises on `failing_rank` only (-1: nowhere), through the real vote."""
    from zllm.workers.symmetric_all_reduce import _run_phase

    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", world_size=2, rank=rank)

    def phase():
        if rank == failing_rank:
            raise RuntimeError("cannot map the peer's buffer")
        return "buffer"

    try:
        results[rank] = _run_phase(TensorParallel(rank=rank, size=2), torch.device("cpu"), "rendezvous", phase)
    finally:
        torch.distributed.destroy_process_group()


def _switch_rank(rank: int, init_file: str, settings: tuple[str, ...], results) -> None:
    """ZLLM_ALLREDUCE_LAMPORT set to settings[rank] ("" unset), asked through the real vote with
    the engine's own default for the world."""
    import os

    from zllm.workers.symmetric_all_reduce import _switch_on_every_rank, lamport_by_default

    os.environ.pop("ZLLM_ALLREDUCE_LAMPORT", None)
    if settings[rank]:
        os.environ["ZLLM_ALLREDUCE_LAMPORT"] = settings[rank]
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", world_size=2, rank=rank)
    try:
        tp = TensorParallel(rank=rank, size=2)
        results[rank] = _switch_on_every_rank(
            tp, torch.device("cpu"), "ZLLM_ALLREDUCE_LAMPORT", default=lamport_by_default(tp.size)
        )
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize(
    "settings, expected",
    [
        (("1", "1"), True),
        (("0", "0"), False),
        (("0", "1"), False),
        (("", ""), True),  # auto at tp 2: on
        (("auto", ""), True),
        (("", "0"), False),  # auto on one rank, off on the other: off on both
    ],
)
def test_a_kernel_switch_set_on_some_ranks_only_is_off_on_all(tmp_path, settings, expected):
    """The Lamport and fused-norm set-ups are collective: a switch on one rank only (nodes
    started with different environments) must turn it off everywhere, not run a phase alone.
    Left at auto, the world's default (on at tp 2) counts as that rank's setting."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        context = mp.start_processes(
            _switch_rank,
            args=(str(tmp_path / "rendezvous"), settings, results),
            nprocs=2,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + 120
        while not context.join(timeout=1):
            assert time.monotonic() < deadline, "the ranks did not finish their vote"
        assert dict(results) == {0: expected, 1: expected}


@pytest.mark.parametrize("failing_rank, expected", [(-1, "buffer"), (0, None), (1, None)])
def test_a_set_up_phase_that_fails_on_one_rank_puts_every_rank_on_the_fallback(tmp_path, failing_rank, expected):
    """Ranks never part ways: a failure on any one rank means NCCL (here gloo) on all of them."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        context = mp.start_processes(
            _vote_rank,
            args=(str(tmp_path / "rendezvous"), failing_rank, results),
            nprocs=2,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + 120
        while not context.join(timeout=1):
            assert time.monotonic() < deadline, "the ranks did not finish their vote"
        assert dict(results) == {0: expected, 1: expected}
