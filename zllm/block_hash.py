"""Chained hashes of full KV blocks: the keys of the prefix cache.

    block 0: H(salt, adapter, tokens[0:16])   block 1: H(hash 0, tokens[16:32])   block 2: H(hash 1, ...)

A block's hash covers every token before it (through its parent), the request's cache salt and
LoRA adapter (through block 0), and the hashes of the images whose placeholder tokens it holds
(their tokens are all one placeholder id, so the ids alone would let different images share
blocks). Two requests share a block only when their whole prefixes up to it are equal and their
salts, adapters and images match. SHA-256 makes a collision, accidental or crafted by one tenant
to read another's prefix, impractical; the cost is ~1 µs per block of 16 tokens.
"""

from __future__ import annotations

import hashlib
from array import array

BlockHash = bytes

_FIRST = b"\x00"
_CHAINED = b"\x01"
_FIRST_ADAPTER = b"\x02"
_IMAGES = b"\x02"  # after the token ids: the images the block holds

# An image's placeholder tokens in a prompt: (first token, token count, the image's hash).
ImageSpan = tuple[int, int, str]


def hash_block(
    parent: BlockHash | None, token_ids: list[int], salt: str | None = None, extra: bytes = b"", lora_id: int = 0
) -> BlockHash:
    """extra: the images the block holds (_images_in); lora_id: the adapter that computed the
    block's K/V (0: the base model): an adapter's blocks are shared only with requests of the
    same adapter."""
    digest = hashlib.sha256()
    if parent is None:
        # Domain-separated and length-prefixed, so no salt can make block 0 alias a chained block;
        # a block 0 of an adapter has its own domain byte and the adapter id.
        salt_bytes = (salt or "").encode()
        first = _FIRST if lora_id == 0 else _FIRST_ADAPTER + lora_id.to_bytes(8, "little")
        digest.update(first + len(salt_bytes).to_bytes(8, "little") + salt_bytes)
    else:
        digest.update(_CHAINED + parent)
    digest.update(array("q", token_ids).tobytes())
    if extra:
        digest.update(_IMAGES + extra)
    return digest.digest()


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: list[int],
    block_size: int,
    salt: str | None,
    images: list[ImageSpan] | tuple = (),
    lora_id: int = 0,
) -> None:
    """Append the hashes of the blocks of `token_ids` that became full since `hashes` was last extended."""
    for index in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        start, end = index * block_size, (index + 1) * block_size
        hashes.append(hash_block(parent, token_ids[start:end], salt, _images_in(images, start, end), lora_id))


def _images_in(images: list[ImageSpan] | tuple, start: int, end: int) -> bytes:
    """The hashes (and offsets) of the images with tokens in [start, end)."""
    return b"".join(
        f"{offset}:{mm_hash};".encode()
        for offset, length, mm_hash in images
        if offset < end and offset + length > start
    )
