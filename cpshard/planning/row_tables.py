"""What the needed-rows plans' row tables share: received ranges turned into buffer rows, and
the exchange a layout's closed form plans (its counts now, its row tables when first read)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from cpshard.ranges import ragged_arange


class BufferRows(Protocol):
    """Where a rank's needed positions sit in its key buffer."""

    width: int

    def buffer_row(self, row: torch.Tensor, position: torch.Tensor) -> torch.Tensor: ...


def received_rows(
    first: torch.Tensor, count: torch.Tensor, source: torch.Tensor, row: torch.Tensor,
    base: torch.Tensor, width: int,
    position: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:  # fmt: skip
    """The flattened buffer rows of received ranges, back to back: per range, ``count`` local
    slots of rank ``source`` from ``first`` on, in batch row ``row``, at buffer row ``base`` +
    their global ``position(source, row, slot)``."""
    slot = ragged_arange(first, count)
    src, row, base = (torch.repeat_interleave(t, count) for t in (source, row, base))
    return row * width + base + position(src, row, slot)


@dataclass(frozen=True)
class ClosedExchange:
    """Rank ``rank``'s needed-rows exchange without a window planned by a layout's closed form
    (its runs ``table``): rows every rank receives from and sends to the others
    (``received``, ``sent``, ``[W]``), what this rank receives from and sends to each
    (``recv_counts``, ``send_counts``, its own included), its key intervals ``mine`` (row,
    start, end: one per document it holds, in row and position order; adjacent ones not
    merged) and the class of its row tables, made from the table when first read."""

    row_tables: Callable[..., Any]
    table: Any
    rank: int
    causal: bool
    received: torch.Tensor
    sent: torch.Tensor
    recv_counts: torch.Tensor
    send_counts: torch.Tensor
    mine: tuple[torch.Tensor, torch.Tensor, torch.Tensor]

    def tables(self, rows: BufferRows) -> Any:
        """The row tables of this exchange into the key buffer ``rows`` (``base``: each held
        document's first buffer row less its start)."""
        row, start, _ = self.mine
        base = rows.buffer_row(row, start) - start
        return self.row_tables(self.table, self.rank, self.causal, rows.width, base)
