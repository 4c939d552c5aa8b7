"""The batch a parity check runs, and its documents as the reference runs them.

A batch is synthetic (packed documents whose lengths follow a distribution, interior-free
trailing padding), the user's collator (``module:function`` returning a batch dict, called
with the replica's index) or a saved batch (``torch.save`` of a dict). Any format
:class:`cpshard.ContextParallelSharder` reads works (``_packed_seq_ids``, restarting
``position_ids``, ``cu_seq_lens``, ...); ``labels`` are unshifted, as a causal LM takes them
(``input_ids`` where absent).

The reference's targets are stated here independently of cpshard: a token's target is the
next token's label within its document; a document's last token has none.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cpshard.batch.documents import document_ids
from cpshard.parity.models import load_object

IGNORE = -100


@dataclass(frozen=True)
class BatchSpec:
    """Which batch: ``lengths`` a distribution (``uniform:LO-HI``, ``lognormal:MU,SIGMA`` or
    ``fixed:N,N,...``), ``docs`` documents per row, ``rows`` rows; or ``source``: a saved
    batch's path or a ``module:function`` collator (then the others are unused)."""

    lengths: str = "uniform:1-24"
    docs: int = 4
    rows: int = 2
    source: str | None = None
    seed: int = 0


def _lengths(spec: BatchSpec, g: torch.Generator) -> list[int]:
    kind, _, args = spec.lengths.partition(":")
    try:
        if kind == "uniform":
            lo, hi = (int(x) for x in args.split("-"))
            if not 1 <= lo <= hi:
                raise ValueError
            return torch.randint(lo, hi + 1, (spec.docs,), generator=g).tolist()
        if kind == "lognormal":
            mu, sigma = (float(x) for x in args.split(","))
            z = torch.randn(spec.docs, generator=g, dtype=torch.float64)
            return [max(1, round(float(v))) for v in torch.exp(mu + sigma * z)]
        if kind == "fixed":
            values = [int(x) for x in args.split(",")]
            if not values or min(values) < 1:
                raise ValueError
            return [values[i % len(values)] for i in range(spec.docs)]
    except ValueError:
        pass
    raise ValueError(
        "lengths: expected uniform:LO-HI, lognormal:MU,SIGMA or fixed:N,N,..., "
        f"got {spec.lengths!r}"
    )


def check_lengths(text: str) -> str:
    """``text`` when it is a ``lengths`` distribution :func:`synthetic_batch` reads, else
    ``ValueError`` saying the forms."""
    _lengths(BatchSpec(lengths=text, docs=1), torch.Generator().manual_seed(0))
    return text


def synthetic_batch(spec: BatchSpec, vocab: int, replica: int = 0) -> dict[str, torch.Tensor]:
    """``spec.rows`` rows of ``spec.docs`` packed documents each (ids 1, 2, ... per row, padding
    id 0 at the end of the shorter rows); random token ids in ``[1, vocab)``."""
    if spec.docs < 1 or spec.rows < 1:
        raise ValueError(f"docs and rows must be >= 1, got docs={spec.docs} rows={spec.rows}")
    g = torch.Generator().manual_seed(1000 * spec.seed + replica)
    rows = [_lengths(spec, g) for _ in range(spec.rows)]
    width = max(sum(r) for r in rows)
    doc = torch.zeros(spec.rows, width, dtype=torch.int64)
    for b, row in enumerate(rows):
        at = 0
        for k, n in enumerate(row):
            doc[b, at : at + n] = k + 1
            at += n
    ids = torch.randint(1, vocab, doc.shape, generator=g) * (doc != 0)
    return {"input_ids": ids, "labels": ids.masked_fill(doc == 0, IGNORE), "_packed_seq_ids": doc}


def make_batch(spec: BatchSpec, vocab: int, replica: int = 0) -> dict[str, Any]:
    """The batch of data-parallel replica ``replica``."""
    if spec.source is None:
        return synthetic_batch(spec, vocab, replica)
    if Path(spec.source).exists():
        batch = torch.load(spec.source, weights_only=True)
    else:
        batch = load_object(spec.source, "batch")(replica)
    if not isinstance(batch, dict) or not isinstance(batch.get("input_ids"), torch.Tensor):
        raise ValueError(f"batch: {spec.source!r} gave no dict with an input_ids tensor")
    return dict(batch)


@dataclass(frozen=True)
class Document:
    """One document of a batch: row ``row``, positions ``[start, end)``."""

    row: int
    start: int
    end: int


def documents(batch: dict[str, Any]) -> list[Document]:
    """The batch's documents (maximal runs of one non-zero document id), row by row."""
    ids = batch["input_ids"]
    doc = document_ids(batch, ids.shape[1], "cpu", ids.shape[0])
    out = []
    for b in range(doc.shape[0]):
        row = doc[b].tolist()
        start = 0
        for t in range(1, len(row) + 1):
            if t == len(row) or row[t] != row[start]:
                if row[start] != 0:
                    out.append(Document(b, start, t))
                start = t
    return out


def reference_targets(batch: dict[str, Any], doc: Document) -> torch.Tensor:
    """The targets of ``doc``'s tokens: the next token's label in the document, -100 last."""
    labels = batch.get("labels")
    labels = batch["input_ids"] if labels is None else labels
    row = labels[doc.row, doc.start : doc.end]
    out = torch.full_like(row, IGNORE)
    out[:-1] = row[1:]
    return out
