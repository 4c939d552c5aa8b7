"""``cpshard.cp_linear_cross_entropy`` at W = 1-4 on gloo against one process, float64.

Each rank holds its tokens' final hidden states under a layout (contiguous, head-tail, stripe,
or uneven counts with an empty rank) and the LM head. The ranks' mean loss, the mean of their
weight and bias gradients, and each rank's hidden-state gradient (times W, the mean convention)
equal the plain-PyTorch loss of the whole sequence in one process: logits ``H @ W.T + b``,
soft-capped or not, summed cross entropy over the labelled tokens. On each rank the loss and its
gradients also equal :func:`cpshard.cp_cross_entropy` of the materialised logits. Labels with
ignored tokens, a rank with no labelled token, none labelled anywhere; chunks of 1 token, of a
size that does not divide the rank's tokens, and the default. Half precision is upcast per chunk.
Bad input raises naming the argument and the rank, on every rank in checked mode; the default
mode issues one all-reduce of a count (none with ``num_labelled``) and reads no tensor on the host.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpshard import check_mode, cp_cross_entropy, cp_linear_cross_entropy, local_token_global_indices
from tests.helpers import counting_collectives, recording_host_reads

F64 = torch.float64
V, H, B, S = 13, 6, 2, 24
LAYOUTS = ("contiguous", "head_tail", "stripe", "uneven")
KINDS = ("all", "ignored", "rank without labels", "no labels")
# (softcap, bias, chunk_tokens): chunks of 1, of 5 (no rank's token count is a multiple), default
HEADS = ((None, False, 1), (30.0, False, 5), (None, True, None), (2.0, True, 5))


def _uneven_counts(world: int) -> list[int]:
    """Per-rank token counts of each batch row, summing to S, rank 1 (when there) holding none."""
    return {1: [S], 2: [17, 7], 3: [15, 0, 9], 4: [11, 0, 6, 7]}[world]


def _positions(layout: str, rank: int, world: int) -> torch.Tensor:
    """The sequence positions this rank holds."""
    if layout != "uneven":
        return local_token_global_indices(layout, rank, world, S)
    counts = _uneven_counts(world)
    start = sum(counts[:rank])
    return torch.arange(start, start + counts[rank])


def _data(kind: str, softcap: float | None, bias: bool) -> tuple[torch.Tensor, ...]:
    """The whole batch's hidden states ``[B, S, H]``, labels ``[B, S]``, head weight and bias."""
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(B, S, H, dtype=F64, generator=gen) * 2
    weight = torch.randn(V, H, dtype=F64, generator=gen)
    b = torch.randn(V, dtype=F64, generator=gen) if bias else None
    labels = torch.randint(0, V, (B, S), generator=gen)
    if kind == "ignored":
        labels[:, ::3] = -100
    elif kind == "rank without labels":
        labels[:, :12] = -100  # rank 0's tokens under contiguous / uneven layouts
    elif kind == "no labels":
        labels[:] = -100
    return hidden, labels, weight, b


