"""The head split of the head-parallel strategies: every query head on exactly one rank, each
rank's query heads reading their own key/value heads in plain GQA order, as even as whole
groups allow."""

from __future__ import annotations

import pytest

from cpshard.attention.head_split import split_heads


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize(
    ("q_heads", "kv_heads"), [(1, 1), (3, 3), (4, 2), (6, 3), (8, 1), (12, 4), (32, 8), (5, 5)]
)
def test_every_rank_attends_plain_gqa(q_heads: int, kv_heads: int, world: int) -> None:
    split = split_heads(q_heads, kv_heads, world)
    group = q_heads // kv_heads
    owners = [r for r, (s, c) in enumerate(split.q) for _ in range(c)]
    assert sorted(h for s, c in split.q for h in range(s, s + c)) == list(range(q_heads))
    assert len(owners) == q_heads
    for (qs, qc), (ks, kc) in zip(split.q, split.kv, strict=True):
        if qc == 0:
            assert kc == 0
            continue
        assert qc % kc == 0  # plain GQA on the rank
        local = qc // kc
        for j in range(qc):  # local query head j reads local key/value head j // local
            assert (qs + j) // group == ks + j // local
    counts = [c for _, c in split.q]
    if kv_heads >= world:  # whole groups, as even as they allow
        assert max(counts) - min(counts) <= group
    else:  # a group's ranks split its query heads evenly
        assert max(counts) - min(counts) <= max(1, group // max(1, world // kv_heads))


def test_not_a_multiple_raises() -> None:
    with pytest.raises(ValueError, match="multiple"):
        split_heads(6, 4, 2)
