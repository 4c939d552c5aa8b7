"""Which of transformers' attention-mask functions CP attention implements.

Under CP the ``"cpshard"`` mask builder builds no mask: the step's documents define what each
query sees. That is exact only when the model's mask says nothing more than CP attention already
does: causal or bidirectional attention, a sliding window (each layer passes its own window to
the attention), and the document boundaries of a packed batch. A model whose mask says more —
chunked attention (Llama 4), bidirectional image blocks (Gemma 3 VLMs), any ``or_masks``
widening, a user's own mask function — would otherwise attend a different pattern than its
single-process self, silently. :func:`mask_problem` walks the composed mask function
(``and_masks`` of known pieces) and names the first piece it cannot vouch for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Qualified-name prefixes of transformers' mask-function pieces CP attention implements.
_IMPLEMENTED = (
    "causal_mask_function",
    "bidirectional_mask_function",
    "sliding_window_overlay.",  # the window: each layer passes it to the attention
    "sliding_window_bidirectional_overlay.",
    "packed_sequence_mask_function.",  # the step's documents
    "padding_mask_function.",  # padding: the step's documents (pad rows attend nothing)
)
# Pieces that combine or re-index other pieces: implemented when every piece they hold is.
_COMPOSITIONS = ("and_masks.", "remap_positions_for_packed_sequence.")


def _pieces(fn: Callable[..., Any]) -> list[Callable[..., Any]]:
    """The mask functions a composed mask function closes over."""
    out: list[Callable[..., Any]] = []
    for cell in fn.__closure__ or ():
        value = cell.cell_contents
        if isinstance(value, tuple):
            out.extend(v for v in value if callable(v) and not isinstance(v, type))
        elif callable(value) and not isinstance(value, type):
            out.append(value)
    return out


def mask_problem(mask_function: Callable[..., Any] | None) -> str | None:
    """The qualified name of the first piece of ``mask_function`` CP attention does not
    implement, or None when it implements them all (None: transformers' default, causal)."""
    if mask_function is None:
        return None
    name = getattr(mask_function, "__qualname__", type(mask_function).__name__)
    if name.startswith(_IMPLEMENTED):
        return None
    if name.startswith(_COMPOSITIONS):
        pieces = _pieces(mask_function)
        if not pieces:
            return name
        for piece in pieces:
            problem = mask_problem(piece)
            if problem is not None:
                return problem
        return None
    return name
