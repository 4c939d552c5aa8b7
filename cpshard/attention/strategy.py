"""Which exchange a step's CP attention call uses, from a cost model of the bytes each rank
receives (host arithmetic on the step's plans and the call's head counts: alike on every rank,
decided once per step and head shape, and kept in the step's state).

* ``needed_rows``: the step's K/V exchange (each rank receives the K/V rows its queries reach;
  the halo on contiguous shards). A training step moves them three times (forward, the
  backward's re-exchange, the gradients' return).
* ``heads``: the all-to-alls of q/k/v before attention and of the output after it (head
  parallel, DeepSpeed-Ulysses); the backward gathers q/k/v and the output again with the
  output's gradient (rather than keeping the gathered heads from the forward) and sends the
  gradients back: every rank moves ``(W - 1) / W`` of its q/k/v and output whatever the
  documents.
* ``hierarchical``: ``heads`` inside each node of a 2-D ``(inter, intra)`` CP mesh, then the
  needed-rows exchange between the nodes' ranks that hold the same heads (keeping the gathered
  heads for the backward rather than gathering them again).
* ``auto``: memory first, then bytes. Of the strategies the step planned, those that hold at
  their peak no more than ``heads`` does (the head-parallel bound, below DeepSpeed-Ulysses's,
  which keeps every gathered head: a step that fits under DeepSpeed-Ulysses fits under
  ``auto``), the one with the least cost over a forward and backward: the bytes its busiest
  rank receives plus the bytes it holds at its peak beyond what every strategy holds (the
  output and the gradients of q, k and v), a byte held weighing as much as a byte moved (ties
  go to the first above). So short documents, whose needed rows are few, take
  ``needed_rows``; one long document takes them where their key buffer and its gradient
  (``2 x S x KV heads`` rows of K/V) hold no more than ``heads``' gathered K/V and query head
  with their gradients (``4 x S`` rows), i.e. with at most two K/V heads, else ``heads``.

The memory model (alike on every rank, from the plans): ``needed_rows`` holds the key buffer
of the rank receiving the most rows and its gradient (the per-span loop attends a long span in
tiles, so its own temporaries are a tile's); ``heads`` one K/V head and one query head
gathered over every rank's tokens with their gradients (it gathers a head at a time, again in
the backward); ``hierarchical`` its gathered heads with their gradients (kept from the forward)
and its inner exchange's key buffer and gradient.
"""

from __future__ import annotations

import torch

from cpshard.attention.head_split import split_heads
from cpshard.attention.state import AttentionState, HeadParallel, active_state


def _kv_width(d_k: int, d_v: int) -> int:
    return d_k + d_v


def needed_rows_bytes(state: AttentionState, kv_heads: int, d_k: int, d_v: int, size: int) -> int:
    """The busiest rank's bytes for ``state``'s own exchange (forward and backward)."""
    return state.exchange.most_rows_moved * kv_heads * _kv_width(d_k, d_v) * size


def head_parallel_bytes(
    plan: HeadParallel,
    state: AttentionState,
    window: int | None,
    q_heads: int,
    kv_heads: int,
    d_k: int,
    d_v: int,
    size: int,
) -> int:
    """The busiest rank's bytes under ``plan`` for a call on ``state`` (forward and backward):
    the all-to-alls' (a rank receives its heads of every other rank's tokens: q/k/v in the
    forward, q/k/v, the output and its gradient again in the backward; and the others' heads of
    its own tokens: the output, then the gradients of q/k/v) and the inner exchange's."""
    world = plan.group.world
    split = split_heads(q_heads, kv_heads, world)
    tokens = state.batch_size * state.local_len
    width = _kv_width(d_k, d_v)
    held = [(qc + kc) * width for (_, qc), (_, kc) in zip(split.q, split.kv, strict=True)]
    inner = plan.inner.variant(state.causal, state.mask)
    rows = inner.windowed(window).exchange.most_rows_moved
    again = 2 if inner.exchange.keeps_local else 1  # ``heads`` gathers its heads again
    busiest = max(
        tokens * (again * (world - 1) * held[r] + sum(held) - held[r]) + rows * kc * width
        for r, (_, kc) in enumerate(split.kv)
    )
    return busiest * size


def strategy_bytes(
    state: AttentionState, window: int | None, q_heads: int, kv_heads: int, d_k: int, d_v: int,
    size: int,
) -> dict[str, int]:  # fmt: skip
    """Each strategy the step planned -> its busiest rank's bytes for the call."""
    costs = {"needed_rows": needed_rows_bytes(state.windowed(window), kv_heads, d_k, d_v, size)}
    for plan in state.head_parallel:
        costs[plan.kind] = head_parallel_bytes(
            plan, state, window, q_heads, kv_heads, d_k, d_v, size
        )
    return costs


