"""Fingerprints: small integers every rank derives alike from what it was given, so that ranks
can compare arguments (the consensus fields) and tag transfers (a message only matches a receive
with the same fingerprint) without exchanging the arguments themselves. The one place that
builds them."""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Sequence

import torch

_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]


def dtype_code(dtype: torch.dtype) -> int:
    """A small integer that names dtype identically on every rank (and in every process)."""
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES) + zlib.crc32(str(dtype).encode()) % 1000


def device_code(t: torch.Tensor) -> int:
    """The tensor's device type as a consensus value: 0 on the CPU, 1 on an accelerator."""
    return 0 if t.device.type == "cpu" else 1


_FNV_PRIME = 1099511628211
_MASK = (1 << 64) - 1


def fingerprint(values: Sequence[int]) -> int:
    """A 63-bit FNV-1a style fingerprint of a sequence of ints, equal in every process for equal
    values (plain integer arithmetic, so ``torch.compile`` folds it into a constant)."""
    h = 14695981039346656037
    for v in values:
        h = ((h ^ (int(v) & _MASK)) * _FNV_PRIME) & _MASK
    return h >> 1


def digest(values: Sequence[int] | torch.Tensor | None) -> list[int]:
    """A consensus field for a list of ints or an integer tensor (any device; ``None`` allowed):
    62 bits of a hash and the length, equal on every rank iff the values are (w.h.p.)."""
    if values is None:
        return [0, 0]
    if isinstance(values, torch.Tensor):  # hashed in place (SHA-256 has CPU instructions)
        data = values.detach().to("cpu", torch.int64).contiguous().numpy()
        n = values.numel()
    else:
        data = repr([int(v) for v in values]).encode()
        n = len(values)
    h = hashlib.sha256(data).digest()[:8]
    return [int.from_bytes(h, "little") >> 2, n]


# The kinds of call a fingerprint names (a gather and a halo exchange never match each other).
GATHER, HALO, EXCHANGE, HEADS = 1, 2, 3, 4


def call_key(
    kind: int,
    dtype: torch.dtype,
    shape: Sequence[int],
    dim: int,
    backward: bool,
    token_dim_varies: bool,
    values: Sequence[int],
) -> int:
    """The fingerprint of what every rank must pass alike (see ``TorchTransport.send_recv``):
    the kind of call, dtype, token dim, shape (the token dim aside where it may vary), whether a
    backward will follow, and ``values`` (counts or halo sizes)."""
    sizes = [-1 if token_dim_varies and i == dim else int(s) for i, s in enumerate(shape)]
    return fingerprint([kind, dtype_code(dtype), dim, int(backward), len(sizes), *sizes, *values])


def tensor_call_key(
    kind: int, x: torch.Tensor, dim: int, token_dim_varies: bool, values: Sequence[int]
) -> int:
    """:func:`call_key` of a call on ``x`` (a backward follows when ``x`` requires grad)."""
    backward = x.requires_grad and torch.is_grad_enabled()
    return call_key(kind, x.dtype, x.shape, dim, backward, token_dim_varies, values)
