"""The CP loss and gradient rule (cpshard.loss) at W = 1-4 on gloo against one process.

A tiny model that mixes tokens across the sequence (a causal running mean over the gathered
sequence), sharded contiguously: with ``cp_cross_entropy`` + ``reduce_cp_gradients`` (``loss="mean"``)
the ranks' mean loss and every parameter gradient equal the single-process model's; ranks that
each compute the full loss average the same way; a loss of one's own whose ranks' values add up
(``loss="sum"``) sums; labels with ignored tokens, a rank without any labelled token and a batch
without any are covered, in both check modes.

The validation model (docs/validation.md): by default both functions check their local arguments
only and issue nothing but their all-reduce; in checked mode one consensus round makes every rank
raise for bad input on one rank, and for arguments that differ across ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpshard import check_mode, cp_cross_entropy, gather_sequence, reduce_cp_gradients
from tests.helpers import counting_collectives

F64 = torch.float64
V, H, B = 11, 6, 2


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.ModuleDict(
        {"emb": torch.nn.Embedding(V, H), "out": torch.nn.Linear(H, V), "unused": torch.nn.Linear(2, 2)}
    ).double()


def _forward(model, ids: torch.Tensor, group, start: int, length: int) -> torch.Tensor:
    h = model["emb"](ids)
    full = gather_sequence(h, group, seq_dim=1) if group is not None else h
    mixed = full.cumsum(1) / torch.arange(1, full.shape[1] + 1, dtype=F64).view(1, -1, 1)
    return model["out"](mixed[:, start : start + length])


def _labels(kind: str, seq: int, world: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    labels = torch.randint(0, V, (B, seq), generator=gen)
    if kind == "ignored":
        labels[:, ::3] = -100
    elif kind == "rank without labels":
        labels[:, : seq // world] = -100  # rank 0's whole shard
    elif kind == "no labels":
        labels[:] = -100
    return labels


def _check(rank: int, world: int) -> list[str]:
    """Every label kind and rule in both check modes: the problems found (none expected)."""
    problems = []
    for mode in ("step", "call"):
        with check_mode(mode):
            problems += [f"{mode} mode: {p}" for p in _check_kinds(rank, world)]
    return problems


def _check_kinds(rank: int, world: int) -> list[str]:
    group = dist.group.WORLD
    problems = []
    seq = 4 * world
    length = seq // world
    ids = torch.randint(0, V, (B, seq), generator=torch.Generator().manual_seed(1))
    for kind in ("all", "ignored", "rank without labels", "no labels"):
        labels = _labels(kind, seq, world)
        ref_model = _model()
        logits = _forward(ref_model, ids, None, 0, seq)
        count = (labels != -100).sum()
        ref = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="sum") / max(int(count), 1)
        ref.backward()
        for rule in ("mean", "sum", "mean replicated"):
            model = _model()
            if rule != "mean replicated":
                start = rank * length
                local = _forward(model, ids[:, start : start + length], group, start, length)
                mine = labels[:, start : start + length]
                # the count all-reduced here, or given on every rank (as batch.targets carry it)
                given = count if kind == "ignored" else None
                loss = cp_cross_entropy(local, mine, group, num_labelled=given)
                if rule == "sum":  # the ranks' values add up to the loss
                    loss = loss / world
                total = loss.detach().clone()
                dist.all_reduce(total)
                if rule == "mean":
                    total /= world
            else:  # every rank computes the full loss from the gathered sequence
                local = _forward(model, ids[:, rank * length : (rank + 1) * length], group, 0, seq)
                loss = cp_cross_entropy(local, labels, None)
                total = loss.detach()
            loss.backward()
            reduce_cp_gradients(model, group, loss=rule.split()[0])
            if not torch.allclose(total, ref.detach(), rtol=0, atol=1e-12):
                problems.append(f"{kind}/{rule}: loss {float(total)} vs {float(ref)}")
            for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
                expected = q.grad if q.grad is not None else torch.zeros_like(q)
                if not torch.allclose(p.grad, expected, rtol=0, atol=1e-10):
                    problems.append(f"{kind}/{rule}: grad of {name} off by {(p.grad - expected).abs().max():.3g}")
    return problems


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_loss_and_gradients_equal_single_process(pools, world):
    for rank, problems in enumerate(pools(world).run(_check, timeout=120)):
        assert problems == [], (rank, problems)


# --------------------------------------------------------------------------- argument checks

Args = dict[str, object]


def _loss_args() -> Args:
    gen = torch.Generator().manual_seed(7)
    return {
        "logits": torch.randn(B, 3, V, dtype=F64, generator=gen),
        "labels": torch.randint(0, V, (B, 3), generator=gen),
        "ignore_index": -100,
        "num_labelled": None,
    }


def _gradient_args() -> Args:
    params = list(_model().parameters())
    for p in params[:-2]:  # the last parameters keep no gradient: zeros
        p.grad = torch.ones_like(p)
    return {"parameters": params, "loss": "mean"}


def _replace_parameter(args: Args, i: int, make: Callable[[torch.Tensor], torch.Tensor]) -> None:
    args["parameters"][i] = torch.nn.Parameter(make(args["parameters"][i].detach()))


# case -> (function, how the bad rank spoils its arguments, what the messages say). A local
# problem: the bad rank's message says it after "rank {bad}: ", the others name rank {bad}; a
# cross-rank mismatch (no local check sees it): every rank says "{it} differs on rank {bad}".
LOCAL, MISMATCH = "local", "mismatch"
CASES: dict[str, tuple[str, Callable[[Args], None], str, str]] = {
    "logits_shape": ("loss", lambda a: a.update(labels=a["labels"][:, :2]), LOCAL, "logits (2, 3, 11) must be labels (2, 2)"),
    "logits_not_tensor": ("loss", lambda a: a.update(logits=[1.0]), LOCAL, "logits must be a torch.Tensor"),
    "logits_integer": ("loss", lambda a: a.update(logits=a["labels"].unsqueeze(-1).expand(B, 3, V)), LOCAL, "logits must be floating point"),
    "labels_float": ("loss", lambda a: a.update(labels=a["labels"].double()), LOCAL, "labels must be integers"),
    "ignore_index_not_int": ("loss", lambda a: a.update(ignore_index=-100.0), LOCAL, "ignore_index must be an int"),
    "num_labelled_negative": ("loss", lambda a: a.update(num_labelled=-1), LOCAL, "num_labelled must be"),
    "num_labelled_not_scalar": ("loss", lambda a: a.update(num_labelled=torch.ones(2)), LOCAL, "num_labelled must be"),
    "ignore_index_differs": ("loss", lambda a: a.update(ignore_index=0), MISMATCH, "ignore_index"),
    "labels_dtype_differs": ("loss", lambda a: a.update(labels=a["labels"].int()), MISMATCH, "labels dtype"),
    "logits_dtype_differs": ("loss", lambda a: a.update(logits=a["logits"].float()), MISMATCH, "logits dtype"),
    "vocabulary_differs": ("loss", lambda a: a.update(logits=a["logits"][..., :-1]), MISMATCH, "vocabulary size"),
    "num_labelled_on_one_rank": ("loss", lambda a: a.update(num_labelled=torch.tensor(5)), MISMATCH, "num_labelled given"),
    "loss_unknown": ("grads", lambda a: a.update(loss="average"), LOCAL, "loss must be one of"),
    "loss_old_split": ("grads", lambda a: a.update(loss="split"), LOCAL, "loss='split' is no longer a rule"),
    "parameters_not_tensors": ("grads", lambda a: a["parameters"].insert(1, "w"), LOCAL, "parameters[1] must be a tensor"),
    "parameters_lone_tensor": ("grads", lambda a: a.update(parameters=torch.ones(2)), LOCAL, "parameters must be a Module"),
    "loss_differs": ("grads", lambda a: a.update(loss="sum"), MISMATCH, "loss"),
    "parameter_frozen": ("grads", lambda a: a["parameters"][0].requires_grad_(False), MISMATCH, "trainable parameter count"),
    "parameter_shape_differs": ("grads", lambda a: _replace_parameter(a, 1, lambda p: p.t()), MISMATCH, "parameter shapes"),
    "parameter_dtype_differs": ("grads", lambda a: _replace_parameter(a, 2, lambda p: p.float()), MISMATCH, "parameter dtypes"),
}


def _call(case: str, spoil: bool, group) -> None:
    """Call the case's function with valid arguments, spoiled first where ``spoil``."""
    function, spoiler, _, _ = CASES[case]
    args = _loss_args() if function == "loss" else _gradient_args()
    if spoil:
        spoiler(args)
    if function == "loss":
        cp_cross_entropy(group=group, **args)
    else:
        reduce_cp_gradients(group=group, **args)