def _reference(
    hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, bias, softcap
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The single-process token-mean loss and its gradients (hidden, weight[, bias])."""
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias) if t is not None]
    logits = leaves[0] @ leaves[1].T + (leaves[2] if bias is not None else 0)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    count = (labels != -100).sum().clamp(min=1)
    loss = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="sum") / count
    return loss.detach(), list(torch.autograd.grad(loss, leaves))


def _mean(t: torch.Tensor, world: int) -> torch.Tensor:
    t = t.detach().clone().contiguous()
    dist.all_reduce(t)
    return t / world


def _check(rank: int, world: int) -> list[str]:
    """Every layout, label kind and head: the problems found (none expected)."""
    problems = []
    group = dist.group.WORLD
    for layout in LAYOUTS:
        mine = _positions(layout, rank, world)
        for kind in KINDS:
            for softcap, bias, chunk in HEADS:
                hidden, labels, weight, b = _data(kind, softcap, bias)
                ref, ref_grads = _reference(hidden, labels, weight, b, softcap)
                given = (labels != -100).sum() if bias else None
                leaves = [t.clone().requires_grad_() for t in (hidden[:, mine], weight, b) if t is not None]
                loss = cp_linear_cross_entropy(
                    leaves[0], leaves[1], labels[:, mine], group, num_labelled=given,
                    bias=leaves[2] if bias else None, softcap=softcap, chunk_tokens=chunk,
                )  # fmt: skip
                grads = torch.autograd.grad(loss, leaves)
                # the same rank's loss from its materialised logits
                plain = [t.clone().requires_grad_() for t in leaves]
                logits = plain[0] @ plain[1].T + (plain[2] if bias else 0)
                if softcap is not None:
                    logits = softcap * torch.tanh(logits / softcap)
                plain_loss = cp_cross_entropy(logits, labels[:, mine], group, num_labelled=given)
                plain_grads = torch.autograd.grad(plain_loss, plain)
                case = f"{layout}/{kind}/softcap={softcap}/bias={bias}/chunk={chunk}"
                mean = _mean(loss, world)
                if not torch.allclose(mean, ref, rtol=0, atol=1e-12):
                    problems.append(f"{case}: loss {float(mean)} vs {float(ref)}")
                if not torch.allclose(loss.detach(), plain_loss.detach(), rtol=0, atol=1e-12):
                    problems.append(f"{case}: rank loss {float(loss)} vs cp_cross_entropy's {float(plain_loss)}")
                expected = [ref_grads[0][:, mine] * world] + ref_grads[1:]
                for name, got, want, direct in zip(("hidden", "weight", "bias"), grads, expected, plain_grads):
                    reduced = got if name == "hidden" else _mean(got, world)
                    if not torch.allclose(reduced, want, rtol=0, atol=1e-11):
                        problems.append(f"{case}: grad {name} off by {(reduced - want).abs().max():.3g}")
                    if not torch.allclose(got, direct, rtol=0, atol=1e-11):
                        problems.append(f"{case}: grad {name} vs cp_cross_entropy's off by {(got - direct).abs().max():.3g}")
    return problems


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_loss_and_gradients_equal_single_process(pools, world):
    for rank, problems in enumerate(pools(world).run(_check, timeout=300)):
        assert problems == [], (rank, problems[:20])


def test_only_needed_gradients_and_leading_dims():
    """A frozen head (no weight gradient), hidden states of any leading shape, and a head that
    only the weight trains: the same as the materialised loss."""
    hidden, labels, weight, _ = _data("ignored", None, False)
    h = hidden.clone().requires_grad_()
    loss = cp_linear_cross_entropy(h, weight, labels, None, chunk_tokens=4)
    ref = cp_cross_entropy(h @ weight.T, labels, None)
    (got,), (want,) = torch.autograd.grad(loss, [h]), torch.autograd.grad(ref, [h])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    w = weight.clone().requires_grad_()
    flat = hidden.reshape(4, 12, H)
    loss = cp_linear_cross_entropy(flat, w, labels.reshape(4, 12), None)
    ref = cp_cross_entropy(flat @ w.T, labels.reshape(4, 12), None)
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-13)
    (got,), (want,) = torch.autograd.grad(loss, [w]), torch.autograd.grad(ref, [w])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_is_upcast_per_chunk(dtype):
    """The head's matmul in the inputs' dtype, each chunk's logits in float32: the float32
    loss of those logits, and gradients in the inputs' dtypes."""
    hidden, labels, weight, _ = _data("ignored", None, False)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    loss = cp_linear_cross_entropy(*leaves, labels, None, softcap=30.0, chunk_tokens=7)
    assert loss.dtype == torch.float32
    grads = torch.autograd.grad(loss, leaves)
    assert [g.dtype for g in grads] == [dtype, dtype]
    plain = [t.clone().requires_grad_() for t in leaves]
    logits = (plain[0] @ plain[1].T).float()
    ref = cp_cross_entropy(30.0 * torch.tanh(logits / 30.0), labels, None)
    ref_grads = torch.autograd.grad(ref, plain)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(loss, ref, rtol=tol, atol=tol)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_default_chunk_follows_the_bytes_budget():
    from cpshard.linear_loss import chunk_size

    assert chunk_size(4096, 152064, torch.bfloat16, 64 * 2**20) == 110  # float32 logits
    assert chunk_size(4096, 152064, torch.float64, 64 * 2**20) == 55
    assert chunk_size(10, 152064, torch.float32, 64 * 2**20) == 10
    assert chunk_size(4096, 152064, torch.float32, 1) == 1


def test_no_labelled_token_gives_zero_and_zero_gradients():
    hidden, labels, weight, _ = _data("no labels", None, False)
    leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    loss = cp_linear_cross_entropy(*leaves, labels, None)
    assert float(loss.detach()) == 0.0
    assert all(not g.any() for g in torch.autograd.grad(loss, leaves))


# --------------------------------------------------------------------------- argument checks

Args = dict[str, object]


def _args() -> Args:
    hidden, labels, weight, bias = _data("ignored", None, True)
    return {"hidden": hidden[:, :3], "weight": weight, "labels": labels[:, :3], "bias": bias}


# case -> (how the bad rank spoils its arguments, what the messages say)
CASES: dict[str, tuple[Callable[[Args], None], str]] = {
    "hidden_not_tensor": (lambda a: a.update(hidden=[1.0]), "hidden must be a torch.Tensor"),
    "hidden_vs_weight": (lambda a: a.update(hidden=a["hidden"][..., :-1]), "hidden (2, 3, 5) must end in weight's H = 6"),
    "hidden_vs_labels": (lambda a: a.update(labels=a["labels"][:, :2]), "hidden (2, 3, 6) must be labels (2, 2) + [H]"),
    "weight_not_2d": (lambda a: a.update(weight=a["weight"][0]), "weight must be [V, H]"),
    "weight_dtype": (lambda a: a.update(weight=a["weight"].float()), "weight is torch.float32 but hidden torch.float64"),
    "hidden_integer": (lambda a: a.update(hidden=a["labels"].unsqueeze(-1).expand(B, 3, H)), "hidden must be floating point"),
    "bias_shape": (lambda a: a.update(bias=a["bias"][:-1]), "bias (12,) must be [V] = (13,)"),
    "labels_float": (lambda a: a.update(labels=a["labels"].double()), "labels must be integers"),
    "softcap_negative": (lambda a: a.update(softcap=-1.0), "softcap must be a number > 0"),
    "chunk_tokens_zero": (lambda a: a.update(chunk_tokens=0), "chunk_tokens must be an int >= 1"),
    "chunk_bytes_float": (lambda a: a.update(chunk_bytes=1.5), "chunk_bytes must be an int >= 1"),
    "num_labelled_negative": (lambda a: a.update(num_labelled=-1), "num_labelled must be"),
    "ignore_index_not_int": (lambda a: a.update(ignore_index=-100.0), "ignore_index must be an int"),
}


def _call(case: str | None, spoil: bool, group) -> None:
    args = _args()
    if spoil and case is not None:
        CASES[case][0](args)
    cp_linear_cross_entropy(group=group, **args)


@pytest.mark.parametrize("case", CASES)
def test_local_problem_names_rank_and_argument(case):
    with pytest.raises(ValueError, match=r"cpshard.cp_linear_cross_entropy: rank 0: ") as raised:
        _call(case, True, None)
    assert CASES[case][1] in str(raised.value)


def _every_case_bad_on_one_rank(rank: int, world: int, bad: int) -> dict[str, str]:
    """Checked mode: each case spoiled on rank ``bad``, and a softcap differing there; what this
    rank raised per case."""
    out = {}
    spoilers = dict(CASES, softcap_differs=(lambda a: a.update(softcap=5.0), ""))
    with check_mode("call"):
        for case, (spoiler, _) in spoilers.items():
            args = _args()
            if rank == bad:
                spoiler(args)
            try:
                cp_linear_cross_entropy(group=dist.group.WORLD, **args)
                out[case] = "no error"
            except ValueError as exc:
                out[case] = str(exc)
        _call(None, False, dist.group.WORLD)  # the group is still in step
    return out


def test_every_rank_raises_in_checked_mode(pools):
    bad = 1
    for rank, out in enumerate(pools(3).run(_every_case_bad_on_one_rank, bad, timeout=120)):
        for case, (_, says) in CASES.items():
            expected = f"rank {bad}: {says}" if rank == bad else f"rank {bad} failed its checks"
            assert expected in out[case], (case, rank, out[case])
        assert "softcap differs on rank 1" in out["softcap_differs"], (rank, out["softcap_differs"])


def _collectives_and_host_reads(rank: int, world: int) -> dict[str, object]:
    group = dist.group.WORLD
    args = _args()
    leaves = {k: v.clone().requires_grad_() for k, v in args.items() if k != "labels"}
    out: dict[str, object] = {}
    for name, extra in (("counted", {}), ("given", {"num_labelled": torch.tensor(7)})):
        cp_linear_cross_entropy(group=group, labels=args["labels"], **leaves, **extra)  # warm-up
        reads: list[str] = []
        with counting_collectives() as seen, recording_host_reads(reads, ()):
            loss = cp_linear_cross_entropy(
                group=group, labels=args["labels"], chunk_tokens=2, **leaves, **extra
            )
            loss.backward()
        out[name] = dict(seen)
        out[f"{name} reads"] = reads
    return out


def test_default_mode_issues_only_the_count_and_reads_nothing_on_the_host(pools):
    for out in pools(2).run(_collectives_and_host_reads, timeout=60):
        assert out["counted"] == {"all_reduce": 1}, out
        assert out["given"] == {}, out
        assert out["counted reads"] == [] and out["given reads"] == [], out
