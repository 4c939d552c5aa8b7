"""A complete context-parallel training step of a tiny transformers decoder, on CPU.

    python examples/cp_decoder.py [--world 2] [--arch llama|qwen3] [--layout blockdiag|head_tail|...]

Spawns ``--world`` gloo ranks. Each builds the same tiny random Llama / Qwen3 (float64) and the
same packed batch (several documents per row, interior and trailing padding), then runs one CP
step: :func:`cpshard.make_cp_blockdiag_batch_and_ctx` (which makes per-document
``position_ids`` and shifts the labels once over the whole sequence before sharding), the
``"cpshard"`` attention,
:func:`cpshard.cp_cross_entropy` and :func:`cpshard.reduce_cp_gradients`. It prints the CP loss
(averaged over ranks) beside the single-process loss (every document run on its own) and the
largest parameter-gradient difference.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import cpshard
from cpshard.integrations import transformers as cp_transformers

IGNORE = -100
# A row is a list of document lengths; a negative entry is that many padding tokens.
ROWS = [[7, 5, -2, 6, -3], [9, -1, 4, 6, 3]]


def tiny_decoder(arch: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random-initialised causal LM (float64) with the ``"cpshard"`` attention."""
    import transformers

    cp_transformers.register()
    kwargs = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    config = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[arch](**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float64)
    model.set_attn_implementation(cp_transformers.ATTN_IMPLEMENTATION)
    return model


