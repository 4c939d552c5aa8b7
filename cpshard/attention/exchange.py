"""The layout state's K/V exchange as ``torch.library`` custom ops keyed by the step state's key.

* ``cpshard::layout_exchange(kv, key)``: this rank's K/V ``[B, H, L, D]`` -> its key buffer
  ``[B, H, N, D]`` (the rows its queries reach, per batch row in global order, zeros after a
  row's last one): the rows each rank needs are picked, moved by one ``all_to_all_v`` (this
  rank's own rows copied), and placed. ``N`` is the step's data (an unbacked size under compile).
* ``cpshard::layout_exchange_return(grad, key, length)``: its adjoint, the reverse exchange; a
  row sent to several ranks gets their gradients added.
"""

from __future__ import annotations

import torch

from cpshard.attention.state import LayoutState
from cpshard.blockdiag.attention import register_exchange_autograd
from cpshard.blockdiag.state import state_for
from cpshard.comm.collectives import all_to_all_v
from cpshard.transport import EXCHANGE, call_key


def _layout(key: torch.Tensor) -> LayoutState:
    state = state_for(key)
    assert isinstance(state, LayoutState)
    return state


def _tokens(t: torch.Tensor) -> torch.Tensor:
    """``[B, H, N, D]`` -> token-major rows ``[B * N, H * D]``."""
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b * n, h * d)


def _heads(rows: torch.Tensor, b: int, h: int) -> torch.Tensor:
    """Adjoint view of :func:`_tokens`: ``[B * N, H * D]`` -> ``[B, H, N, D]`` (contiguous)."""
    return rows.view(b, -1, h, rows.shape[1] // h).transpose(1, 2).contiguous()


def _move(state: LayoutState, rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
    """``rows`` ``[sum send, width]`` (grouped by destination) -> ``[sum recv, width]``."""
    if state.group.world == 1:
        return rows
    width = rows.shape[1]
    # the same fingerprint on every rank and in both directions: the step's counts and the row
    key = call_key(EXCHANGE, rows.dtype, (width,), 0, True, False, state.exchange_plan)
    got = all_to_all_v(
        rows.reshape(-1),
        state.group.name,
        [c * width for c in send],
        [c * width for c in recv],
        key,
    )
    return got.view(-1, width)


@torch.library.custom_op("cpshard::layout_exchange", mutates_args=())
def layout_exchange(kv: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``kv`` ``[B, H, L, D]`` -> this rank's key buffer ``[B, H, key_len, D]``."""
    state = _layout(key)
    t = state.tables_on(kv.device)
    b, h = kv.shape[:2]
    rows = _tokens(kv).index_select(0, t.send_rows)
    got = _move(state, rows, state.send_counts, state.recv_counts)
    buf = got.new_zeros(b * state.key_len, got.shape[1]).index_copy_(0, t.recv_rows, got)
    return _heads(buf, b, h)


@layout_exchange.register_fake
def _layout_exchange_fake(kv: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    buffer = torch.library.get_ctx().new_dynamic_size()  # the step's data
    return kv.new_empty(kv.shape[0], kv.shape[1], buffer, kv.shape[3])


@torch.library.custom_op("cpshard::layout_exchange_return", mutates_args=())
def layout_exchange_return(grad: torch.Tensor, key: torch.Tensor, length: int) -> torch.Tensor:
    """Adjoint of :func:`layout_exchange`: ``[B, H, length, D]``, every sent row's gradients
    added by its owner."""
    state = _layout(key)
    t = state.tables_on(grad.device)
    b, h = grad.shape[:2]
    rows = _tokens(grad).index_select(0, t.recv_rows)
    back = _move(state, rows, state.recv_counts, state.send_counts)
    out = back.new_zeros(b * length, back.shape[1]).index_add_(0, t.send_rows, back)
    return _heads(out, b, h)


@layout_exchange_return.register_fake
def _layout_exchange_return_fake(
    grad: torch.Tensor, key: torch.Tensor, length: int
) -> torch.Tensor:
    return grad.new_empty(grad.shape[0], grad.shape[1], length, grad.shape[3])


register_exchange_autograd(layout_exchange, layout_exchange_return)
