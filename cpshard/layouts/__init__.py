"""Shard layouts: which global token positions each CP rank holds (pure functions, no collectives).

A layout maps the positions ``0 .. P-1`` of a padded sequence of length ``P`` to ranks; every rank
holds its positions **in ascending order**, and every layout gives every rank the same number
``L = P / W`` of positions (of every row), so that un-sharding is one equal all-gather followed by
one index gather with the inverse permutation.

==========================  =====================================================  ============
layout (aliases)            rank r holds                                           P multiple of
==========================  =====================================================  ============
``contiguous``              ``[r L, (r+1) L)``                                     ``W``
(``sequential``)
``head_tail``               chunks of ``P / C`` tokens dealt in a serpentine:      ``C``
(``zigzag``,                chunk ``k`` of pass ``t = k // W`` goes to ``k % W``
``round_robin``)            on even passes, ``W - 1 - k % W`` on odd ones; with
                            the default ``C = 2W``: chunks ``r`` and ``2W-1-r``
``stripe``                  positions ``i`` with ``i % W == r``                    ``W``
``per_document_head_tail``  zig-zag inside every document of a packed row;         ``W``
                            data-dependent
``balanced``                documents split so that the per-rank causal cost is    ``W``
                            balanced; data-dependent
==========================  =====================================================  ============

Every layout is one strategy object in a module of its own (:mod:`~cpshard.layouts.contiguous`,
:mod:`~cpshard.layouts.head_tail`, :mod:`~cpshard.layouts.stripe`,
:mod:`~cpshard.layouts.per_document_head_tail`, :mod:`~cpshard.layouts.balanced`), each a
:class:`~cpshard.layouts.base.LayoutStrategy` composed of that layout's formulas or planner;
:mod:`~cpshard.layouts.registry` maps names and aliases to them. The first three are
closed-form: :func:`local_token_global_indices` and :func:`rank_major_inverse` compute them from
the sizes alone. The data-dependent ones are planned from the batch's document ids by
:func:`make_layout`, identically on every rank, and their indices travel in the
:class:`ShardLayout`.
"""

from cpshard.batch.runs import document_runs
from cpshard.layouts.balanced import plan_balanced
from cpshard.layouts.base import LayoutStrategy
from cpshard.layouts.costs import attended_pairs, rank_costs, token_costs
from cpshard.layouts.indices import local_token_global_indices, rank_major_inverse, token_owner
from cpshard.layouts.make import make_layout
from cpshard.layouts.owners import owner_to_indices
from cpshard.layouts.per_document_head_tail import plan_per_document_head_tail
from cpshard.layouts.record import ShardLayout
from cpshard.layouts.registry import (
    CLOSED_FORM_LAYOUTS,
    DATA_DEPENDENT_LAYOUTS,
    LAYOUT_ALIASES,
    LAYOUTS,
    canonical_layout_name,
    is_closed_form,
    layout_strategy,
    lookup,
)
from cpshard.layouts.sizes import pad_multiple, padded_seq_len, resolve_num_chunks

__all__ = [
    "CLOSED_FORM_LAYOUTS",
    "DATA_DEPENDENT_LAYOUTS",
    "LAYOUTS",
    "LAYOUT_ALIASES",
    "LayoutStrategy",
    "ShardLayout",
    "attended_pairs",
    "canonical_layout_name",
    "document_runs",
    "is_closed_form",
    "layout_strategy",
    "local_token_global_indices",
    "lookup",
    "make_layout",
    "owner_to_indices",
    "pad_multiple",
    "padded_seq_len",
    "plan_balanced",
    "plan_per_document_head_tail",
    "rank_costs",
    "rank_major_inverse",
    "resolve_num_chunks",
    "token_costs",
    "token_owner",
]
