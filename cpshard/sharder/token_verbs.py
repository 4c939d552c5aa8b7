"""The token verbs of :class:`~cpshard.sharder.ContextParallelSharder`:
:meth:`~TokenVerbs.shard_token_tensor` and :meth:`~TokenVerbs.gather_token_tensor` (see the
:mod:`cpshard.sharder` doc) over a :class:`~cpshard.sharder.partition.Partition`, with
:class:`_GatherPlan`, the in-place chunk reorder and its autograd function, and the index
helpers of the un-shard."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from cpshard import ops
from cpshard.consensus import check_call
from cpshard.layouts import ShardLayout, rank_major_inverse
from cpshard.sharder.partition import Partition, gather_rows, invert_position_map, take
from cpshard.transport import gather_metadata, gather_ragged, gather_sequence
from cpshard.validation import Problem, dim_arg, tensor_arg


class TokenVerbs:
    """shard_token_tensor / gather_token_tensor over the sharder's ``partition``."""

    def __init__(self, partition: Partition) -> None:
        self._p = partition

    def shard_token_tensor(
        self, tensor: torch.Tensor, seq_dim: int = 1, fill: float | int | None = None
    ) -> torch.Tensor:
        """Shard a full-length token-aligned tensor exactly like the model inputs (differentiably).

        Accepted lengths along ``seq_dim`` (anything else raises): with a shard layout,
        ``[B, S_in]`` rows of a repositioned-row layout (scattered into the padded rows, ``fill``
        in the pad slots); ``[.., B, S, ..]`` matching a THD layout's ``input_row_shape``
        (flattened first; the shard is ``[.., 1, L, ..]``, the model's stream coordinate);
        ``original_seq_len`` (right-padded with ``fill``); ``padded_seq_len`` (sharded as is).
        Before the first shard (closed-form layouts only) the tensor must be at a padded length.
        ``fill`` must be given whenever padded positions have to be filled."""
        try:
            t = tensor_arg(tensor, "tensor")
            d = dim_arg(t, seq_dim)
            index, needs_fill = self._shard_index(t, d)
            if needs_fill and fill is None:
                raise Problem(
                    f"the tensor ({t.shape[d]} positions along seq_dim) must be padded to the "
                    f"layout's {self._p.shard_layout.padded_seq_len} positions: pass fill= (e.g. "
                    "-100 for labels, 0 for masks)"
                )
            t = self._flatten_rows(t, d)
            return gather_rows(t, d, index, fill if fill is not None else 0)
        except Problem as p:
            raise p.kind(f"{self._p.where('shard_token_tensor')}: {p}") from None

    def _flatten_rows(self, t: torch.Tensor, d: int) -> torch.Tensor:
        """``[.., B, S, ..]`` in a THD layout's input rows -> ``[.., 1, B*S, ..]``."""
        lay = self._p.shard_layout
        if lay is not None and lay.input_row_shape is not None and _is_thd_rows(t, d, lay):
            return t.flatten(d - 1, d).unsqueeze(d - 1)
        return t

    def _host_flags(self, lay: ShardLayout) -> tuple[bool, bool]:
        """Whether ``lay``'s position map leaves padded positions without an input position (a
        fill is needed when sharding), and whether it drops input positions: read once per
        shard layout from the map's host copy, never from a device tensor per call."""

        def read() -> tuple[bool, bool]:
            assert lay.position_map is not None
            pm = lay.position_map.cpu()
            return bool((invert_position_map(pm, lay.padded_seq_len) < 0).any()), bool(
                (pm < 0).any()
            )

        return self._p.cached(("position_map_flags",), read)

    def _shard_index(self, t: torch.Tensor, d: int) -> tuple[torch.Tensor, bool]:
        """The positions of ``t`` (along d) this rank takes (-1: fill), and whether any padded
        position needs a fill on any rank."""
        lay, fn = self._p.source()
        n = t.shape[d]
        if lay is None:
            if fn is not None:
                return self._p.user_index(n, t.device), False
            return self._p.virtual(n).indices(self._p.rank, t.device), False
        padded = lay.padded_seq_len
        mine = self._p.cached(
            ("mine", str(t.device)),
            lambda: (
                self._p.user_index(padded, t.device)
                if fn is not None
                else lay.indices(self._p.rank, t.device)
            ),
        )
        if lay.position_map is not None and n == lay.original_seq_len:
            pm = lay.position_map
            if pm.dim() == 2 and d > 0 and t.shape[d - 1] not in (pm.shape[0], 1):
                raise Problem(
                    f"the tensor has batch size {t.shape[d - 1]}, the position map {pm.shape[0]}"
                )
            src = self._p.cached(
                ("src", str(t.device)), lambda: invert_position_map(pm, padded).to(t.device)
            )
            return take(src, mine), self._host_flags(lay)[0]
        if lay.input_row_shape is not None and _is_thd_rows(t, d, lay):
            n = lay.original_seq_len
        if n == padded:
            return mine, False
        if n == lay.original_seq_len and lay.position_map is None:
            return torch.where(mine < n, mine, torch.full_like(mine, -1)), True
        accepted = [f"padded_seq_len = {padded}"]
        if lay.position_map is not None:
            accepted.insert(0, f"the position map's input length {lay.original_seq_len}")
        else:
            accepted.insert(0, f"original_seq_len = {lay.original_seq_len}")
        if lay.input_row_shape is not None:
            accepted.insert(0, f"input rows {lay.input_row_shape} at (seq_dim - 1, seq_dim)")
        raise Problem(
            f"the tensor has {n} positions along seq_dim={d} (shape {tuple(t.shape)}); the shard "
            f"layout {lay.name!r} accepts {' or '.join(accepted)}"
        )

    def gather_token_tensor(
        self,
        tensor: torch.Tensor,
        seq_dim: int = 1,
        trim: bool = False,
        fill: float | int | None = None,
    ) -> torch.Tensor:
        """Differentiably gather a token-aligned local shard to global order.

        Without ``trim`` the result has the padded length. With ``trim=True`` it is returned in
        the caller's original coordinates using the shard layout: sliced back to
        ``original_seq_len``, un-flattened to ``input_row_shape`` (THD), or mapped through the
        position map (``fill`` for input positions whose tokens were dropped; required then).
        Raises when no layout is present (nothing to trim to). One all-gather of the shards and
        one reorder (an index gather, or whole chunks in place: see the module doc); closed-form
        layouts never all-gather index tensors."""
        what = "cpshard.ContextParallelSharder.gather_token_tensor"
        problem, plan = None, None
        try:
            plan = self._gather_plan(tensor, seq_dim, trim, fill)
        except Problem as p:
            problem = str(p)
        if problem is not None:
            # A per-call function: the problem raises here alone by default; in checked mode
            # every transport call below opens with exactly one consensus round, which a rank
            # whose checks failed joins here with its failure flag, so every rank raises and none
            # blocks. A rank that passed spends no extra round on this call's own checks.
            check_call(self._p.group, what, problem)
        t, d = tensor, plan.dim
        fill_value = fill if fill is not None else 0
        if plan.counts is not None:  # ranks hold different counts: all-gather-v, rank order
            full = gather_ragged(t, self._p.cp_mesh, plan.counts, dim=d)
            index = plan.trim(plan.inverse)
            out = full if index is None else gather_rows(full, d, index, fill_value)
        elif plan.chunks is not None or (
            plan.inverse is None and plan.user_index is None and not plan.needs_index
        ):
            if plan.chunks is None:  # the rank-major concatenation already is global order
                out = gather_sequence(t, self._p.cp_mesh, seq_dim=d)
            else:  # [W, *t.shape] straight from the all-gather, then reordered by whole chunks
                stage = gather_sequence(t.unsqueeze(0), self._p.cp_mesh, seq_dim=0)
                out = self._chunks_to_global_order(stage, plan.chunks, d)
            if plan.narrow is not None:
                out = out.narrow(d, 0, plan.narrow)
        else:
            # [W, *t.shape] straight from the all-gather (no interleave), then ONE index gather
            # that both interleaves and un-permutes: out[.., p, ..] = stage[rank(p), .., j(p), ..]
            stage = gather_sequence(t.unsqueeze(0), self._p.cp_mesh, seq_dim=0)
            if plan.user_index is not None:  # direct form: this rank knows its own indices only
                every = gather_metadata(plan.user_index, self._p.cp_mesh, seq_dim=0)
                inverse = torch.argsort(every)
                if not torch.equal(
                    every[inverse], torch.arange(every.numel(), device=every.device)
                ):
                    raise ValueError(
                        f"{what}: rank {self._p.rank}: the ranks' local_token_global_indices do not "
                        f"partition 0..{every.numel() - 1}"
                    )
                index = _stage_index(plan.trim(inverse), tuple(t.shape), d)
            else:
                key = ("stage", tuple(t.shape), d, trim, str(t.device))
                index = self._p.cached(
                    key, lambda: _stage_index(plan.trim(plan.inverse), tuple(t.shape), d)
                )
            rows = stage.shape[0]
            for size in t.shape[: d + 1]:
                rows *= size
            out = ops.index_gather(
                stage.reshape(rows, *t.shape[d + 1 :]), index.reshape(-1), 0, fill_value
            )
            out = out.view(*t.shape[:d], index.shape[-1], *t.shape[d + 1 :])
        if plan.rows is not None:
            out = _unflatten_rows(out, d, plan.rows)
        return out

    def _chunk_order(self, lay: ShardLayout, t: torch.Tensor) -> tuple[int, ...] | None:
        """The rank-major chunk that holds every global chunk, when the un-shard of ``t`` can
        reorder whole chunks instead of tokens: a closed-form layout that moves whole chunks
        (``head_tail``) over more than one rank, and data to move. None otherwise (the token
        index gather does it)."""
        if not lay.moves_whole_chunks or lay.world_size == 1 or not t.numel():
            return None
        chunks, world = lay.num_chunks, lay.world_size

        def order() -> tuple[int, ...]:  # the layout's inverse with one token per chunk
            return tuple(rank_major_inverse(lay.name, world, chunks, num_chunks=chunks).tolist())

        return self._p.cached(("chunk order", chunks), order)

    def _chunks_to_global_order(
        self, stage: torch.Tensor, src: tuple[int, ...], d: int
    ) -> torch.Tensor:
        """The all-gathered ``[W, *shape]`` (token dim ``d`` of ``shape``) in global order
        ``[*shape[:d], W * L, *shape[d + 1:]]`` for a layout that moves whole chunks (``src[k]``:
        the rank-major chunk that global chunk ``k`` is). With nothing before the token dim a
        chunk is one contiguous run in both orders, so the stage is reordered in place; otherwise
        one index gather of whole chunks (not of tokens) builds the output."""
        shape = stage.shape[1:]
        pre = math.prod(shape[:d])
        if pre == 1:
            out = _ChunksToGlobalOrder.apply(stage, src)
        else:
            per_rank = len(src) // stage.shape[0]
            index = self._p.cached(
                ("chunks", tuple(shape[:d]), d, str(stage.device)),
                lambda: _stage_index(
                    torch.tensor(src, device=stage.device), (*shape[:d], per_rank), d
                ).reshape(-1),
            )
            out = ops.index_gather(stage.view(index.numel(), -1), index, 0)
        return out.view(*shape[:d], stage.shape[0] * shape[d], *shape[d + 1 :])

    def _gather_plan(
        self, tensor: object, seq_dim: object, trim: object, fill: object
    ) -> _GatherPlan:
        """Every local check of gather_token_tensor, and the inverse permutation (no comm)."""
        t = tensor_arg(tensor, "tensor")
        d = dim_arg(t, seq_dim)
        if not isinstance(trim, bool):
            raise Problem(f"trim must be a bool, got {type(trim).__name__}", TypeError)
        lay, fn = self._p.source()
        n = t.shape[d]
        plan = _GatherPlan(d)
        if lay is None:
            if trim:
                raise Problem(
                    "trim=True needs a shard layout (nothing to trim to before the first shard)"
                )
            padded = n * self._p.world_size
            if fn is not None:
                plan.user_index = self._p.user_index(padded, t.device)
                return plan
            virtual = self._p.virtual(padded)
            if not self._p.identity(virtual):
                plan.inverse = virtual.rank_major_inverse(t.device)
                plan.chunks = self._chunk_order(virtual, t)
            return plan
        counts = lay.counts
        if n != counts[self._p.rank]:
            raise Problem(
                f"the local shard has {n} positions along seq_dim={d} (shape {tuple(t.shape)}), "
                f"but rank {self._p.rank} holds {counts[self._p.rank]} tokens of the shard layout "
                f"{lay.name!r}"
            )
        if len(set(counts)) > 1:
            plan.counts = counts
        if lay.per_row:
            rows = lay.local_token_global_indices.shape[1]
            if d == 0 or t.shape[d - 1] != rows:
                raise Problem(
                    f"the shard layout differs between the {rows} rows of the batch: the local "
                    f"shard needs its batch dim (of size {rows}) right before seq_dim={d}, got "
                    f"shape {tuple(t.shape)}"
                )
        if fn is not None:
            plan.user_index = self._p.cached(
                ("mine", str(t.device)), lambda: self._p.user_index(lay.padded_seq_len, t.device)
            )
        elif not self._p.identity(lay):
            plan.inverse = self._p.cached(
                ("inv", str(t.device)), lambda: lay.rank_major_inverse(t.device)
            )
            plan.chunks = self._chunk_order(lay, t)
        padded = lay.padded_seq_len
        arange = lambda: torch.arange(padded, device=t.device)  # noqa: E731  (identity inverse)
        if not trim:
            return plan
        if lay.position_map is not None:
            host_pm = lay.position_map
            pm = self._p.cached(("pm", str(t.device)), lambda: host_pm.to(t.device))
            if self._host_flags(lay)[1] and fill is None:
                raise Problem("the position map drops input positions: pass fill= for them")
            if pm.dim() == 2 and pm.shape[0] > 1 and (d == 0 or t.shape[d - 1] != pm.shape[0]):
                raise Problem(
                    f"the position map has {pm.shape[0]} rows: the local shard needs its batch "
                    f"dim (of that size) right before seq_dim={d}, got shape {tuple(t.shape)}"
                )
            plan.trim = lambda inv: torch.where(
                pm >= 0,
                take(arange() if inv is None else inv, pm.clamp(min=0)),
                torch.full_like(pm, -1),
            )
            plan.needs_index = True
            plan.chunks = None
            return plan
        keep = lay.original_seq_len
        if lay.input_row_shape is not None:
            if lay.per_row:
                raise Problem("a THD layout must partition one stream, not per-row")
            plan.rows = lay.input_row_shape
        if keep != padded:
            plan.trim = lambda inv: (arange() if inv is None else inv)[..., :keep]
            plan.narrow = keep
        return plan


