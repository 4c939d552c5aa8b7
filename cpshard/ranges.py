"""Integer ranges back to back: the index tensor every ragged gather of the planners and the
kernels' packing is made from (host or device, one pass, no loop over the ranges)."""

from __future__ import annotations

import torch


def ragged_arange(first: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[first[i], first[i] + lengths[i])`` for every ``i``, back to back (int64 vectors of one
    length; lengths >= 0)."""
    total = int(lengths.sum())
    offsets = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(first - offsets, lengths, output_size=total) + torch.arange(
        total, device=first.device
    )
