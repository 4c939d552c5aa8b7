"""A FlexAttention-style ``mask_mod`` under CP: its exchange and its mask on this rank's key
buffer, planned on the host once per (step, ``mask_mod`` object, query heads, documents flag).

``mask_mod(b, h, q_idx, kv_idx)`` is evaluated over the step's rows (global positions, up to
the last document token: never over the layout's trailing padding), a band of queries at a
time (:func:`~cpshard.masks.evaluate_mask_mod`), combined with the documents (a query sees
only its own document's keys) unless ``documents`` is False.
Padding (document id 0: interior padding, the layout's trailing padding) is never a query nor a
key. From it, every rank's reach: the keys some query of that rank sees, plus its own tokens
(copied locally, never sent); maximal runs of them are the intervals the needed-rows exchange
moves (:func:`~cpshard.planning.plan_needed_intervals`), so the rows a rank receives are
exactly the keys of other ranks its queries see. The buffer holds those rows in global order
per batch row, and this rank's boolean mask ``[B, 1 or H, L, buffer]`` (per head only when the
function depends on ``h``) says which of them each query sees: placed on a device once, it
drives the masked attention of the buffer (:func:`~cpshard.attention.plain.visible_attention`;
autograd carries the backward, the exchange's adjoint returning the K/V gradients).

Cost: O(B·H·P²) host evaluation per plan (every rank evaluates every query, to know what the
others need), and a mask of B·H·L·buffer booleans: meant for moderate lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cpshard.attention.needed_rows import NeededRowsExchange
from cpshard.attention.placement import cached_on, pinned
from cpshard.attention.plain import visible_attention
from cpshard.attention.state import AttentionState
from cpshard.masks import MaskMod, band_rows, evaluate_mask_mod
from cpshard.planning import plan_needed_intervals


@dataclass(frozen=True)
class MaskModState:
    """A ``mask_mod``'s plan for one step on this rank: ``carrier``, the state whose registry
    key names its needed-rows exchange to the exchange's custom ops (it has no spans), and
    ``visible`` ``[B, 1 or H, L, buffer]`` (host bool): the buffer rows each query sees.
    ``mask_mod`` is kept: the step's cache is keyed by its identity."""

    mask_mod: MaskMod = field(repr=False)
    carrier: AttentionState
    visible: torch.Tensor
    _on: dict[torch.device, torch.Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def visible_on(self, device: torch.device) -> torch.Tensor:
        """:attr:`visible` on ``device``, copied there once per device and cached."""
        return cached_on(self._on, device, self.visible)

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float | None,
        enable_gqa: bool,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """This rank's queries ``[B, H, L, D]`` over the buffer the exchange builds from its
        ``key`` and ``value`` (exact forward and backward; a query that sees no key: zeros)."""
        d_k = key.shape[-1]
        buffer = self.carrier.extend(torch.cat([key, value], dim=-1))
        visible = self.visible_on(query.device)
        return visible_attention(
            query, buffer[..., :d_k], buffer[..., d_k:], visible, 0.0, scale, enable_gqa,
            softcap, sinks,
        )  # fmt: skip


def mask_mod_state(
    step: AttentionState, mask_mod: MaskMod, heads: int, documents: bool
) -> MaskModState:
    """The :class:`MaskModState` of ``mask_mod`` for the step ``step`` (its causal state) and
    ``heads`` query heads, planned on first use and kept for the step. Raises ``ValueError``
    for a function that does not return a bool tensor of the broadcast shape."""
    cache = (MaskModState, id(mask_mod), heads, documents)
    found = step.derived.get(cache)
    if found is None:
        found = step.derived[cache] = _plan(step, mask_mod, heads, documents)
    assert isinstance(found, MaskModState)
    return found


def _owners(step: AttentionState) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, P]`` each position's rank (``W`` for padding: no query) and local index."""
    runs, doc = step.runs, step.documents
    assert runs is not None and doc is not None, "a step state has its runs and documents"
    positions = runs.positions  # [W, B, L]
    world, rows, local = positions.shape
    rank = torch.arange(world).view(world, 1, 1).expand_as(positions)
    row = torch.arange(rows).view(1, rows, 1).expand_as(positions)
    owner = torch.full(doc.shape, world, dtype=torch.int64)
    slot = torch.zeros(doc.shape, dtype=torch.int64)
    owner[row, positions] = rank
    slot[row, positions] = torch.arange(local).expand_as(positions)
    return torch.where(doc != 0, owner, world), slot


def _intervals(need: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Maximal runs of ``need`` ``[W, B, P]``: (rank, row, lo, hi), sorted."""
    flat = torch.nn.functional.pad(need, (1, 1), value=False).to(torch.int8)
    step = flat[..., 1:] - flat[..., :-1]  # +1 where a run starts, -1 one past where it ends
    starts, ends = torch.nonzero(step == 1), torch.nonzero(step == -1)
    return starts[:, 0], starts[:, 1], starts[:, 2], ends[:, 2]


def _plan(step: AttentionState, mask_mod: MaskMod, heads: int, documents: bool) -> MaskModState:
    """:func:`mask_mod_state`'s planning (module doc)."""
    doc, runs, group = step.documents, step.runs, step.group
    assert runs is not None and doc is not None, "a step state has its runs and documents"
    rows, padded = doc.shape
    world, rank, local = group.world, group.rank, step.local_len
    owner, slot = _owners(step)
    valid = doc != 0
    # per row: how many queries of each rank (and of the padding, W) see each key
    reached = torch.zeros(rows, world + 1, padded, dtype=torch.int32)
    mine = torch.zeros(rows, 1, local, padded, dtype=torch.bool)  # this rank's queries' keys
    reach = 0
    # positions up to the last document token: the function never sees the layout's padding
    n = int(torch.nonzero(valid.any(0)).max()) + 1 if bool(valid.any()) else 0
    for q in torch.arange(n).split(band_rows(rows, heads, n)):
        seen = evaluate_mask_mod(mask_mod, rows, n, q, doc[:, :n] if documents else None, heads)
        seen = seen & (valid[:, None, q, None] & valid[:, None, None, :n])
        if seen.shape[1] > mine.shape[1]:  # the mask depends on the head
            mine = mine.expand(rows, heads, local, padded).clone()
        reach = max(reach, int(seen.sum(-1).max()) if seen.numel() else 0)
        any_head = seen.any(1)
        for b in range(rows):
            reached[b, :, :n].index_add_(0, owner[b, q], any_head[b].to(torch.int32))
            at = torch.nonzero(owner[b, q] == rank).flatten()
            mine[b, :, slot[b, q[at]], :n] = seen[b, :, at]
    own = owner[:, None, :] == torch.arange(world)[None, :, None]  # [B, W, P]
    need = ((reached[:, :world] > 0) | own).transpose(0, 1).contiguous()  # [W, B, P]
    plan = plan_needed_intervals(rank, runs, _intervals(need), reach)
    visible = torch.zeros(rows, mine.shape[1], local, plan.buffer_len, dtype=torch.bool)
    for b in range(rows):  # the buffer holds the row's needed positions in global order
        keys = torch.nonzero(need[rank, b]).flatten()
        visible[b, :, :, : keys.numel()] = mine[b][..., keys]
    carrier = AttentionState(
        group=group,
        layout=step.layout,
        local_len=local,
        batch_size=rows,
        reach=reach,
        causal=False,
        span_table=plan.spans,
        exchange=NeededRowsExchange.from_plan(group, plan),
        documents=doc,
        shard_layout=step.shard_layout,
        runs=runs,
    )
    return MaskModState(mask_mod, carrier, pinned(visible))