class _GatherPlan:
    """What :meth:`ContextParallelSharder.gather_token_tensor` does around the all-gather."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.counts: list[int] | None = None  # ranks hold different counts: per-rank counts
        self.inverse: torch.Tensor | None = None  # [P] or [B, P] rank-major slots; None = identity
        self.user_index: torch.Tensor | None = None  # direct form: this rank's positions
        # inverse (None = identity) -> the rank-major slot of every output position (-1: fill),
        # [n] or [B, n]; None = no index gather needed
        self.trim: Callable[[torch.Tensor | None], torch.Tensor | None] = lambda inv: inv
        self.needs_index = False  # the trim needs an index gather even for an identity layout
        # a layout that moves whole chunks: the rank-major chunk of every global chunk (the
        # un-shard reorders chunks, not tokens)
        self.chunks: tuple[int, ...] | None = None
        self.narrow: int | None = None  # identity / chunk reorder + plain trim: a narrow
        self.rows: tuple[int, int] | None = None  # THD: un-flatten the stream to (B, S)


def _permute_chunks_(chunks: torch.Tensor, src: Sequence[int]) -> None:
    """``chunks[k] = chunks[src[k]]`` (old contents) for every ``k``, in place along dim 0: the
    cycles of the permutation are walked one after the other with one chunk of scratch."""
    done = [False] * len(src)
    saved = None
    for start in range(len(src)):
        if done[start] or src[start] == start:
            continue
        if saved is None:
            saved = torch.empty_like(chunks[start])
        saved.copy_(chunks[start])
        k = start
        while src[k] != start:
            chunks[k].copy_(chunks[src[k]])
            done[k] = True
            k = src[k]
        chunks[k].copy_(saved)
        done[k] = True


class _ChunksToGlobalOrder(torch.autograd.Function):
    """The all-gathered ``[W, ...]`` buffer, viewed as chunks in rank-major order, put in global
    order in place (``src[k]``: the rank-major chunk that global chunk ``k`` is); backward: the
    gradient's chunks back to rank-major order (one gather of whole chunks)."""

    @staticmethod
    def forward(ctx, stage: torch.Tensor, src: tuple[int, ...]) -> torch.Tensor:
        ctx.src = src
        _permute_chunks_(stage.view(len(src), -1), src)
        ctx.mark_dirty(stage)
        return stage

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = [0] * len(ctx.src)
        for k, s in enumerate(ctx.src):
            back[s] = k
        index = torch.tensor(back, dtype=torch.int64, device=grad.device)
        chunks = ops.index_gather(grad.reshape(len(back), -1), index, 0)
        return chunks.view(grad.shape), None