def _key_buffer(state: AttentionState, kv_heads: int, width: int, size: int) -> int:
    """Bytes of the largest key buffer of ``state``'s exchange and of its gradient (none where
    the exchange keeps this rank's own K/V)."""
    if state.exchange.keeps_local:
        return 0
    rows = state.batch_size * state.local_len + state.exchange.most_rows_received
    return 2 * rows * kv_heads * width * size


def strategy_memory(
    state: AttentionState, window: int | None, q_heads: int, kv_heads: int, d_k: int, d_v: int,
    size: int,
) -> dict[str, int]:  # fmt: skip
    """Each strategy the step planned -> the bytes a call holds at its peak beyond the output
    and the q, k, v gradients (module docstring)."""
    width = _kv_width(d_k, d_v)
    memory = {"needed_rows": _key_buffer(state.windowed(window), kv_heads, width, size)}
    tokens = state.batch_size * state.local_len
    for plan in state.head_parallel:
        world = plan.group.world
        inner = plan.inner.variant(state.causal, state.mask).windowed(window)
        if plan.kind == "heads":
            memory[plan.kind] = 4 * world * tokens * width * size
            continue
        split = split_heads(q_heads, kv_heads, world)
        gathered = max(qc + kc for (_, qc), (_, kc) in zip(split.q, split.kv, strict=True))
        most_kv = max(kc for _, kc in split.kv)
        memory[plan.kind] = (
            2 * world * tokens * gathered * width * size + _key_buffer(inner, most_kv, width, size)
        )
    return memory


def chosen_strategy(
    state: AttentionState, window: int | None, q_heads: int, kv_heads: int, d_k: int, d_v: int,
    size: int,
) -> str:  # fmt: skip
    """The strategy a call uses (``auto``: of those holding no more than ``heads``, the least
    bytes moved plus held; decided once per step and shape)."""
    if state.strategy != "auto":
        return state.strategy
    key = ("strategy", window, q_heads, kv_heads, d_k, d_v, size)
    found = state.derived.get(key)
    if found is None:
        costs = strategy_bytes(state, window, q_heads, kv_heads, d_k, d_v, size)
        held = strategy_memory(state, window, q_heads, kv_heads, d_k, d_v, size)
        found = state.derived[key] = auto_choice(costs, held)
    return found


def auto_choice(costs: dict[str, int], held: dict[str, int]) -> str:
    """``auto``'s pick from each planned strategy's bytes moved (``costs``) and held (``held``):
    of those holding no more than ``heads`` (where planned), the least of the two summed; ties
    go to the first."""
    bound = held.get("heads")
    fits = [s for s in costs if bound is None or held[s] <= bound]
    return min(fits, key=lambda s: costs[s] + held[s])


def route(
    state: AttentionState, window: int | None, q_heads: int, kv_heads: int, d_k: int, d_v: int,
    size: int,
) -> HeadParallel | None:  # fmt: skip
    """The head-parallel plan a call uses, or None for the state's own exchange. ``heads`` and
    ``hierarchical`` plan only their own (``hierarchical`` on a one-node mesh: the all-to-all
    over the node, then nothing exchanged between nodes)."""
    if state.strategy != "auto":
        return next(iter(state.head_parallel), None)
    if torch.compiler.is_compiling() and state.mask is None:
        name = _first_choice(state.causal, window, q_heads, kv_heads, d_k, d_v, size)
    else:
        name = chosen_strategy(state, window, q_heads, kv_heads, d_k, d_v, size)
    return next((plan for plan in state.head_parallel if plan.kind == name), None)


@torch.compiler.assume_constant_result
def _first_choice(
    causal: bool, window: int | None, q_heads: int, kv_heads: int, d_k: int, d_v: int, size: int
) -> str:
    """``auto``'s choice as a constant of a traced graph (the active step's, at trace time): a
    compiled layer keeps it rather than recompiling whenever a step's documents change the
    cheapest strategy (every strategy is exact, and every step of a sharder plans the same
    ones). Outside a context (a checkpoint recompute): the step's own exchange."""
    state = active_state()
    if state is None:
        return "needed_rows"
    state = state if causal else state.bidirectional()
    return chosen_strategy(state, window, q_heads, kv_heads, d_k, d_v, size)
