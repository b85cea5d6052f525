"""The Lamport all-reduce's CPU-visible parts (ZLLM_ALLREDUCE_LAMPORT): the switches' defaults, the
buffer's size and "empty" mark, the wrapper's refusal of CPU tensors, and the slot protocol of
csrc/allreduce_kernels.cu run as a model under random interleavings of the ranks' threads: with
three slots every read gets its own launch's value and nothing deadlocks; with two the model finds
a schedule that breaks (so it would notice a protocol that cannot work). The kernel itself:
tests/gpu/test_lamport_all_reduce_gpu.py."""

from __future__ import annotations

import random

import pytest
import torch

from zllm import envs
from zllm.workers import symmetric_all_reduce as sar
from zllm.workers.kernels.allreduce import (
    LAMPORT_FLAG_WORDS,
    LAMPORT_SLOTS,
    lamport_all_reduce,
    lamport_all_reduce_add_rms_norm,
    lamport_buffer_numel,
    lamport_sentinel_fill,
)


def test_switches_default_to_auto_and_a_minute(monkeypatch):
    monkeypatch.delenv("ZLLM_ALLREDUCE_LAMPORT", raising=False)
    monkeypatch.delenv("ZLLM_ALLREDUCE_SPIN_TIMEOUT_S", raising=False)
    assert envs.ZLLM_ALLREDUCE_LAMPORT is None
    assert envs.ZLLM_ALLREDUCE_SPIN_TIMEOUT_S == 60.0
    monkeypatch.setenv("ZLLM_ALLREDUCE_SPIN_TIMEOUT_S", "0")
    assert envs.ZLLM_ALLREDUCE_SPIN_TIMEOUT_S == 0.0
    for raw, value in (("1", True), ("on", True), ("0", False), ("off", False), ("auto", None), (" AUTO ", None)):
        monkeypatch.setenv("ZLLM_ALLREDUCE_LAMPORT", raw)
        assert envs.ZLLM_ALLREDUCE_LAMPORT is value, raw


def test_a_lamport_switch_neither_on_off_nor_auto_is_refused_with_its_name(monkeypatch):
    monkeypatch.setenv("ZLLM_ALLREDUCE_LAMPORT", "sometimes")
    with pytest.raises(ValueError, match="ZLLM_ALLREDUCE_LAMPORT"):
        envs.ZLLM_ALLREDUCE_LAMPORT  # noqa: B018


def test_auto_turns_lamport_on_only_at_the_world_sizes_measured_on_gpus():
    """tp 2 and tp 4 ran the GPU tests and beat the one-shot kernel; 8 has not run on GPUs yet."""
    assert [world for world in (2, 3, 4, 8) if sar.lamport_by_default(world)] == [2, 4]


@pytest.mark.parametrize("raw", ["-1", "nan", "inf", "1e9", "soon"])
def test_a_bad_spin_limit_is_refused_with_its_name(monkeypatch, raw):
    monkeypatch.setenv("ZLLM_ALLREDUCE_SPIN_TIMEOUT_S", raw)
    with pytest.raises(ValueError, match="ZLLM_ALLREDUCE_SPIN_TIMEOUT_S"):
        envs.ZLLM_ALLREDUCE_SPIN_TIMEOUT_S  # noqa: B018


