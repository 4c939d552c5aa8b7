"""Context-parallel batch-sharding contract (mirror of
``nemo_automodel.components.distributed.context_parallel.sharder``).

:class:`ContextParallelSharder` takes NeMo Automodel's constructor — the resolution form
(``model`` / ``device_mesh`` / ``batch``) and the direct form (``shard_batch`` with
``local_token_global_indices`` / ``shard_layout``) — and NeMo-shaped :class:`ShardLayout`\\ s, on
top of :class:`cpshard.ContextParallelSharder`, which does all the sharding and un-sharding.

Resolution (what the constructor picks from ``device_mesh`` and ``batch``):

* CP size 1 (no ``cp`` axis, or one of size 1): the identity sharder (the batch is returned
  unchanged; the token verbs are identities).
* a batch carrying the model-owned hook ``_cp_make_batch_fn`` (the block-diagonal CP hook,
  ``(cp_mesh, tp_mesh, batch, loss_mask=..., padding_token_id=...) -> (train_ctx, batch)``):
  that hook, with the contiguous layout it shards to.
* a THD batch (``qkv_format="thd"``): ``NotImplementedError`` (Transformer Engine's THD
  partition is not part of cpshard).
* otherwise torch ``context_parallel``'s round-robin load balancing: cpshard's ``head_tail``
  layout with ``2 * cp_size`` chunks (``num_chunks`` counts THD chunks in NeMo and is not used).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from cpshard import layouts as _layout
from cpshard import sharder as _sharder
from cpshard.comm import resolve_group
from cpshard.nemo._mesh import cp_group, is_duck_mesh
from cpshard.validation import is_int

__all__ = ["ContextParallelSharder", "ShardLayout"]

_WHAT = "cpshard.nemo ContextParallelSharder"


@dataclass(frozen=True)
class ShardLayout:
    """What a ``shard_batch`` learned about the layout it just applied (NeMo's shape).

    Attributes:
        local_token_global_indices: this rank's global positions (1-D) for data-dependent
            layouts; None for layouts whose index map is a closed-form function on the sharder.
        original_seq_len: pre-pad sequence length (None: the padded length).
        padded_seq_len: post-pad global sequence length.
        input_row_shape: ``(B, S)`` of the pre-flatten input rows of a flat-stream (THD) layout.
        input_token_stream_positions: for layouts that reposition tokens, the per-row map from
            input position to padded column (-1: an input pad slot whose token was dropped).
    """

    local_token_global_indices: torch.Tensor | None = None
    original_seq_len: int | None = None
    padded_seq_len: int | None = None
    input_row_shape: tuple[int, ...] | None = None
    input_token_stream_positions: torch.Tensor | None = None


def _axis(mesh: Any, name: str) -> Any:
    """``mesh[name]`` of a mesh with that axis name (a DeviceMesh, or a duck-typed mesh naming
    it in ``mesh_dim_names``), else None."""
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if name not in names or isinstance(mesh, dist.ProcessGroup):
        return None
    return mesh[name] if isinstance(mesh, DeviceMesh) or callable(getattr(mesh, "__getitem__", None)) else None


def _cp_of(device_mesh: Any) -> Any:
    """The CP group: the mesh's ``cp`` axis, a 1-D mesh, a duck-typed 1-D mesh (``get_group()``
    / ``size()``) or a ProcessGroup as is, else None."""
    cp = _axis(device_mesh, "cp")
    if cp is None and (isinstance(device_mesh, dist.ProcessGroup) or is_duck_mesh(device_mesh)
                       or (isinstance(device_mesh, DeviceMesh) and device_mesh.ndim == 1)):
        cp = device_mesh
    return cp_group(cp, _WHAT, "device_mesh['cp']")


def _identity_shard_batch(cp_mesh, tp_mesh, batch, *, loss_mask=None, padding_token_id: int = 0):
    """``shard_batch`` of the identity sharder (CP size 1): the batch unchanged."""
    primary = batch.get("inputs_embeds", batch.get("input_ids"))
    lay = None
    if isinstance(primary, torch.Tensor) and primary.dim() >= 2:
        lay = ShardLayout(original_seq_len=primary.shape[1], padded_seq_len=primary.shape[1])
    return contextlib.nullcontext, batch, lay


def _contiguous_indices(cp_mesh, padded_seq_len: int, device=None) -> torch.Tensor:
    """This rank's positions under the contiguous layout (closed form)."""
    g = resolve_group(cp_mesh, _WHAT)
    return _layout.local_token_global_indices("contiguous", g.rank, g.world, padded_seq_len, device=device)


