"""Group consensus, so a check that fails on some ranks only makes EVERY rank raise instead of
leaving the others blocked in the next collective.

Each check exchanges one small int64 vector per rank (one all-to-all over the host-side channel,
:mod:`cpshard.comm.host`): a failure flag plus the values that must agree across ranks (shapes,
dtypes, sizes). Every rank sees the same table, so every rank reaches the same verdict and
raises the same way.

When it runs (the validation model):

* **per step**, always: the entry points that see a step's host metadata
  (``ContextParallelSharder.shard``, ``make_cp_blockdiag_batch_and_ctx``, the vision plan) and
  ``reduce_cp_gradients`` run one round;
* **per call**, only in checked mode: the per-call functions (``gather_*``,
  ``cp_blockdiag_sdpa``, ``cp_attention``, ``cp_cross_entropy``) otherwise check their local
  arguments only and issue nothing but their data transfer. Checked mode is on when ``CPSHARD_CHECKS=call`` or
  ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` is set at import, or inside :func:`check_mode`.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch

from cpshard.comm import Group, GroupLike, all_gather_small, resolve_group
from cpshard.scoped import ScopedValue

CHECK_MODES = ("step", "call")


def _mode_from_env() -> str:
    mode = os.environ.get("CPSHARD_CHECKS", "").strip().lower()
    if mode and mode not in CHECK_MODES:
        raise ValueError(f"CPSHARD_CHECKS must be one of {CHECK_MODES}, got {mode!r}")
    if not mode:
        detail = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").strip().upper() == "DETAIL"
        mode = "call" if detail else "step"
    return mode


# The process's check mode (one of the documented scopes).
_check: ScopedValue[str] = ScopedValue(_mode_from_env(), "cpshard.check_mode")


def current_check_mode() -> str:
    """``"step"`` (default: cross-rank checks once per step) or ``"call"`` (checked mode: also
    one consensus round before every per-call transfer)."""
    return _check.get()


@contextmanager
def check_mode(mode: str) -> Iterator[None]:
    """Run the block in check mode ``mode`` (``"step"`` or ``"call"``), then restore the previous
    one (by token, so nested blocks restore in order). Every rank of a group must use the same
    mode (a per-call round is a collective)."""
    if mode not in CHECK_MODES:
        raise ValueError(f"cpshard.check_mode: mode must be one of {CHECK_MODES}, got {mode!r}")
    with _check.scope(mode):
        yield


# Every rank sends this many integers, whatever its arguments, so the exchange itself never
# mismatches.
_CAPACITY = 64


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def agree(
    group: Group,
    what: str,
    local_error: str | None,
    fields: Mapping[str, Sequence[int]] | None = None,
) -> None:
    """Raise ``ValueError`` on every rank if any rank has a ``local_error`` or if any entry of
    ``fields`` (name -> tuple of ints, same names and lengths on every rank) differs across ranks.

    A rank with a local error raises its own detail; the others name the failed rank(s). A field
    that differs names the ranks that disagree with the most common value (rank 0's on a tie).
    One rank, or an offline group (no process group: torch.distributed is not initialised, so no
    collective can follow either), checks locally.
    """
    if group.world == 1 or group.pg is None:  # one rank, or an offline group: nothing to agree
        if local_error is not None:
            raise ValueError(f"{what}: rank {group.rank}: {local_error}")
        return
    fields = dict(fields or {})  # fixed names and lengths per call site
    lengths = [len(v) for v in fields.values()]
    flat = [1 if local_error is not None else 0, *lengths]
    for values in fields.values():
        flat.extend(int(v) for v in values)
    width = len(flat)
    if width + 1 > _CAPACITY:
        raise AssertionError(f"{what}: consensus fields exceed {_CAPACITY} integers")
    padded = [width, *flat] + [0] * (_CAPACITY - width - 1)
    table = all_gather_small(torch.tensor(padded, dtype=torch.int64), group)
    failed = torch.nonzero(table[:, 1]).flatten().tolist()
    if failed:
        if local_error is not None:
            raise ValueError(f"{what}: rank {group.rank}: {local_error}")
        raise ValueError(f"{what}: {_ranks(failed)} failed its checks (see the error on that rank)")
    structure = table[:, : 2 + len(lengths)]  # width, failure flag (none set), field lengths
    if not bool((structure == torch.tensor([width, 0, *lengths])).all()):
        raise ValueError(f"{what}: ranks passed arguments of different structure: {table[:, 0].tolist()}")
    at = 2 + len(lengths)
    for name, values in fields.items():
        mine = table[:, at : at + len(values)]
        at += len(values)
        if bool((mine == mine[0]).all()):  # agreed: no per-rank work (W rows, one comparison)
            continue
        per_rank = [tuple(row) for row in mine.tolist()]
        common, top = Counter(per_rank).most_common(1)[0]
        if list(Counter(per_rank).values()).count(top) > 1:
            common = per_rank[0]
        odd = [r for r, v in enumerate(per_rank) if v != common]
        shown = ", ".join(f"rank {r}: {per_rank[r]}" for r in odd)
        raise ValueError(f"{what}: {name} differs on {_ranks(odd)} ({shown}; the others have {common})")


def raise_on_any_rank(failed: bool, local_detail: str, group: GroupLike, what: str) -> None:
    """If ``failed`` on any rank of ``group``, raise ``ValueError`` on every rank: the failing
    ranks with their ``local_detail``, the others naming the failed rank(s)."""
    agree(resolve_group(group, what), what, local_detail if failed else None)


def check_call(
    group: Group,
    what: str,
    local_error: str | None,
    fields: Callable[[], Mapping[str, Sequence[int]]] | None = None,
) -> None:
    """The check of a per-call function: in checked mode one consensus round (:func:`agree` on
    ``fields()``); otherwise a local ``local_error`` raises on this rank alone and nothing is
    exchanged (the peers then fail in the transfer itself, by an error or the group's timeout).
    """
    if _check.get() == "call" and group.world > 1:
        agree(group, what, local_error, None if fields is None or local_error is not None else fields())
    elif local_error is not None:
        raise ValueError(f"{what}: rank {group.rank}: {local_error}")
