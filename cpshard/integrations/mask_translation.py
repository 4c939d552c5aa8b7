"""transformers' attention-mask functions translated into a
:class:`~cpshard.masks.MaskDescription`.

The translation walks the composed mask function a model hands its mask builder (the closures
of ``and_masks`` / ``or_masks`` and of transformers' mask pieces) and describes what it says for
**each document alone**: what the model computes when that document is its whole input, which
is what a packed step must equal. So every piece is read in document positions (a chunk starts
at its document's start); ``remap_positions_for_packed_sequence`` and the packed-sequence and
padding pieces say nothing the documents do not (their tensors, when they cover the batch, must
agree with the documents); the bidirectional blocks of ``blockwise_overlay`` are read at the
global positions of the batch row (each document's slice of the row's block ids is what the
model builds from that document's token types alone).

Pieces are recognised by their code object (the closure a transformers factory returns shares
its code), never by a name that a user's function could also carry. Anything else — a user's
function, a block whose tokens inside a document are not consecutive, a union that is not one
interval per query, tensors that cannot be read for the whole batch — gives None, so the caller
keeps refusing the model, naming the piece (:mod:`cpshard.integrations.masks`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from types import CodeType
from typing import Any

import torch

from cpshard.masks import INF, MaskDescription

MaskFunction = Callable[..., Any]
_Reader = Callable[[dict[str, Any], "_Context"], MaskDescription | None]

# Models' own overlays that are transformers' bidirectional window with a strict bound
# (|q - k| < window): (module, factory name).
_STRICT_WINDOW_OVERLAYS = (
    ("transformers.models.gemma3.modeling_gemma3", "_bidirectional_window_overlay"),
    ("transformers.models.step3p7.modeling_step3p7", "_bidirectional_window_overlay"),
)


# The constant mask models pass to widen causal attention to bidirectional (Gemma 3 writes it
# in its forward; recognised by its instructions).
_ALWAYS_TRUE = (lambda *args: torch.tensor(True, dtype=torch.bool)).__code__  # noqa: E731

_SIGNATURE = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS


class _Context:
    """The batch a translation reads: its documents ``[B, S]`` and, when given, the block ids of
    ``blockwise_overlay`` (transformers' ``block_sequence_ids``: -1 outside a block)."""

    def __init__(self, documents: torch.Tensor, block_ids: torch.Tensor | None) -> None:
        self.documents = documents
        self.block_ids = block_ids

    def covers(self, tensor: object) -> bool:
        """``tensor`` is a per-token tensor of the whole batch (not of one shard)."""
        return isinstance(tensor, torch.Tensor) and tuple(tensor.shape) == tuple(
            self.documents.shape
        )


def describe_transformers_mask(
    mask_function: MaskFunction | None,
    documents: torch.Tensor,
    block_ids: torch.Tensor | None = None,
) -> MaskDescription | None:
    """The :class:`~cpshard.masks.MaskDescription` of transformers' ``mask_function`` (None:
    transformers' default, causal) over the documents ``documents`` ``[B, S]`` (int64 ids, 0 =
    pad), each document read alone (module doc), or None when it cannot be translated exactly.

    ``block_ids`` ``[B, S]``: the row's block ids for ``blockwise_overlay`` (e.g. from
    ``token_type_ids`` the way the model makes them); without them, the ids the overlay holds
    are read when they cover the whole batch (a shard's ids cannot be read as the row's)."""
    if documents.dim() != 2:
        raise ValueError(f"documents must be [B, S], got {tuple(documents.shape)}")
    documents = documents.to("cpu", torch.int64)
    if block_ids is not None:
        if block_ids.shape != documents.shape:
            raise ValueError(
                f"block_ids must be the documents' [B, S] = {tuple(documents.shape)}, got "
                f"{tuple(block_ids.shape)}"
            )
        block_ids = block_ids.to("cpu", torch.int64)
    return _describe(mask_function, _Context(documents, block_ids))


def reads_block_ids(mask_function: MaskFunction | None) -> bool:
    """Whether ``mask_function`` holds transformers' ``blockwise_overlay`` (it reads block ids:
    image spans, a prefix), anywhere in its composition."""
    from transformers import masking_utils as M

    blocks = M.blockwise_overlay(torch.ones(1, 1, dtype=torch.int64)).__code__
    return any(code is blocks for code in _codes(mask_function))


def _codes(fn: MaskFunction | None) -> list[CodeType]:
    """The code objects of ``fn`` and of every mask function its closures hold."""
    out: list[CodeType] = []
    todo = [fn]
    while todo:
        f = todo.pop()
        code = getattr(f, "__code__", None)
        if code is None:
            continue
        out.append(code)
        for cell in getattr(f, "__closure__", None) or ():
            value = cell.cell_contents
            for v in value if isinstance(value, tuple) else (value,):
                if callable(v) and not isinstance(v, type):
                    todo.append(v)
    return out


def _describe(fn: MaskFunction | None, ctx: _Context) -> MaskDescription | None:
    if fn is None:
        return MaskDescription.within_documents(ctx.documents, ahead=0)
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    if _same_code(code, _ALWAYS_TRUE) and getattr(fn, "__globals__", {}).get("torch") is torch:
        return MaskDescription.within_documents(ctx.documents)
    reader = _readers().get(code)
    if reader is None:
        return None
    values = (cell.cell_contents for cell in fn.__closure__ or ())
    cells = dict(zip(code.co_freevars, values, strict=True))
    return reader(cells, ctx)


def _same_code(a: CodeType, b: CodeType) -> bool:
    """Two code objects compute the same thing: same instructions, constants, names and
    signature (``lambda *args: torch.tensor(True, dtype=torch.bool)`` written in a model; the
    flags that say where it was compiled do not count)."""
    return (
        a.co_code == b.co_code
        and a.co_consts == b.co_consts
        and a.co_names == b.co_names
        and a.co_flags & _SIGNATURE == b.co_flags & _SIGNATURE
        and a.co_argcount == b.co_argcount
        and a.co_freevars == b.co_freevars
    )


def _combine(cells: dict[str, Any], ctx: _Context, union: bool) -> MaskDescription | None:
    """``and_masks`` / ``or_masks``: the intersection / union of the pieces' descriptions."""
    out: MaskDescription | None = None
    for piece in cells["mask_functions"]:
        described = _describe(piece, ctx)
        if described is None:
            return None
        if out is None:
            out = described
        else:
            out = out.union(described) if union else out.intersect(described)
            if out is None:
                return None
    return out


def _blocks(cells: dict[str, Any], ctx: _Context) -> MaskDescription | None:
    ids = ctx.block_ids if ctx.block_ids is not None else cells["block_sequence_ids"]
    if not ctx.covers(ids):
        return None
    return MaskDescription.blocks(ctx.documents, ids)


def _no_more_than_documents(
    tensor_name: str, agrees: Callable[[torch.Tensor, torch.Tensor], bool]
) -> _Reader:
    """A piece that restates the documents (packed sequences, padding): bidirectional within
    them. Its tensor is checked against the documents when it covers the batch; a shard's
    (the model ran on one rank's tokens) restates what the step read from the whole batch."""

    def read(cells: dict[str, Any], ctx: _Context) -> MaskDescription | None:
        tensor = cells[tensor_name]
        if ctx.covers(tensor) and not agrees(tensor.to("cpu"), ctx.documents):
            return None
        return MaskDescription.within_documents(ctx.documents)

    return read


def _packing_agrees(packed: torch.Tensor, documents: torch.Tensor) -> bool:
    """No document holds two packed sequences."""
    same_doc = documents[:, 1:] == documents[:, :-1]
    return bool(((packed[:, 1:] == packed[:, :-1]) | ~same_doc | (documents[:, 1:] == 0)).all())


def _padding_agrees(valid: torch.Tensor, documents: torch.Tensor) -> bool:
    """Every document token is a valid key."""
    return bool((valid.bool() | (documents == 0)).all())


@functools.cache
def _readers() -> dict[CodeType, _Reader]:
    """transformers' mask pieces by code object, each with how to read it."""
    from transformers import masking_utils as M

    def window(
        cells: dict[str, Any], ctx: _Context, strict: bool, ahead: bool
    ) -> MaskDescription | None:
        reach = int(cells["sliding_window"]) - (1 if strict else 0)
        if reach < 0:  # a window that does not even reach the query itself
            return None
        return MaskDescription.within_documents(
            ctx.documents, back=reach, ahead=reach if ahead else INF
        )

    zero = torch.zeros(1, dtype=torch.int64)
    ones = torch.ones(1, 1, dtype=torch.int64)
    readers: dict[CodeType, _Reader] = {
        M.causal_mask_function.__code__: lambda c, x: MaskDescription.within_documents(
            x.documents, ahead=0
        ),
        M.bidirectional_mask_function.__code__: lambda c, x: MaskDescription.within_documents(
            x.documents
        ),
        M.and_masks(M.causal_mask_function).__code__: lambda c, x: _combine(c, x, union=False),
        M.or_masks(M.causal_mask_function).__code__: lambda c, x: _combine(c, x, union=True),
        M.remap_positions_for_packed_sequence(M.causal_mask_function, ones).__code__: (
            lambda c, x: _describe(c["mask_function"], x)
        ),
        # k > q - window: every key from the window's start on
        M.sliding_window_overlay(1).__code__: lambda c, x: window(c, x, True, False),
        # |q - k| <= window
        M.sliding_window_bidirectional_overlay(1).__code__: lambda c, x: window(c, x, False, True),
        M.chunked_overlay(1, zero).__code__: lambda c, x: MaskDescription.chunks(
            x.documents, int(c["chunk_size"])
        ),
        M.blockwise_overlay(ones).__code__: _blocks,
        M.packed_sequence_mask_function(ones).__code__: _no_more_than_documents(
            "packed_sequence_mask", _packing_agrees
        ),
        M.padding_mask_function(ones).__code__: _no_more_than_documents(
            "padding_mask", _padding_agrees
        ),
    }
    for module, name in _STRICT_WINDOW_OVERLAYS:  # |q - k| < window
        try:
            factory = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        readers[factory(1).__code__] = lambda c, x: window(c, x, True, True)
    return readers
