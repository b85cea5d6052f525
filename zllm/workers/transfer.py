"""Host-to-device copies that never wait for the device.

A copy from pageable host memory makes torch synchronize the stream: the host would stall until
every step queued ahead had run, which defeats async scheduling. Staging through pinned memory
(torch's caching host allocator, which keeps a block until the copies reading it are done)
lets the copy queue behind the device work like a kernel.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(
    values: torch.Tensor | np.ndarray | list, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`values` (a CPU tensor, an array or a list of numbers) on `device`, without a host sync."""
    if isinstance(values, torch.Tensor):
        tensor = values if dtype is None else values.to(dtype)
    elif isinstance(values, np.ndarray):
        tensor = torch.from_numpy(values) if dtype is None else torch.from_numpy(values).to(dtype)
    else:
        tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