def _every_case_bad_on_one_rank(
    rank: int, world: int, bad: int, mode: str, functions: tuple[str, ...]
) -> dict[str, tuple[str, str]]:
    """In check ``mode``: each case of ``functions`` once, spoiled on rank ``bad``; what this
    rank raised, per case. Every rank raising keeps the group in step for the next case (checked
    at the end)."""
    out = {}
    with check_mode(mode):
        for case in (c for c, (function, *_) in CASES.items() if function in functions):
            try:
                _call(case, rank == bad, dist.group.WORLD)
                out[case] = ("", "no error")
            except Exception as exc:  # noqa: BLE001 - any type is reported to the test
                out[case] = (type(exc).__name__, str(exc))
        _call("loss_unknown", False, dist.group.WORLD)  # the group is still in step
    return out


@pytest.mark.parametrize(
    "world,bad,mode,functions",
    [
        (2, 1, "call", ("loss", "grads")),
        (3, 0, "call", ("loss", "grads")),
        (4, 2, "call", ("loss", "grads")),
        # reduce_cp_gradients runs once per step: its consensus round is always on
        (3, 2, "step", ("grads",)),
    ],
)
def test_every_rank_raises(pools, world, bad, mode, functions):
    """Checked mode: both functions; default mode: reduce_cp_gradients."""
    results = pools(world).run(_every_case_bad_on_one_rank, bad, mode, functions, timeout=120)
    for case, (function, _, kind, says) in CASES.items():
        if function not in functions:
            continue
        what = "cpshard.cp_cross_entropy" if function == "loss" else "cpshard.reduce_cp_gradients"
        for rank, out in enumerate(results):
            error, message = out[case]
            assert error == "ValueError" and message.startswith(f"{what}: "), (case, rank, error, message)
            if kind == MISMATCH:
                expected = f"{says} differs on rank {bad} "
            else:
                expected = f"rank {bad}: {says}" if rank == bad else f"rank {bad} failed its checks"
            assert expected in message, (case, rank, message)