def runs(doc_row: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of each document (a maximal run of one non-zero id) of a row."""
    out, start = [], 0
    ids = doc_row.tolist()
    for t in range(1, len(ids) + 1):
        if t == len(ids) or ids[t] != ids[start]:
            if ids[start] != 0:
                out.append((start, t))
            start = t
    return out


def document_ids(rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """``[B, S]`` ids from row specs: documents numbered 1, 2, ... per row, 0 = padding."""
    out = []
    for row in rows:
        ids: list[int] = []
        for k, n in enumerate(row):
            ids += [0] * -n if n < 0 else [k + 1] * n
        out.append(ids)
    return torch.tensor(out, dtype=torch.int64)


def shifted_labels(input_ids: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """The reference's targets, made independently of cpshard: the next token of the same
    document, else ``-100`` (a document's last token, padding)."""
    labels = torch.full_like(input_ids, IGNORE)
    same = (doc[:, 1:] == doc[:, :-1]) & (doc[:, :-1] != 0)
    labels[:, :-1] = torch.where(same, input_ids[:, 1:], IGNORE)
    return labels


def packed_batch(rows: Sequence[Sequence[int]], vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A packed text batch as a data pipeline makes it: ``input_ids`` (pad id 0), ``labels``
    (unshifted, -100 on padding) and the document ids as ``_packed_seq_ids``. cpshard makes the
    per-document ``position_ids`` and shifts the labels once when it shards the batch."""
    doc = document_ids(rows)
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab, doc.shape, generator=g) * (doc != 0)
    return {
        "input_ids": input_ids,
        "labels": torch.where(doc == 0, IGNORE, input_ids),
        "_packed_seq_ids": doc,
    }


def reference_loss(
    model: torch.nn.Module, documents: Sequence[tuple[dict[str, Any], torch.Tensor]]
) -> torch.Tensor:
    """The single-process token-mean loss: every document run on its own through ``model``
    (``(inputs, labels)`` per document), summed cross entropy over all labelled tokens."""
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    for inputs, labels in documents:
        logits = model(**inputs).logits[0]
        total = total + F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
        count += int((labels != IGNORE).sum())
    return total / max(count, 1)


def text_documents(batch: dict[str, torch.Tensor]) -> list[tuple[dict[str, Any], torch.Tensor]]:
    """The documents of a packed text batch as separate model inputs."""
    out = []
    targets = shifted_labels(batch["input_ids"], batch["_packed_seq_ids"])
    for b in range(batch["input_ids"].shape[0]):
        for s, e in runs(batch["_packed_seq_ids"][b]):
            inputs = {"input_ids": batch["input_ids"][b : b + 1, s:e]}
            out.append((inputs, targets[b, s:e]))
    return out


def cp_loss(
    group: dist.ProcessGroup,
    batch: dict[str, torch.Tensor],
    forward: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    layout: str = "blockdiag",
    strategy: str = "auto",
    mesh: Any = None,
) -> torch.Tensor:
    """Shard ``batch`` (``layout``: ``"blockdiag"`` for the block-diagonal batch, else a
    :class:`cpshard.ContextParallelSharder` layout), run ``forward(local batch) -> logits`` under
    the CP attention and back-propagate this rank's share of the token-mean loss; returns it.
    ``strategy``: how CP attention exchanges; ``mesh``: a 2-D ``(inter, intra)`` DeviceMesh whose
    flattening is ``group``, sharded over instead of ``group`` (``"hierarchical"`` needs one)."""
    cp = group if mesh is None else mesh
    if layout == "blockdiag":
        ctx_and_batch = cpshard.make_cp_blockdiag_batch_and_ctx(cp, None, batch, strategy=strategy)
    else:
        ctx_and_batch = cpshard.ContextParallelSharder(cp, layout, strategy=strategy).shard(batch)
    train_ctx, local = ctx_and_batch
    with train_ctx():
        loss = cpshard.cp_cross_entropy(forward(local), local.targets.labels, group)
        loss.backward()
    return loss.detach()


def reference_backward(loss: torch.Tensor, model: torch.nn.Module, world: int) -> None:
    """Back-propagate the reference ``loss`` as the ranks do: scaled by the CP size (each
    rank's ``cp_cross_entropy`` is ``world`` times its share), the gradients divided back
    after. The same arithmetic, not a different answer: transformers' RMSNorm computes in
    float32, whose rounding of a gradient scaled by a non-power of two would otherwise differ
    from the ranks' by ~1e-8."""
    (loss * world).backward()
    for p in model.parameters():
        if p.grad is not None:
            p.grad.div_(world)


def compare(
    model: torch.nn.Module, reference: torch.nn.Module, cp: torch.Tensor, ref: torch.Tensor,
    group: dist.ProcessGroup,
) -> tuple[float, float, float]:
    """After both backward passes: reduce the CP gradients, then ``(CP loss averaged over ranks,
    reference loss, largest |gradient difference| over all parameters)``."""
    cpshard.reduce_cp_gradients(model, group)
    total = cp.clone().reshape(1)
    dist.all_reduce(total, group=group)
    total /= dist.get_world_size(group)
    ref_params = dict(reference.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        q = ref_params[name]
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        h = q.grad if q.grad is not None else torch.zeros_like(q)
        worst = max(worst, float((g - h).abs().max()))
    return float(total), float(ref.detach()), worst


def decoder_step(rank: int, world: int, arch: str, rows: Sequence[Sequence[int]] = ROWS,
                 seed: int = 0, layout: str = "blockdiag") -> tuple[float, float, float]:
    """One CP step of the tiny decoder on this rank (sharded as ``layout``), and the
    single-process reference."""
    group = dist.group.WORLD
    model = tiny_decoder(arch, seed)
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    batch = packed_batch(rows, model.config.vocab_size, seed)

    def forward(local: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits

    cp = cp_loss(group, batch, forward, layout)
    ref = reference_loss(reference, text_documents(batch))
    reference_backward(ref, reference, world)
    return compare(model, reference, cp, ref, group)


def run_example(step: Callable[..., tuple[float, float, float]], world: int, label: str,
                *args: Any) -> None:
    """Spawn ``world`` gloo ranks, run ``step(rank, world, *args)`` on each, print the losses."""
    from cpshard.testing import run_ranks

    cp, ref, grad = run_ranks(step, world, *args, timeout=300)[0]
    print(f"{label} W={world}: CP loss {cp:.15f}  single-process loss {ref:.15f}  "
          f"max |grad diff| {grad:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--arch", choices=("llama", "qwen3"), default="llama")
    parser.add_argument(
        "--layout", choices=("blockdiag", *cpshard.LAYOUTS), default="blockdiag",
        help="the block-diagonal batch, or a ContextParallelSharder layout",
    )
    args = parser.parse_args()
    run_example(decoder_step, args.world, f"{args.arch} {args.layout}", args.arch, ROWS, 0, args.layout)


if __name__ == "__main__":
    main()