class _FailingEvent:
    """A CUDA event whose query raises as torch does after a kernel trapped."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        raise RuntimeError("CUDA error: an illegal instruction was encountered")


def test_a_trapped_kernel_is_a_hang_error_not_a_vote(monkeypatch):
    """A Lamport kernel that hits its spin limit traps; the self-test's wait must then raise the
    hang error (which no vote catches: the context is gone), not a plain error a vote would
    catch and then run NCCL on."""
    monkeypatch.setattr(sar.torch.cuda, "Event", _FailingEvent)
    with pytest.raises(sar.SymmetricAllReduceHangError, match="failed on the GPU.*ZLLM_ALLREDUCE_LAMPORT"):
        sar._wait_or_hang(1, "Lamport all-reduce self-test")


def test_the_fused_self_test_launches_all_before_it_checks(monkeypatch):
    """Every rank makes all three fused launches before it checks one, so a wrong result on one
    rank cannot leave its peers spinning for a launch it never made."""
    events = []

    class Fast:
        buffer = torch.zeros(4, dtype=torch.float32)

        def all_reduce_add_rms_norm(self, partial, residual, weight, eps, _):
            events.append("launch")
            return torch.zeros_like(partial), torch.full_like(residual, -5.0)  # wrong on purpose

    monkeypatch.setattr(sar, "_wait_or_hang", lambda rank, what: events.append("wait"))
    with pytest.raises(RuntimeError, match="fused self-test gave"):
        sar._self_test_norm(Fast(), 0, 2, torch.device("cpu"))
    assert events == ["launch", "launch", "launch", "wait"]


def test_buffer_holds_three_slots_of_every_rank():
    assert lamport_buffer_numel(1 << 20, 4, torch.bfloat16) == 3 * 4 * (1 << 20) // 2
    assert lamport_buffer_numel(1 << 20, 8, torch.float32) == 3 * 8 * (1 << 20) // 4
    assert lamport_buffer_numel(1000, 2, torch.bfloat16) == 3 * 2 * 992 // 2  # whole 16-byte units only


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sentinel_fill_is_negative_zero_everywhere(dtype):
    buffer = torch.randn(1000).to(dtype)
    lamport_sentinel_fill(buffer)
    assert bool((buffer == 0).all()) and bool(torch.signbit(buffer).all())


def test_wrappers_refuse_cpu_tensors():
    x = torch.zeros(8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="lamport_all_reduce: out is on cpu"):
        lamport_all_reduce(
            torch.empty_like(x),
            x,
            torch.zeros(64, dtype=torch.bfloat16),
            (0, 0),
            torch.zeros(LAMPORT_FLAG_WORDS, dtype=torch.int32),
            0,
            16,
            0,
        )
    rows = torch.zeros(1, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="lamport_all_reduce_add_rms_norm: out is on cpu"):
        lamport_all_reduce_add_rms_norm(
            torch.empty_like(rows),
            rows.clone(),
            torch.ones(8, dtype=torch.bfloat16),
            rows,
            torch.zeros(64, dtype=torch.bfloat16),
            (0, 0),
            torch.zeros(LAMPORT_FLAG_WORDS, dtype=torch.int32),
            0,
            16,
            0,
            1e-6,
        )


# ---- the slot protocol as a model ----------------------------------------------------------------


class Deadlock(Exception):
    pass


def _run_model(
    world: int, sizes: list[int], slots: int, threads: int, rng: random.Random, counter_from: int | None = None
) -> None:
    """Every rank runs launches of `sizes[n]` units through its own buffer, as the kernel does:
    each thread pushes its units to every rank, then waits for and reads them, then clears its
    share of the previous launch's slot; a launch ends (the slot advances) when all its threads
    are done. The scheduler runs one enabled step of a random thread of a random rank at a time.
    The device keeps the next launch's slot (csrc/allreduce_kernels.cu); counter_from instead
    keeps a 32-bit launch counter starting there and takes the slots from it as n % slots and
    (n + slots - 1) % slots in uint32 arithmetic (the scheme the slot replaced). Raises
    AssertionError on a read of anything but that launch's value, Deadlock if nothing can run
    while launches remain."""
    empty = None
    # buffers[rank][slot][source][unit]
    buffers = [[[[empty] * max(sizes) for _ in range(world)] for _ in range(slots)] for _ in range(world)]
    launch = [0] * world  # launches done (unbounded: the values' label)
    next_slot = [0] * world
    used = [[0] * slots for _ in range(world)]
    work: list[list[list] | None] = [None] * world

    def plan(rank: int) -> list[list]:
        n = launch[rank]
        if counter_from is None:
            slot = next_slot[rank]
            prev = (slot + slots - 1) % slots
        else:
            n32 = (counter_from + n) % 2**32
            slot, prev = n32 % slots, (n32 + slots - 1) % 2**32 % slots
        units, stale = sizes[n], used[rank][prev] * world
        plans = []
        for t in range(threads):
            steps = [("push", u, p) for u in range(t, units, threads) for p in range(world)]
            rng.shuffle(steps)  # one thread's stores to the peers: any order of arrival
            steps += [("pull", u, p) for u in range(t, units, threads) for p in range(world)]
            steps += [("clear", i // used[rank][prev], i % used[rank][prev]) for i in range(t, stale, threads)]
            plans.append([(kind, a, b, slot, prev) for kind, a, b in steps])
        return plans

    while any(launch[r] < len(sizes) for r in range(world)):
        ready = []
        for rank in range(world):
            if launch[rank] >= len(sizes):
                continue
            if work[rank] is None:
                work[rank] = plan(rank)
            for thread, steps in enumerate(work[rank]):
                if not steps:
                    continue
                kind, a, b, slot, _ = steps[0]
                if kind == "pull" and buffers[rank][slot][b][a] is empty:
                    continue  # spinning
                ready.append((rank, thread))
        if not ready:
            raise Deadlock(f"launches {launch} of {len(sizes)}: every thread waits")
        rank, thread = rng.choice(ready)
        kind, a, b, slot, prev = work[rank][thread].pop(0)
        n = launch[rank]
        if kind == "push":
            buffers[b][slot][rank][a] = (n, rank, a)
        elif kind == "pull":
            got = buffers[rank][slot][b][a]
            assert got == (n, b, a), f"rank {rank} launch {n} read {got} for source {b} unit {a}"
        else:
            buffers[rank][prev][a][b] = empty
        if not any(work[rank]):  # the launch's last step: the slot and the sizes advance
            used[rank][slot], used[rank][prev] = sizes[n], 0
            launch[rank] += 1
            next_slot[rank] = (slot + 1) % slots
            work[rank] = None


@pytest.mark.parametrize("world", [2, 3, 4])
def test_three_slots_never_read_a_stale_value_nor_deadlock(world):
    rng = random.Random(world)
    for _ in range(150):
        sizes = [rng.randint(1, 4) for _ in range(9)]
        _run_model(world, sizes, LAMPORT_SLOTS, threads=rng.randint(1, 3), rng=rng)


def test_two_slots_break_under_some_schedule():
    """The model has teeth: with two slots a fast rank's next push lands in the slot its peer is
    still clearing, and some schedule then loses a value (a deadlock) or reads a stale one."""
    rng = random.Random(0)
    broken = 0
    for _ in range(300):
        sizes = [rng.randint(1, 3) for _ in range(6)]
        try:
            _run_model(2, sizes, 2, threads=rng.randint(1, 2), rng=rng)
        except (AssertionError, Deadlock):
            broken += 1
    assert broken > 0


def test_a_32_bit_launch_counter_breaks_where_it_wraps():
    """Why the device keeps the slot, not the launch count: 2^32 is not a multiple of 3, so a
    uint32 counter that wraps gives launches 2^32 - 1 and 2^32 the same slot, and the model
    finds stale reads or lost values there. Kept as the slot, the same schedules run clean."""
    rng = random.Random(1)
    broken = 0
    for _ in range(120):
        sizes = [rng.randint(1, 3) for _ in range(8)]
        threads = rng.randint(1, 2)
        seed = rng.random()
        try:
            _run_model(2, sizes, LAMPORT_SLOTS, threads, random.Random(seed), counter_from=2**32 - 4)
        except (AssertionError, Deadlock):
            broken += 1
        _run_model(2, sizes, LAMPORT_SLOTS, threads, random.Random(seed))
    assert broken > 0