def _collectives(rank: int, world: int) -> dict[str, dict[str, int]]:
    """The torch.distributed calls of each steady-state call, in both check modes."""
    group = dist.group.WORLD
    args = _loss_args()
    model = _model()
    model["emb"].weight.grad = torch.ones_like(model["emb"].weight)
    functions = {
        "cp_cross_entropy": lambda: cp_cross_entropy(group=group, **args),
        "cp_cross_entropy given num_labelled": lambda: cp_cross_entropy(
            group=group, **dict(args, num_labelled=torch.tensor(6 * world))
        ),
        "reduce_cp_gradients": lambda: reduce_cp_gradients(model, group),
    }
    out = {}
    for mode in ("step", "call"):
        with check_mode(mode):
            for name, fn in functions.items():
                fn()  # warm-up: the steady state is what is counted
                with counting_collectives() as seen:
                    fn()
                out[f"{name} {mode}"] = dict(seen)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_default_mode_issues_only_the_reduction(pools, world):
    for counts in pools(world).run(_collectives, timeout=60):
        # default: the count's all-reduce (none when given); checked mode: one consensus round
        # (a host-channel all-to-all) more. reduce_cp_gradients (once per step): its consensus
        # round in both modes and one all-reduce of the gradients (one dtype and device)
        assert counts["cp_cross_entropy step"] == {"all_reduce": 1}, counts
        assert counts["cp_cross_entropy given num_labelled step"] == {}, counts
        for name in ("cp_cross_entropy", "cp_cross_entropy given num_labelled"):
            expected = dict(counts[f"{name} step"], all_to_all_single=1)
            assert counts[f"{name} call"] == expected, (name, counts)
        for mode in ("step", "call"):
            assert counts[f"reduce_cp_gradients {mode}"] == {
                "all_to_all_single": 1,
                "all_reduce": 1,
            }, counts


@pytest.mark.parametrize("case", [c for c, (_, _, kind, _) in CASES.items() if kind == LOCAL])
@pytest.mark.parametrize("mode", ["step", "call"])
def test_local_problem_names_rank_and_argument(case, mode):
    """A single rank (group None): in either mode a local problem raises at once, naming the
    rank and the argument."""
    with check_mode(mode), pytest.raises(ValueError, match=r"rank 0: ") as raised:
        _call(case, True, None)
    assert CASES[case][3] in str(raised.value)


def test_no_labelled_token_gives_zero():
    args = dict(_loss_args(), labels=torch.full((B, 3), -100))
    assert float(cp_cross_entropy(group=None, **args)) == 0.0
