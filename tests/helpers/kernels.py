"""The CUDA kernels' test inputs and tolerances: seeded random tensors on the GPU, comparison
against a float64 oracle, and a batch of decode sequences in a shuffled paged cache. Needs CUDA
and cupy: import it after `pytest.importorskip("cupy")`."""

from __future__ import annotations

import torch

from zllm.workers import kernels
from zllm.workers.attention import AttentionMetadata, paged_attention

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["f32", "f16", "bf16"]
TOLERANCE = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-2, atol=2e-2),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
}
DEVICE = "cuda"


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=DEVICE).to(dtype)


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(
        actual.double(), expected.double(), rtol=tol["rtol"] * scale, atol=tol["atol"] * scale, equal_nan=False
    )


class PagedBatch:
    """A batch of decode sequences in a paged cache whose blocks are drawn from a shuffled pool.

    The kernel's cache holds NaN in every slot that is not part of a sequence (the tails of last
    blocks and the spare blocks), and the block tables point past each sequence's blocks at a
    spare block: reading any of it fails the comparison. The reference sees a clean copy."""

    def __init__(self, seq_lens, *, num_heads, kv_heads, head_dim, block_size, dtype, gen, spare_blocks=3):
        self.seq_lens = list(seq_lens)
        self.block_size = block_size
        batch = len(self.seq_lens)
        blocks = [-(-n // block_size) for n in self.seq_lens]
        total = sum(blocks) + spare_blocks
        max_blocks = max(max(blocks), 1) + 2
        pool = torch.randperm(total, generator=gen, device=DEVICE).tolist()
        table = torch.full((batch, max_blocks), pool[0], dtype=torch.int32)  # pool[0] stays spare
        cache = randn(2, total, block_size, kv_heads, head_dim, gen=gen, dtype=dtype)
        valid = torch.zeros(total * block_size, dtype=torch.bool, device=DEVICE)
        for i, n in enumerate(self.seq_lens):
            ids = torch.tensor([pool.pop() for _ in range(blocks[i])], dtype=torch.int32)
            table[i, : len(ids)] = ids
            positions = torch.arange(n)
            valid[(ids.long()[positions // block_size] * block_size + positions % block_size).to(DEVICE)] = True
        valid = valid.view(1, total, block_size, 1, 1)
        self.clean_cache = cache * valid
        self.cache = cache.masked_fill(~valid, float("nan"))
        self.block_tables = table.to(DEVICE)
        self.ref_tables = self.block_tables.long()
        self.seq_lens_t = torch.tensor(self.seq_lens, dtype=torch.int32, device=DEVICE)
        self.query = randn(batch, num_heads, head_dim, gen=gen, dtype=dtype)
        self.scale = head_dim**-0.5

    def reference(self, query: torch.Tensor | None = None, **layer) -> torch.Tensor:
        """The float64 reference; layer: a window and softcap (attention.paged_attention's)."""
        query = self.query if query is None else query
        batch = query.shape[0]
        meta = AttentionMetadata(
            slot_mapping=torch.empty(0, dtype=torch.long, device=DEVICE),
            block_tables=self.ref_tables,
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.long, device=DEVICE),
            seq_lens_list=self.seq_lens,
            query_start_loc=list(range(batch + 1)),
            num_decodes=batch,
            block_size=self.block_size,
        )
        return paged_attention(query.double(), self.clean_cache.double(), meta, self.scale, **layer)

    def run(self, query: torch.Tensor | None = None, out: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        query = self.query if query is None else query
        out = nan_like(query) if out is None else out.fill_(float("nan"))
        return kernels.paged_attention_decode(
            out, query, self.cache, self.block_tables, self.seq_lens_t, self.scale, **kwargs
        )
