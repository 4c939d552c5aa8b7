"""A causal depthwise convolution over the sequence (Gated DeltaNet's and Mamba's short conv)
under CP: each token sees the ``kernel - 1`` tokens before it in its own document, wherever they
are, and nothing across a document start.

The preceding tokens come through the step's causal attention exchange for a sliding window of
``kernel`` keys (:meth:`~cpshard.attention.state.AttentionState.windowed`): every rank receives
at most ``kernel - 1`` rows before each of its runs (the halo of contiguous shards, the
needed-rows all-to-all of the others), and the exchange's backward returns each row's gradient
to its owner. The taps of every local token are then one index table (host, once per step and
kernel size): token ``t``'s tap ``j`` reads the buffer row ``kernel - 1 - j`` places before it,
or nothing before its document's start.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpshard.attention.state import AttentionState
from cpshard.guard.reach import note_cpshard_mixing


def _taps(state: AttentionState, kernel: int, device: torch.device) -> torch.Tensor:
    """``[K, B * L]``: for tap ``j`` (weight ``j``, ``x[t - K + 1 + j]``) of every local token,
    the flat row of the ``kernel``-window key buffer it reads, or the zero row ``B * key_len``."""
    windowed = state.windowed(kernel)
    key = ("conv taps", kernel, device)
    taps = windowed.derived.get(key)
    if taps is None:
        b, local, key_len = windowed.batch_size, windowed.local_len, windowed.exchange.key_len
        table = torch.full((kernel, b * local), b * key_len, dtype=torch.int64)
        for span in windowed.spans:
            i = torch.arange(span.n)
            own = span.split + i  # the buffer row of each query's own token
            for j in range(kernel):
                src = own - (kernel - 1 - j)
                ok = src >= span.k
                table[j, span.row * local + span.q + i[ok]] = span.row * key_len + src[ok]
        taps = windowed.derived[key] = table.to(device)
    return taps


def cp_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state: AttentionState,
    activation: str | None = None,
) -> torch.Tensor:
    """``x`` ``[B, L, C]`` (this rank's shard) convolved causally per document over the CP
    group: ``y[t] = bias + sum_j weight[:, j] * x[t - K + 1 + j]`` over taps in ``t``'s document,
    then ``activation`` (``"silu"``/``"swish"`` or None). ``weight`` ``[C, K]``. Collective over
    the state's group (the window exchange) when ``K > 1``."""
    note_cpshard_mixing()
    where = f"cpshard CP convolution: rank {state.group.rank}"
    if x.dim() != 3 or tuple(x.shape[:2]) != (state.batch_size, state.local_len):
        raise ValueError(
            f"{where}: x must be [B, L, channels] with [B, L] = [{state.batch_size}, "
            f"{state.local_len}] (this rank's shard), got {tuple(x.shape)}"
        )
    b, local, channels = x.shape
    if weight.dim() != 2 or weight.shape[0] != channels:
        raise ValueError(
            f"{where}: weight must be [{channels}, kernel] (one filter per channel of x), got "
            f"{tuple(weight.shape)}"
        )
    kernel = weight.shape[-1]
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"{where}: activation {activation!r} is not supported")
    windowed = state.windowed(kernel)
    buffer = windowed.extend(x.unsqueeze(1)).squeeze(1)  # [B, key_len, C]
    flat = torch.cat([buffer.reshape(-1, channels), buffer.new_zeros(1, channels)])
    taps = _taps(state, kernel, x.device)
    w = weight.to(x.dtype)
    y = flat.index_select(0, taps[0]) * w[:, 0]
    for j in range(1, kernel):
        y = y + flat.index_select(0, taps[j]) * w[:, j]
    if bias is not None:
        y = y + bias.to(x.dtype)
    y = y.view(b, local, channels)
    return F.silu(y) if activation is not None else y