def _hook_shard_batch(hook: Callable[..., tuple]) -> Callable[..., tuple]:
    """A model-owned ``_cp_make_batch_fn`` as a ``shard_batch`` reporting its contiguous layout."""

    def shard_batch(cp_mesh, tp_mesh, batch, *, loss_mask=None, padding_token_id: int = 0):
        primary = batch.get("inputs_embeds", batch.get("input_ids"))
        seq = primary.shape[1] if isinstance(primary, torch.Tensor) and primary.dim() >= 2 else None
        ctx, out = hook(cp_mesh, tp_mesh, batch, loss_mask=loss_mask, padding_token_id=padding_token_id)
        world = resolve_group(cp_mesh, _WHAT).world
        lay = None if seq is None else ShardLayout(original_seq_len=seq, padded_seq_len=-(-seq // world) * world)
        return ctx, out, lay

    return shard_batch


def _nemo_shaped(shard_batch: Callable[..., tuple]) -> Callable[..., tuple]:
    """cpshard's built-in ``shard_batch`` with NeMo's batch: the side record's ``labels``,
    ``loss_mask``, ``padding_mask`` and (when the batch has them) ``_packed_seq_ids`` as keys of
    the sharded batch (labels are not shifted: NeMo's are targets already)."""

    def nemo_shard_batch(cp_mesh, tp_mesh, batch, *, loss_mask=None, padding_token_id: int = 0):
        ctx, out, lay = shard_batch(
            cp_mesh, tp_mesh, batch, loss_mask=loss_mask, padding_token_id=padding_token_id
        )
        packed = "_packed_seq_ids" if batch.get("_packed_seq_ids") is not None else None
        return ctx, out.with_targets(packed), lay

    return nemo_shard_batch


class ContextParallelSharder:
    """CP backend description: how a batch is sharded and where local tokens live.

    Attributes (NeMo's): ``shard_batch`` — ``(cp_mesh, tp_mesh, batch, *, loss_mask=None,
    padding_token_id=0) -> (ctx_factory, batch, ShardLayout | None)``;
    ``local_token_global_indices`` — ``(cp_mesh, padded_seq_len, device) -> LongTensor`` for
    closed-form layouts, None for data-dependent ones; ``shard_layout`` — the layout of the last
    :meth:`shard` (NeMo-shaped; a cpshard :class:`cpshard.ShardLayout` is accepted too);
    ``_cp_mesh``, ``_tp_mesh``, ``_loss_mask``, ``_padding_token_id``.

    Raises ``TypeError`` when the direct form (``shard_batch``) is mixed with resolution
    arguments, when ``local_token_global_indices`` / ``shard_layout`` come without
    ``shard_batch``, or when the resolution form has no ``batch``.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        device_mesh: DeviceMesh | None = None,
        batch: dict[str, Any] | None = None,
        shard_batch: Callable[..., tuple[Callable, dict[str, Any], ShardLayout | None]] | None = None,
        local_token_global_indices: Callable[..., torch.Tensor] | None = None,
        shard_layout: ShardLayout | None = None,
        padding_token_id: int = 0,
        num_chunks: int = 1,
        loss_mask: torch.Tensor | None = None,
        invoke_pre_embed: bool = True,
        extra_seq_buffers: dict[str, int] | None = None,
    ) -> None:
        cp = _cp_of(device_mesh)
        if shard_batch is not None:
            if (model is not None or batch is not None or num_chunks != 1 or not invoke_pre_embed
                    or extra_seq_buffers is not None):
                raise TypeError(
                    f"{_WHAT}: shard_batch (the direct form) is mutually exclusive with model, batch "
                    "and the resolution options (num_chunks, invoke_pre_embed, extra_seq_buffers)"
                )
        else:
            if local_token_global_indices is not None or shard_layout is not None:
                raise TypeError(f"{_WHAT}: local_token_global_indices and shard_layout require shard_batch")
            if batch is None:
                raise TypeError(f"{_WHAT}: batch is required when shard_batch is not provided")
            if not is_int(num_chunks) or num_chunks < 1:
                raise ValueError(f"{_WHAT}: num_chunks must be an int >= 1, got {num_chunks!r}")
            shard_batch, local_token_global_indices = self._resolve(cp, batch)
        self._cp_mesh = cp
        self._tp_mesh = _axis(device_mesh, "tp")
        self._loss_mask = loss_mask
        self._padding_token_id = padding_token_id
        self._user_indices = local_token_global_indices
        self._nemo_layout: ShardLayout | None = None
        if shard_batch is None:  # the built-in round-robin (head_tail) layout
            self._impl = _sharder.ContextParallelSharder(
                cp, "head_tail", padding_token_id=padding_token_id, loss_mask=loss_mask,
                extra_seq_buffers=extra_seq_buffers, tp_mesh=self._tp_mesh, shift_labels=False,
            )
            self.shard_batch = _nemo_shaped(self._impl.shard_batch)
            self.local_token_global_indices = self._impl.local_token_global_indices
        else:
            self._impl = _sharder.ContextParallelSharder(
                cp, None, padding_token_id=padding_token_id, loss_mask=loss_mask, tp_mesh=self._tp_mesh,
                shard_batch=shard_batch, local_token_global_indices=self._own_indices,
            )
            self.shard_batch = shard_batch
            self.local_token_global_indices = local_token_global_indices
        self.shard_layout = shard_layout

    @staticmethod
    def _resolve(cp: Any, batch: dict[str, Any]) -> tuple[Callable | None, Callable | None]:
        """``(shard_batch, local_token_global_indices)`` for the batch; ``(None, None)`` selects
        the built-in round-robin layout."""
        if not isinstance(batch, dict):
            raise TypeError(f"{_WHAT}: batch must be a dict, got {type(batch).__name__}")
        if resolve_group(cp, _WHAT).world <= 1:
            return _identity_shard_batch, lambda cp_mesh, padded, device=None: torch.arange(padded, device=device)
        hook = batch.pop("_cp_make_batch_fn", None)
        if hook is not None:
            if not callable(hook):
                raise TypeError(f"{_WHAT}: batch['_cp_make_batch_fn'] must be callable, got {type(hook).__name__}")
            return _hook_shard_batch(hook), _contiguous_indices
        if batch.get("qkv_format") == "thd":
            raise NotImplementedError(
                f"{_WHAT}: THD batches (qkv_format='thd') need Transformer Engine's THD partition, "
                "which cpshard does not provide; shard packed rows with cpshard's "
                "per_document_head_tail or balanced layout instead"
            )
        return None, None

    # ------------------------------------------------------------------ the layout

    @property
    def shard_layout(self) -> ShardLayout | _layout.ShardLayout | None:
        """The layout of the last :meth:`shard` (as ``shard_batch`` reported it; NeMo-shaped for
        the built-in layout)."""
        if self._nemo_layout is not None:
            return self._nemo_layout
        top = self._impl.shard_layout
        if top is None:
            return None
        own = None if top.closed_form else top.indices(self._impl.rank)
        return ShardLayout(own, top.original_seq_len, top.padded_seq_len, top.input_row_shape, top.position_map)

    @shard_layout.setter
    def shard_layout(self, value: ShardLayout | _layout.ShardLayout | None) -> None:
        if value is None or isinstance(value, _layout.ShardLayout):
            self._nemo_layout, self._impl.shard_layout = None, value
            return
        if not isinstance(value, ShardLayout):
            raise TypeError(f"{_WHAT}: shard_layout must be a ShardLayout or None, got {type(value).__name__}")
        if value.local_token_global_indices is not None and self._impl.layout is not None:
            raise TypeError(
                f"{_WHAT}: a ShardLayout carrying indices needs the direct form (shard_batch=...); "
                f"this sharder uses the built-in {self._impl.layout!r} layout"
            )
        self._nemo_layout, self._impl.shard_layout = value, self._to_cpshard(value)

    def _to_cpshard(self, lay: ShardLayout) -> _layout.ShardLayout:
        """cpshard's record of a NeMo layout; its indices (this rank's only) are served by
        :meth:`_own_indices`."""
        world = self._impl.world_size
        idx = lay.local_token_global_indices
        padded = lay.padded_seq_len
        if padded is None:
            if idx is None:
                raise ValueError(f"{_WHAT}: rank {self._impl.rank}: the ShardLayout has no padded_seq_len")
            padded = idx.numel() * world
        positions = lay.input_token_stream_positions
        original = lay.original_seq_len
        if positions is not None:
            original = positions.shape[-1]
        elif lay.input_row_shape is not None:
            original = 1
            for size in lay.input_row_shape:
                original *= int(size)
        elif original is None:
            original = padded
        rows = None if lay.input_row_shape is None else tuple(int(v) for v in lay.input_row_shape)
        return _layout.ShardLayout("custom", world, original, padded, None, rows, positions)

    def _own_indices(self, cp_mesh: Any, padded_seq_len: int, device=None) -> torch.Tensor:
        """This rank's positions: the reported layout's, else the caller's closed-form callable."""
        lay = self._nemo_layout
        if lay is not None and lay.local_token_global_indices is not None:
            return lay.local_token_global_indices.reshape(-1).to(device=device, dtype=torch.int64)
        if self._user_indices is not None:
            return self._user_indices(cp_mesh, padded_seq_len, device)
        raise self._data_dependent()

    def _data_dependent(self) -> NotImplementedError:
        return NotImplementedError(
            f"{_WHAT}: rank {self._impl.rank}: this sharder has a data-dependent token layout; its "
            "index map arrives with the shard layout, so token-tensor shard/gather are unavailable "
            "before the first shard"
        )

    def _check_source(self) -> None:
        if self._impl.shard_layout is None and self.local_token_global_indices is None:
            raise self._data_dependent()

    # ------------------------------------------------------------------ the verbs

    def shard(self, batch: dict[str, Any]) -> tuple[Callable, dict[str, Any]]:
        """Shard a batch and retain its layout for token-aligned tensors."""
        result = self.shard_batch(
            self._cp_mesh, self._tp_mesh, batch, loss_mask=self._loss_mask, padding_token_id=self._padding_token_id
        )
        if not isinstance(result, tuple) or len(result) != 3:
            raise TypeError(f"{_WHAT}.shard: shard_batch must return (ctx_factory, batch, ShardLayout | None)")
        ctx, out, self.shard_layout = result
        return ctx, out

    def _indices(self, padded_seq_len: int, device) -> torch.Tensor:
        """This rank's global positions for ``padded_seq_len`` tokens (the reported layout's,
        checked to cover that many tokens: ``ValueError`` otherwise)."""
        self._check_source()
        lay = self._nemo_layout
        if lay is not None and lay.local_token_global_indices is not None:
            expected = lay.local_token_global_indices.numel() * self._impl.world_size
            if padded_seq_len != expected:
                world = self._impl.world_size
                raise ValueError(
                    f"{_WHAT}: rank {self._impl.rank}: the reported CP indices cover a padded stream "
                    f"of {expected} tokens ({expected // world} local x cp_size {world}), got "
                    f"padded_seq_len={padded_seq_len}. The tensor does not match the batch this "
                    "sharder last sharded."
                )
        return self._impl._indices(padded_seq_len, device)

    def shard_token_tensor(
        self, tensor: torch.Tensor, seq_dim: int = 1, fill: float | int | None = None
    ) -> torch.Tensor:
        """Shard a full-length token-aligned tensor exactly like the model inputs
        (:meth:`cpshard.ContextParallelSharder.shard_token_tensor`): input rows of a
        repositioned layout, THD input rows, ``original_seq_len`` (padded with ``fill``) or
        ``padded_seq_len``; any other length raises ``ValueError``."""
        self._check_source()
        lay = self.shard_layout
        if lay is not None and isinstance(tensor, torch.Tensor):
            positions, rows = lay.input_token_stream_positions, lay.input_row_shape
            if positions is not None and tuple(tensor.shape) == tuple(positions.shape) and fill is None:
                raise ValueError(
                    f"{_WHAT}: rank {self._impl.rank}: sharding an input-coordinate tensor on a "
                    "repositioned layout requires fill"
                )
            if rows is not None and len(rows) == 2 and tuple(tensor.shape[:2]) == tuple(rows):
                # THD input rows: flattened into the stream; NeMo's shard has no row dim
                return self._impl.shard_token_tensor(tensor, 1, fill).squeeze(0)
        return self._impl.shard_token_tensor(tensor, seq_dim, fill)

    def gather_token_tensor(
        self, tensor: torch.Tensor, seq_dim: int = 1, trim: bool = False, fill: float | int | None = None
    ) -> torch.Tensor:
        """Differentiably gather a token-aligned local shard to global order
        (:meth:`cpshard.ContextParallelSharder.gather_token_tensor`). With ``trim=True`` the
        result is in the caller's original coordinates; raises ``NotImplementedError`` when no
        layout is present (nothing to trim to)."""
        if trim is True and self._impl.shard_layout is None:
            raise NotImplementedError(
                f"{_WHAT}: rank {self._impl.rank}: this sharder has no shard layout to trim to; gather "
                "with trim=False, or shard a batch first"
            )
        self._check_source()
        lay = self.shard_layout
        if trim is True and fill is None and lay is not None and lay.input_token_stream_positions is not None:
            raise ValueError(
                f"{_WHAT}: rank {self._impl.rank}: trimming to input coordinates on a repositioned "
                "layout requires fill"
            )
        return self._impl.gather_token_tensor(tensor, seq_dim, trim, fill)
