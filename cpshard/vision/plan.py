"""Planning vision frames across CP ranks: pure functions of sizes (no collectives, no state).

* :func:`plan_contiguous` — the optimal contiguous partition of weighted entries over ranks
  (minimum bottleneck), with a stated deterministic tie-break.
* :func:`frame_costs`, :func:`resolve_cost_alpha`, :func:`vision_hidden_size` — the cost model
  ``p * (p + alpha)`` per frame unit of ``p`` patch rows.
* :func:`plan_vision_frames` — everything :func:`~cpshard.vision.maybe_distribute_visual` needs
  to know about a pack (which frames each rank runs, its local grid, its token count, its
  padding), derived identically on every rank from the host copy of ``grid_thw``.
"""

from __future__ import annotations

import itertools
import math
import numbers
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from cpshard.vision.attributes import MODULE_WRAPPERS, attribute

__all__ = [
    "VisionFramePlan",
    "frame_costs",
    "plan_contiguous",
    "plan_vision_frames",
    "rank_costs",
    "resolve_cost_alpha",
    "vision_hidden_size",
]

# ------------------------------------------------------------------ costs in, exact ints out


def _check_world(world: object, what: str) -> int:
    if isinstance(world, bool) or not isinstance(world, numbers.Integral):
        raise TypeError(f"{what}: world must be an int, got {type(world).__name__}")
    if world < 1:
        raise ValueError(f"{what}: world must be >= 1, got {world}")
    return int(world)