def _stage_index(slots: torch.Tensor, shape: tuple[int, ...], d: int) -> torch.Tensor:
    """Flat index into the all-gathered ``[W, *shape]`` stage, viewed as ``[W * pre * L, post]``
    (``pre`` = the sizes before the seq dim ``d``, ``L = shape[d]``), for every (pre, output
    position): ``rank * pre * L + q * L + j`` where ``slots = rank * L + j`` (-1 stays -1).
    ``slots`` is ``[n]`` (every row alike) or ``[B, n]`` (per row; B = ``shape[d - 1]``)."""
    length = shape[d]
    pre = 1
    for s in shape[:d]:
        pre *= s
    q = torch.arange(pre, device=slots.device)
    if slots.dim() == 1:
        slots = slots.unsqueeze(0)  # [1, n], broadcast over q
    else:
        slots = slots[q % slots.shape[0]]  # the batch dim is the innermost of pre
    safe = slots.clamp(min=0)
    flat = (
        (safe // max(length, 1)) * (pre * length) + q.unsqueeze(1) * length + safe % max(length, 1)
    )
    return torch.where(slots >= 0, flat, torch.full_like(flat, -1)).expand(pre, flat.shape[1])


def _is_thd_rows(t: torch.Tensor, d: int, lay: ShardLayout) -> bool:
    rows, cols = lay.input_row_shape
    return d > 0 and rows != 1 and tuple(t.shape[d - 1 : d + 1]) == (rows, cols)


def _unflatten_rows(full: torch.Tensor, d: int, rows: tuple[int, int]) -> torch.Tensor:
    """A THD stream ``[.., 1, B*S, ..]`` (or ``[.., B*S, ..]``) back to ``[.., B, S, ..]``."""
    if d > 0 and full.shape[d - 1] == 1:
        return full.flatten(d - 1, d).unflatten(d - 1, rows)
    return full.unflatten(d, rows)
