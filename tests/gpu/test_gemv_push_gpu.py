"""The GEMV that pushes its rows into the Lamport buffers (csrc/gemv_kernels.cu's _push builds) and
the sum after it (allreduce_kernels.cu `lamport_sum_pushed`), ZLLM_GEMV_PUSH, on one GPU: a world
of 2, 4 or 8 "ranks" whose buffers all live on this device (the protocol only needs addresses).
Each rank's product is the b6 GEMV's (gemv_add on the first rank, with the residual and bias);
the sum must be their rank-order fp32 sum rounded once, bit for bit on every rank, over launches
of changing sizes (every slot reused and cleared by its own last size), mixed with the plain
Lamport all-reduce on the same slots, and in CUDA-graph replays. The engine at tp 2 with the
push on and off: tests/gpu/test_tensor_parallel_gpu.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu]

SLOT_BYTES = 1 << 20
# (n, k): the 70B tp 4 rank's o and down, 70B's down at tp 8, Llama-3-8B's o at tp 2, small ones;
# splits 1, 2 and 4.
SHAPES = [(8192, 2048), (8192, 7168), (8192, 3584), (4096, 2048), (1024, 512), (64, 256)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


class World:
    """W ranks' Lamport state on one device: buffers filled with the "empty" mark, flags at 0."""

    def __init__(self, size: int) -> None:
        from zllm.workers.kernels.allreduce import LAMPORT_FLAG_WORDS, lamport_buffer_numel, lamport_sentinel_fill

        self.size = size
        numel = lamport_buffer_numel(SLOT_BYTES, size, torch.bfloat16)
        self.buffers = [torch.empty(numel, dtype=torch.bfloat16, device="cuda") for _ in range(size)]
        for b in self.buffers:
            lamport_sentinel_fill(b)
        self.peers = tuple(b.data_ptr() for b in self.buffers)
        self.flags = [torch.zeros(LAMPORT_FLAG_WORDS, dtype=torch.int32, device="cuda") for _ in range(size)]
        self.launches = 0  # Lamport launches every rank has made
        self.last_n = 0  # the elements of the last one

    def launched(self, n: int) -> None:
        """After every rank's launch of n elements: the slot of the launch before is back to the
        "empty" mark in every rank's buffer, every source, over that launch's size."""
        if self.launches > 0:
            prev = (self.launches - 1) % 3
            for rank, b in enumerate(self.buffers):
                used = b.view(3, self.size, -1)[prev, :, : self.last_n].view(torch.int16)
                assert bool((used == -(1 << 15)).all()), f"rank {rank}: slot {prev} not cleared"
        self.launches += 1
        self.last_n = n

    def push(self, rank, x, w, bias, add) -> None:
        from zllm.workers.kernels.matvec import gemv_push

        gemv_push(x, w, bias, add, self.buffers[rank], self.peers, self.flags[rank], rank, SLOT_BYTES)

    def sum(self, rank: int, n: int) -> torch.Tensor:
        from zllm.workers.kernels.allreduce import lamport_sum_pushed

        out = torch.empty((1, n), dtype=torch.bfloat16, device="cuda")
        return lamport_sum_pushed(out, self.buffers[rank], self.peers, self.flags[rank], rank, SLOT_BYTES, int(30e9))

    def all_reduce(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        from zllm.workers.kernels.allreduce import lamport_all_reduce

        out = torch.empty_like(x)
        return lamport_all_reduce(out, x, self.buffers[rank], self.peers, self.flags[rank], rank, SLOT_BYTES, int(30e9))


def _operands(n: int, k: int, size: int, gen: torch.Generator):
    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    xs = [draw(1, k) for _ in range(size)]
    ws = [draw(n, k, scale=k**-0.5) for _ in range(size)]
    return xs, ws, draw(n), draw(1, n)


def _products(xs, ws, bias, add) -> list[torch.Tensor]:
    """What each rank's usual step stores before its all-reduce: the b6 GEMV (gemv_add on the first rank)."""
    from zllm.workers.kernels.matvec import gemv, gemv_add

    outs = []
    for rank, (x, w) in enumerate(zip(xs, ws)):
        out = torch.empty((1, w.shape[0]), dtype=torch.bfloat16, device="cuda")
        outs.append(gemv_add(out, x, w, bias, add) if rank == 0 else gemv(out, x, w, None, "b6"))
    return outs


def _rank_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    total = parts[0].float()
    for p in parts[1:]:
        total = total + p.float()
    return total.to(torch.bfloat16)


@pytest.mark.parametrize("size", [2, 4, 8])
def test_pushed_sum_is_the_rank_order_sum_of_the_products_bit_for_bit(size, gen):
    world = World(size)
    for n, k in SHAPES + SHAPES[::-1]:  # growing and shrinking: each slot cleared by its last size
        xs, ws, bias, add = _operands(n, k, size, gen)
        for rank in range(size):
            world.push(rank, xs[rank], ws[rank], bias if rank == 0 else None, add if rank == 0 else None)
        sums = [world.sum(rank, n) for rank in range(size)]
        world.launched(n)
        expected = _rank_order_sum(_products(xs, ws, bias, add))
        for rank, got in enumerate(sums):
            assert torch.equal(_bits(got), _bits(expected)), f"rank {rank}, ({n}, {k}): not the rank-order sum"
        exact = add.double() + bias.double() + sum((x.double() @ w.double().T) for x, w in zip(xs, ws))
        torch.testing.assert_close(sums[0].double(), exact, rtol=2**-6, atol=2**-4)


def test_pushed_sums_and_plain_lamport_all_reduces_share_the_slots(gen):
    """Either form is one Lamport launch a slot: interleaved, and one rank pushing while the other
    all-reduces a stored product, every sum is still the rank-order sum."""
    world = World(2)
    for i, (n, k) in enumerate(SHAPES * 2):
        xs, ws, bias, add = _operands(n, k, 2, gen)
        products = _products(xs, ws, bias, add)
        expected = _rank_order_sum(products)
        pushing = [(i + rank) % 3 != 0 for rank in range(2)]  # both, one, or the other, in turn
        # One stream runs every "rank": each launch that waits for a value comes after its push
        # (the pushes, then the all-reduce, which pushes before it waits, then the sums).
        for rank in range(2):
            if pushing[rank]:
                world.push(rank, xs[rank], ws[rank], bias if rank == 0 else None, add if rank == 0 else None)
        sums = {rank: world.all_reduce(rank, products[rank]) for rank in range(2) if not pushing[rank]}
        sums.update({rank: world.sum(rank, n) for rank in range(2) if pushing[rank]})
        world.launched(n)
        for rank, got in sums.items():
            assert torch.equal(_bits(got), _bits(expected)), f"launch {i}, rank {rank} ({pushing})"


def test_pushed_sums_replay_in_a_cuda_graph(gen):
    """A decode-like chain (push, sum, the next push reading the sum) captured once and replayed
    with new inputs: each replay's sums are the rank-order sums of that replay's products."""
    n = k = 2048
    size = 4
    world = World(size)
    xs, ws, bias, add = _operands(n, k, size, gen)
    ws2 = [w.clone() for w in _operands(n, k, size, gen)[1]]

    def chain():
        for rank in range(size):
            world.push(rank, xs[rank], ws[rank], bias if rank == 0 else None, add if rank == 0 else None)
        first = [world.sum(rank, n) for rank in range(size)]
        for rank in range(size):  # the next layer's input: this sum
            world.push(rank, first[rank], ws2[rank], None, first[rank] if rank == 0 else None)
        return first, [world.sum(rank, n) for rank in range(size)]

    chain()  # warm-up: kernels loaded, slots moving
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        first, second = chain()
    for replay in range(5):
        fresh = _operands(n, k, size, gen)
        for dst, src in zip(xs, fresh[0]):
            dst.copy_(src)
        add.copy_(fresh[3])
        graph.replay()
        torch.cuda.synchronize()
        expected_first = _rank_order_sum(_products(xs, ws, bias, add))
        expected_second = _rank_order_sum(_products(first, ws2, None, first[0]))
        for rank in range(size):
            assert torch.equal(_bits(first[rank]), _bits(expected_first)), f"replay {replay}, rank {rank}: first"
            assert torch.equal(_bits(second[rank]), _bits(expected_second)), f"replay {replay}, rank {rank}: second"


def test_gemv_push_refuses_what_it_does_not_take():
    from zllm.workers.kernels.matvec import gemv_push

    world = World(2)
    x = torch.randn(1, 256, device="cuda").to(torch.bfloat16)
    w = torch.randn(64, 256, device="cuda").to(torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        world.push(0, x.half(), w.half(), None, None)
    with pytest.raises(ValueError, match="Lamport slot"):  # 64 rows are 128 bytes
        gemv_push(x, w, None, None, world.buffers[0], world.peers, world.flags[0], 0, 64)
    with pytest.raises(ValueError, match="add must be"):
        world.push(0, x, w, None, torch.zeros(1, 32, dtype=torch.bfloat16, device="cuda"))