def _exact_costs(costs: object, what: str) -> list[int]:
    """``costs`` as a list of positive Python ints. Floats are scaled EXACTLY to ints (a float is
    a dyadic rational; all of them are multiplied by the largest denominator), so the planner is
    exact (and therefore truly optimal) for any finite positive real costs."""
    if isinstance(costs, torch.Tensor):
        if costs.dim() != 1:
            raise ValueError(f"{what}: costs must be 1-D, got shape {tuple(costs.shape)}")
        if costs.dtype == torch.bool or costs.is_complex():
            raise TypeError(f"{what}: costs must be real numbers, got a {costs.dtype} tensor")
        costs = costs.tolist()
    elif isinstance(costs, (str, bytes)) or not isinstance(costs, Iterable):
        raise TypeError(f"{what}: costs must be a sequence of positive numbers, got {type(costs).__name__}")
    out = costs if type(costs) is list else list(costs)
    if not set(map(type, out)) - {int}:  # the fast path: plain ints
        if out and min(out) <= 0:
            i = next(i for i, c in enumerate(out) if c <= 0)
            raise ValueError(f"{what}: costs must be positive, but costs[{i}] = {out[i]}")
        return out
    out = list(out)
    for i, c in enumerate(out):
        if isinstance(c, bool) or not isinstance(c, numbers.Real):
            raise TypeError(f"{what}: costs[{i}] must be a real number, got {type(c).__name__} ({c!r})")
        c = int(c) if isinstance(c, numbers.Integral) else float(c)
        if isinstance(c, float) and not math.isfinite(c):
            raise ValueError(f"{what}: costs[{i}] = {c} is not finite")
        if c <= 0:
            raise ValueError(f"{what}: costs must be positive, but costs[{i}] = {c}")
        out[i] = c
    ratios = [c.as_integer_ratio() if isinstance(c, float) else (c, 1) for c in out]
    den = max(d for _, d in ratios)  # every denominator is a power of two: each divides den
    return [num * (den // d) for num, d in ratios]


# ------------------------------------------------------------------ the optimal planner


def _reach_back(prefix: list[int], limit: int, e: int, step: int) -> int:
    """The smallest ``i`` in ``[0, e)`` with ``prefix[i] >= limit`` (given ``prefix[e-1] >= limit``):
    a galloping search backward from ``e`` (first window: ``step`` entries), so that it touches
    memory near ``e`` only (a full-range bisect of a long list misses the cache at each step)."""
    lo = e - step
    while lo >= 0 and prefix[lo] >= limit:
        step += step
        lo = e - step
    return bisect_left(prefix, limit, lo if lo > 0 else 0, e)


def _probe(
    prefix: list[int], n: int, world: int, bound: int, low: list[int], high: list[int]
) -> tuple[bool, int, list[int]]:
    """Greedy feasibility of ``bound`` (needs ``bound >= max(costs)``): each rank in turn takes
    as many entries as fit; ``seps[p]`` is where rank ``p`` ends (``n`` once all are taken).

    Greedy separators grow with the bound, so ``low``/``high`` — the separators of probes at a
    smaller and a larger bound — bracket each one: every search runs in a window of about the
    entries one rank takes, not over the whole list.

    Returns ``(True, m, seps)`` when the ranks cover every entry, ``m`` being the largest rank
    cost built (a feasible bound <= ``bound`` whose greedy builds the same segments). Otherwise
    ``(False, m, seps)``: every bound in ``[bound, m)`` is infeasible as well, ``m`` being the
    smallest bound that would change one of the segments built.
    """
    seps = [n] * (world + 1)
    seps[0] = 0
    i = 0
    pi = 0
    largest = 0
    smallest_ext = -1
    bis = bisect_right
    for p in range(1, world + 1):
        lp = low[p]
        j = bis(prefix, pi + bound, lp if lp > i else i + 1, high[p] + 1) - 1
        pj = prefix[j]
        if pj - pi > largest:
            largest = pj - pi
        seps[p] = i = j
        if j == n:
            return True, largest, seps
        ext = prefix[j + 1] - pi
        if smallest_ext < 0 or ext < smallest_ext:
            smallest_ext = ext
        pi = pj
    return False, smallest_ext, seps


def _optimal_bound(prefix: list[int], n: int, world: int, largest_cost: int) -> tuple[int, list[int]]:
    """The minimum over contiguous partitions (every rank >= 1 entry) of the largest rank cost,
    and the greedy separators at that bound.

    A search on the bound whose probes are greedy fits (:func:`_probe`): a feasible probe lowers
    ``hi`` to the largest rank cost it actually built, an infeasible one raises ``lo`` to the
    smallest bound that could change its outcome, so ``lo <= optimum <= hi`` throughout, and the
    loop ends on the optimum after O(log range) probes (about a dozen in practice), each cheaper
    than the last as the separator windows close in. ``lo`` starts at the trivial lower bound
    ``max(largest cost, total / world)``.
    """
    total = prefix[n]
    mean = -(-total // world)
    lo = max(largest_cost, mean)
    # Feasible: with this bound each of the first world-1 greedy ranks takes >= mean (the next
    # entry, <= largest_cost, did not fit), which leaves <= mean <= bound for the last one.
    hi = max(lo, mean + largest_cost - 1)
    low = [min(p, n) for p in range(world + 1)]  # each rank takes >= 1 entry
    high = None
    # The optimum is usually within an average entry's cost of the mean: gallop up from lo in
    # steps of that size until a probe is feasible, then bisect. But an entry costlier than a
    # rank's mean share (a large image) is often the optimum itself: then lo is probed first.
    step = max(1, -(-total // n))
    mid = lo if largest_cost > mean else min(lo + step - 1, hi)
    while True:
        ok, m, seps = _probe(prefix, n, world, mid, low, high or [n] * (world + 1))
        if ok:
            hi, high, step = m, seps, 0
        else:
            lo, low, step = m, seps, 2 * step
        if high is not None and lo >= hi:
            return hi, high
        mid = min(lo + step - 1, hi) if step else (lo + hi) // 2


def _cuts_for_bound(prefix: list[int], n: int, world: int, bound: int, greedy: list[int]) -> list[int]:
    """The tie-break: among the partitions whose largest rank cost is <= ``bound``, place each
    cut in rank order at the feasible position whose prefix cost is nearest the quantile
    ``total * r / world`` (ties toward the smaller index).

    ``first[k]`` is the smallest index from which the last ``k`` ranks can cover the rest within
    ``bound`` (backward greedy); cut ``r`` may lie anywhere in
    ``[max(cuts[r-1] + 1, first[world - r]), min(forward reach, n - (world - r))]``, an interval
    that is never empty and from every point of which the plan can be completed. The greedy
    separators at ``bound`` (``greedy``) cap every forward reach, so its search window is small.
    """
    total = prefix[n]
    step = max(2, 2 * n // world)
    first = [n] * world
    for k in range(1, world):
        e = first[k - 1]
        first[k] = _reach_back(prefix, prefix[e] - bound, e, step)
        step = max(2, 2 * (e - first[k]))
    cuts = [0]
    for r in range(1, world):
        c = cuts[-1]
        rest = world - r
        a = max(c + 1, first[rest])
        b = min(bisect_right(prefix, prefix[c] + bound, c + 1, greedy[r] + 1) - 1, n - rest)
        target = total * r  # compare prefix[x] * world with it: exact
        j = bisect_left(prefix, -(-target // world), a, b + 1)  # first x with prefix[x]*world >= target
        if j > b or (j > a and target - prefix[j - 1] * world <= prefix[j] * world - target):
            j -= 1
        cuts.append(j)
    cuts.append(n)
    return cuts


def plan_contiguous(costs: Sequence[float] | torch.Tensor, world: int) -> list[int] | None:
    """Partition entries with positive ``costs`` into ``world`` contiguous, non-empty groups so
    that the largest group cost is as small as possible.

    Returns cut points ``cuts`` (length ``world + 1``, ``cuts[0] = 0``, ``cuts[-1] = n``): rank
    ``r`` owns entries ``[cuts[r], cuts[r+1])``. Returns ``None`` when there are fewer entries
    than ranks (the caller then needs dummy work or the replicated path).

    * **Optimal**: ``max_r sum(costs[cuts[r]:cuts[r+1]])`` is the minimum over all contiguous
      partitions with every rank non-empty (exact, also for float costs, which are scaled
      exactly to integers).
    * **Deterministic** tie-break among the optimal partitions: cuts are placed in rank order,
      each at the position whose prefix cost is nearest the prefix quantile
      ``total * r / world`` among the positions from which an optimal plan can still be
      completed (ties toward the smaller index).
    * **Fast**: ``O(n + world * log(n) * probes)``, about a dozen probes (greedy fits at a trial
      bound, each searching only a window of entries); 100 000 entries on 1 024 ranks plan in
      tens of milliseconds (``cpshard bench --ops planner``).

    Raises ``TypeError`` for non-numeric costs or world, ``ValueError`` for non-positive or
    non-finite costs or ``world < 1``.
    """
    what = "cpshard.plan_contiguous"
    world = _check_world(world, what)
    exact = _exact_costs(costs, what)
    n = len(exact)
    if n < world:
        return None
    if world == 1:
        return [0, n]
    prefix = list(itertools.accumulate(exact, initial=0))
    bound, greedy = _optimal_bound(prefix, n, world, max(exact))
    return _cuts_for_bound(prefix, n, world, bound, greedy)


def rank_costs(costs: Sequence[float], cuts: Sequence[int]) -> list[float]:
    """The cost each rank carries under ``cuts``: ``[sum(costs[cuts[r]:cuts[r+1]]) for r]``."""
    return [sum(costs[a:b]) for a, b in itertools.pairwise(cuts)]


# ------------------------------------------------------------------ cost model


def frame_costs(patch_rows: Iterable[int], alpha: int) -> list[int]:
    """Per-frame-unit cost ``p * (p + alpha)``: quadratic per-frame attention plus ``alpha``
    times the linear per-patch work (projections, MLP). ``p`` = a frame's patch rows (``h*w``;
    the ``t`` frames of an entry are separate units)."""
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Integral) or alpha < 0:
        raise ValueError(f"cpshard.frame_costs: alpha must be an int >= 0, got {alpha!r}")
    out = []
    for i, p in enumerate(patch_rows):
        if isinstance(p, bool) or not isinstance(p, numbers.Integral) or p <= 0:
            raise ValueError(f"cpshard.frame_costs: patch_rows[{i}] must be an int > 0, got {p!r}")
        out.append(int(p) * (int(p) + int(alpha)))
    return out


_VISION_WIDTH_FIELDS = ("vision_hidden_size", "vit_hidden_size", "embed_dim")
_VISION_CHILDREN = (
    "vision_config", "visual", "vision_tower", "vision_model", "vision_encoder", "vit",
    "radio_model", "patch_generator",
)
_WRAPPERS = ("config", *MODULE_WRAPPERS, "model")  # a VLM keeps its config and inner model too
_GENERIC_WIDTH_FIELDS = ("hidden_size", "d_model")
_MAX_DEPTH = 6
_LEAVES = (str, bytes, numbers.Number, torch.Tensor)


def _positive_int(value: object) -> int | None:
    """A width written as an int, an integral float (``1024.0``), a 0-d integer tensor or a
    numeric string (``"1024"``, as configs loaded from YAML/JSON may hold it); None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        text = value.strip()
        value = int(text) if text.isdecimal() else None
    elif isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        value = int(value) if math.isfinite(value) and float(value).is_integer() else None
    elif isinstance(value, torch.Tensor):  # a 0-d integer tensor (a checkpointed config value)
        integral = value.dim() == 0 and not value.is_floating_point() and not value.is_complex()
        value = int(value) if integral and value.dtype != torch.bool else None
    if not isinstance(value, numbers.Integral):
        return None
    return int(value) if value > 0 else None


def _search_width(root: object, vision: bool) -> int | None:
    """Depth-first: vision-named width fields, then vision-named children (their own
    ``hidden_size`` counts), then wrappers (``config``, ``module``, ...); a generic
    ``hidden_size`` only inside a vision subtree (or when ``vision`` is given)."""
    seen: set[tuple[int, bool]] = set()

    def walk(node: object, in_vision: bool, depth: int) -> int | None:
        if node is None or depth > _MAX_DEPTH or isinstance(node, _LEAVES):
            return None
        key = (id(node), in_vision)
        if key in seen:
            return None
        seen.add(key)
        for name in _VISION_WIDTH_FIELDS:
            if (w := _positive_int(attribute(node, name))) is not None:
                return w
        for name in _VISION_CHILDREN:
            child = attribute(node, name)
            if child is not node and (w := walk(child, True, depth + 1)) is not None:
                return w
        for name in _WRAPPERS:
            child = attribute(node, name)
            if child is not node and (w := walk(child, in_vision, depth + 1)) is not None:
                return w
        if in_vision:
            for name in _GENERIC_WIDTH_FIELDS:
                if (w := _positive_int(attribute(node, name))) is not None:
                    return w
        return None

    return walk(root, vision, 0)


def vision_hidden_size(model: object) -> int | None:
    """Best-effort discovery of the vision width of ``model`` (a VLM, its vision tower, a config
    object or a mapping), without depending on class names.

    Order: explicitly vision-named width fields (``vision_hidden_size``, ``vit_hidden_size`` —
    Nemotron Omni —, ``embed_dim`` — RADIO-style towers) and nested vision modules/configs
    (``vision_config``, ``visual`` — Qwen's ``visual.config.hidden_size`` —, ``vision_tower``,
    ``vision_model``, ...; their ``hidden_size`` counts), searched through wrappers (``config``,
    ``module``, ``_orig_mod``, FSDP/checkpoint wrappers, ``model``); only when none is found, a
    ROOT ``hidden_size``/``d_model`` (of ``model`` or of its wrappers) — the right answer when
    ``model`` is the tower itself, and never preferred over a vision-named width, so a text
    model's width is not picked by accident. A width may be an int, an integral float or a
    numeric string (``{"embed_dim": "1024"}``). Returns ``None`` when nothing is found.
    """
    found = _search_width(model, vision=False)
    return found if found is not None else _search_width(model, vision=True)


def resolve_cost_alpha(cost_alpha: int | str | None, source: object = None) -> int:
    """The linear term ``alpha`` of the frame cost ``p * (p + alpha)``.

    An int >= 0 is an exact override (``0`` = pure quadratic). ``"auto"`` or ``None`` gives
    ``3 * vision_hidden_size(source)`` (the Q/K/V projections as a portable proxy for the linear
    per-patch work), or ``0`` when no width is found (or ``source`` is None).
    """
    if cost_alpha is None or (isinstance(cost_alpha, str) and cost_alpha == "auto"):
        width = vision_hidden_size(source) if source is not None else None
        return 3 * width if width is not None else 0
    if isinstance(cost_alpha, bool) or not isinstance(cost_alpha, numbers.Integral):
        raise TypeError(
            f'cpshard.resolve_cost_alpha: cost_alpha must be "auto", None or an int >= 0, got {cost_alpha!r}'
        )
    if cost_alpha < 0:
        raise ValueError(f"cpshard.resolve_cost_alpha: cost_alpha must be >= 0, got {cost_alpha}")
    return int(cost_alpha)


# ------------------------------------------------------------------ the frame plan


def grid_problem(grid: Sequence[Sequence[int]], spatial_merge_size: int) -> str | None:
    """What is wrong with host grid rows ``(t, h, w)`` for a tower with this merge size, or None."""
    m = spatial_merge_size
    for e, row in enumerate(grid):
        if len(row) != 3:
            return f"grid_thw row {e} has {len(row)} values, expected (t, h, w)"
        t, h, w = row
        if min(t, h, w) < 1:
            return f"grid_thw row {e} = {list(row)}: t, h and w must be >= 1"
        if h % m or w % m:
            return (
                f"grid_thw row {e} = {list(row)}: h and w must be multiples of the tower's "
                f"spatial_merge_size {m}"
            )
    return None


def grid_workload(grid: Sequence[Sequence[int]], spatial_merge_size: int) -> tuple[int, int, int]:
    """``(patch rows, merged tokens, frame units)`` of a pack."""
    rows = sum(t * h * w for t, h, w in grid)
    return rows, rows // (spatial_merge_size * spatial_merge_size), sum(t for t, _, _ in grid)


def _pad_frame(need_rows: int, m: int) -> tuple[int, int]:
    """A near-square ``(h, w)`` zero frame (multiples of ``m``) with at least ``need_rows`` rows."""
    k = max(1, -(-need_rows // (m * m)))  # merged tokens
    a = math.isqrt(k - 1) + 1  # ceil(sqrt(k))
    return m * a, m * (-(-k // a))


@dataclass(frozen=True)
class VisionFramePlan:
    """Which frames each rank runs. Frame units are the ``t`` frames of every entry, in entry
    order (``pixel_values`` rows are frame-contiguous in that order).

    * ``cuts``: rank ``r`` runs real units ``[cuts[r], cuts[r+1])`` (empty for a rank that only
      runs a dummy frame, when there are fewer units than ranks);
    * ``token_counts[r]``: merged tokens of rank r's real units (its block in the gather);
    * ``pad_frames[r]``: the ``(h, w)`` zero frame rank r appends (dummy or floor padding), or
      None; its tokens are dropped before the gather;
    * ``row_bounds[r]``: rank r's rows ``[p0, p1)`` of ``pixel_values``.
    """

    world: int
    spatial_merge_size: int
    unit_rows: tuple[int, ...]
    unit_entry: tuple[int, ...]
    unit_hw: tuple[tuple[int, int], ...]
    cuts: tuple[int, ...]
    token_counts: tuple[int, ...]
    pad_frames: tuple[tuple[int, int] | None, ...]
    row_bounds: tuple[tuple[int, int], ...]

    @property
    def total_tokens(self) -> int:
        return sum(self.token_counts)

    @property
    def dummy_ranks(self) -> int:
        """Ranks that own no real frame (they run a dummy frame only)."""
        return sum(1 for a, b in itertools.pairwise(self.cuts) if a == b)

    def local_grid(self, rank: int) -> list[list[int]]:
        """Rank ``rank``'s grid rows: consecutive frames of one entry merged into one
        ``(count, h, w)`` row, then the pad frame, if any, as its own ``(1, h, w)`` entry."""
        rows: list[list[int]] = []
        last = None
        for i in range(self.cuts[rank], self.cuts[rank + 1]):
            if self.unit_entry[i] == last:
                rows[-1][0] += 1
            else:
                rows.append([1, *self.unit_hw[i]])
                last = self.unit_entry[i]
        if self.pad_frames[rank] is not None:
            rows.append([1, *self.pad_frames[rank]])
        return rows

    def pad_rows(self, rank: int) -> int:
        pad = self.pad_frames[rank]
        return 0 if pad is None else pad[0] * pad[1]

    def local_tokens(self, rank: int) -> int:
        """Merged tokens the local tower call must return (real + pad frame)."""
        return self.token_counts[rank] + self.pad_rows(rank) // self.spatial_merge_size**2

    def rank_costs(self, alpha: int) -> list[int]:
        return rank_costs(frame_costs(self.unit_rows, alpha), self.cuts)


def plan_vision_frames(
    grid: Sequence[Sequence[int]],
    world: int,
    *,
    spatial_merge_size: int,
    cost_alpha: int = 0,
    min_local_patch_rows: int = 0,
    floor_dummy_frames: bool = True,
) -> VisionFramePlan:
    """Plan a pack of entries ``grid`` (host rows ``(t, h, w)``) over ``world`` ranks.

    With at least ``world`` frame units, :func:`plan_contiguous` on the unit costs
    ``p * (p + cost_alpha)``; with fewer (but at least one), one real unit per rank in order and
    a dummy ``(spatial_merge_size x spatial_merge_size)`` zero frame on each remaining rank, so
    that every rank runs the tower exactly once. A rank whose real rows fall below
    ``min_local_patch_rows`` appends a zero frame that brings it to the floor; so does a
    dummy-only rank's frame unless ``floor_dummy_frames`` is False (NeMo Automodel keeps it at
    ``spatial_merge_size**2`` rows).
    """
    what = "cpshard.plan_vision_frames"
    world = _check_world(world, what)
    m = spatial_merge_size
    if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 1:
        raise ValueError(f"{what}: spatial_merge_size must be an int >= 1, got {m!r}")
    floor = min_local_patch_rows
    if isinstance(floor, bool) or not isinstance(floor, numbers.Integral) or floor < 0:
        raise ValueError(f"{what}: min_local_patch_rows must be an int >= 0, got {min_local_patch_rows!r}")
    grid = [tuple(int(v) for v in row) for row in grid]
    if (problem := grid_problem(grid, m)) is not None:
        raise ValueError(f"{what}: {problem}")
    unit_rows, unit_entry, unit_hw = [], [], []
    for e, (t, h, w) in enumerate(grid):
        unit_rows.extend([h * w] * t)
        unit_entry.extend([e] * t)
        unit_hw.extend([(h, w)] * t)
    n = len(unit_rows)
    if n == 0:
        raise ValueError(f"{what}: the pack has no frames")
    if n >= world:
        cuts = plan_contiguous(frame_costs(unit_rows, cost_alpha), world)
    else:
        cuts = list(range(n + 1)) + [n] * (world - n)
    row_prefix = list(itertools.accumulate(unit_rows, initial=0))
    tok = m * m
    counts, pads, bounds = [], [], []
    for a, b in itertools.pairwise(cuts):
        rows = row_prefix[b] - row_prefix[a]
        counts.append(rows // tok)
        bounds.append((row_prefix[a], row_prefix[b]))
        floor_rows = min_local_patch_rows if rows or floor_dummy_frames else 0
        need = max(floor_rows - rows, 1 if rows == 0 else 0)
        pads.append(_pad_frame(need, m) if need > 0 else None)
    return VisionFramePlan(
        world=world,
        spatial_merge_size=m,
        unit_rows=tuple(unit_rows),
        unit_entry=tuple(unit_entry),
        unit_hw=tuple(unit_hw),
        cuts=tuple(cuts),
        token_counts=tuple(counts),
        pad_frames=tuple(pads),
        row_bounds=tuple(bounds),
    )
