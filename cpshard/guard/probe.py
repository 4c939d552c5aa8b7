"""Whether a module call mixes the tokens of its sequence, found by running it again.

The call is re-run (no gradient, the same random state for every run, so dropout masks agree)
with one token's row of one input changed — the first token, then the last, along dim 1, the
sequence dimension of the ``[B, L, ...]`` hidden states, token ids and positions models pass
between their modules (only tensors that begin with the step's ``[B, L]`` are read) — and it
mixes tokens when an output row of ANOTHER token changes. This
is what attention, linear attention, recurrences and convolutions over time do, whatever their
class is called and however they are written (an SDPA call, a softmax of ``q @ k``, a scan);
per-token layers (projections, norms, MLPs, rotary tables) do not.

Not seen: a call whose inputs and outputs have no dim 1 of the local sequence length (a layer
handed ``[B, C, L]`` or ``[B, H, L, D]`` tensors is judged by the module that calls it), and
mixing a row change cannot reveal (tokens mixed only when some data-dependent condition holds).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

Tokens = tuple[int, int]  # (batch rows, tokens per row): the [B, L] a tensor must begin with


def _candidates(args: tuple[Any, ...], kwargs: dict[str, Any], tokens: Tokens) -> Iterator[int | str]:
    """The positions (ints) and keywords of the inputs with a sequence dimension."""
    for where, value in (*enumerate(args), *kwargs.items()):
        if _is_sequence(value, tokens) and value.dtype != torch.bool:
            yield where


def _is_sequence(value: Any, tokens: Tokens) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == tokens


def _outputs(value: Any, tokens: Tokens) -> list[torch.Tensor]:
    """The floating-point tensors with a sequence dimension in a (nested) output."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _outputs(item, tokens)]
    if _is_sequence(value, tokens) and value.is_floating_point():
        return [value]
    return []


def _changed(tensor: torch.Tensor, index: int) -> torch.Tensor:
    """``tensor`` with the row of token ``index`` changed: another token id, or an offset
    larger than every value."""
    out = tensor.clone()
    row = out[:, index]
    if out.is_floating_point():
        generator = torch.Generator().manual_seed(1)
        noise = torch.randn(row.shape, generator=generator, dtype=out.dtype).to(out.device)
        row += (1 + out.abs().amax()) * noise
    else:
        row.copy_(torch.where(row > 0, row - 1, row + 1))
    return out


def _run(call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        return call(*args, **kwargs)


def _others_differ(base: torch.Tensor, other: torch.Tensor, index: int) -> bool:
    """Whether a row other than ``index`` (dim 1) differs beyond rounding."""
    if base.shape != other.shape:
        return True
    keep = torch.ones(base.shape[1], dtype=torch.bool, device=base.device)
    keep[index] = False
    a, b = base[:, keep], other[:, keep]
    tolerance = torch.finfo(base.dtype).eps ** 0.5 * (1 + a.abs().amax())
    return bool(((a - b).abs().amax() > tolerance).item())


def mixes_tokens(
    call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], tokens: Tokens
) -> bool:
    """Whether ``call(*args, **kwargs)`` mixes tokens along dim 1 of its inputs and outputs that
    begin with ``tokens`` = ``[B, L]`` (below two tokens there is nothing to mix)."""
    length = tokens[1]
    inputs = list(_candidates(args, kwargs, tokens)) if length >= 2 else []
    base = _outputs(_run(call, args, kwargs), tokens) if inputs else []
    for where in inputs if base else ():
        for index in (0, length - 1):
            new_args, new_kwargs = list(args), dict(kwargs)
            if isinstance(where, int):
                new_args[where] = _changed(args[where], index)
            else:
                new_kwargs[where] = _changed(kwargs[where], index)
            outputs = _outputs(_run(call, tuple(new_args), new_kwargs), tokens)
            if len(outputs) != len(base) or any(
                _others_differ(a, b, index) for a, b in zip(base, outputs)
            ):
                return True
    return False
