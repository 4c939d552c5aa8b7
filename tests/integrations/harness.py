"""The model-family tests' harness: a tiny transformers model in float64, one CP training step of
it against each document run alone, and the checks every family shares.

Imported by the ``tests/integrations`` test files as ``tests.integrations.harness`` (no test file
imports another); worker-side functions pickle by reference. What it holds:

* :func:`tiny_model`: a config's model, seeded, in float64, its norms' float64 statements bound in
  place of transformers' (which compute in float32, :func:`bind_norms`), with the ``"cpshard"``
  attention;
* :func:`step_errors`: one CP step over a packed row of documents (a sharder layout or the
  block-diagonal batch) and the reference that runs each document alone through a copy of the
  model — its attention, and the mixer function a test swaps in, as the test says — giving
  :func:`relative_step_errors`, which :func:`check_relative_errors` bounds;
* :func:`stripe_and_cache_errors` / :func:`check_stripe_and_cache_refused`: a recurrent model's
  refusals under ``stripe`` and with a cache, before its head runs;
* :func:`check_outside_cp_runs_transformers_code`: with cpshard's dispatchers installed, a model
  outside CP computes exactly what transformers' own functions compute.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import sys
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from tests.helpers import EXAMPLES, swapped

sys.path.insert(0, str(EXAMPLES))

import cp_decoder  # noqa: E402

# Documents of 9, 6, 3 and 7 tokens with interior padding: longer than the convolutions (kernel
# 4), one spanning ranks and one shorter than a shard at every W.
ROWS = [[9, -2, 6, 3, -1, 7, -1]]
# The layouts that keep each document in few pieces per rank (all but ``stripe``) and the
# block-diagonal batch: where the convolutions and recurrences are exact.
LAYOUTS = ["contiguous", "head_tail", "per_document_head_tail", "balanced", "blockdiag"]
Errors = tuple[float, float, float]  # (CP loss over ranks, reference loss, worst gradient)


def float64_rms(self, x: torch.Tensor) -> torch.Tensor:
    """An RMS norm (``weight``, ``variance_epsilon``) in the input's dtype: bound to a model's
    norms in place of transformers' (which compute in float32) for float64 references."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def tiny_model(
    config: Any,
    norms: dict[str, Callable[..., torch.Tensor]] | None = None,
    prepare: Callable[[torch.nn.Module], None] | None = None,
    attention: bool = True,
) -> torch.nn.Module:
    """``config``'s causal LM after ``register()``, parameters seeded with 0, in float64: every
    module whose class name ends with a key of ``norms`` (default: ``RMSNorm`` ->
    :func:`float64_rms`; the longest matching key wins) gets that forward, then ``prepare(module)``
    runs on each module; with ``attention``, the ``"cpshard"`` attention implementation."""
    import transformers

    from cpshard.integrations import transformers as cp_transformers

    cp_transformers.register()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float64)
    bind_norms(model, {"RMSNorm": float64_rms} if norms is None else norms)
    if prepare is not None:
        for module in model.modules():
            prepare(module)
    if attention:
        model.set_attn_implementation(cp_transformers.ATTN_IMPLEMENTATION)
    return model


def bind_norms(model: torch.nn.Module, norms: dict[str, Callable[..., torch.Tensor]]) -> None:
    """Bind ``norms[key]`` as the forward of every module of ``model`` whose class name ends
    with ``key`` (the longest such key)."""
    for module in model.modules():
        keys = [key for key in norms if type(module).__name__.endswith(key)]
        if keys:
            module.forward = norms[max(keys, key=len)].__get__(module)


class CausalLMLogits(torch.nn.Module):
    """A causal LM's logits before its head's float32 cast, ``(input_ids, position_ids) ->
    .logits`` (no cache)."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> SimpleNamespace:
        out = self.lm.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        return SimpleNamespace(logits=self.lm.lm_head(out.last_hidden_state))


class ModelLogits(torch.nn.Module):
    """A causal LM's own forward, head included, ``(input_ids, position_ids) -> .logits`` (no
    cache)."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> SimpleNamespace:
        out = self.lm(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        return SimpleNamespace(logits=out.logits)


def step_errors(
    model: torch.nn.Module,
    layout: str,
    group: dist.ProcessGroup | None = None,
    *,
    rows: Sequence[Sequence[int]] = ROWS,
    seed: int = 0,
    reference_attention: str | None = "sdpa",
    scan: tuple[str, str, Callable[..., Any]] | None = None,
    logits: type[torch.nn.Module] = CausalLMLogits,
    strategy: str = "auto",
    mesh: Any = None,
) -> Errors:
    """One CP step of ``model`` over the packed row(s) ``rows`` (token ids seeded by ``seed``)
    sharded as ``layout`` (over ``mesh`` when given, a 2-D mesh whose flattening is ``group``)
    with CP attention's ``strategy``, and the reference: each document alone through a copy of
    the model with ``reference_attention`` (None: the model's) and, when ``scan`` =
    ``(module, name, function)``, ``module.name`` swapped for ``function`` (a token-by-token
    float64 statement of the layer's mixer). ``logits`` wraps both models; returns
    :func:`relative_step_errors`."""
    group = dist.group.WORLD if group is None else group
    reference = copy.deepcopy(model)
    if reference_attention is not None:
        reference.set_attn_implementation(reference_attention)
    batch = cp_decoder.packed_batch(rows, model.config.vocab_size, seed=seed)
    cp_logits = logits(model)

    def forward(local: dict[str, torch.Tensor]) -> torch.Tensor:
        return cp_logits(local["input_ids"], local["position_ids"]).logits

    cp = cp_decoder.cp_loss(group, batch, forward, layout, strategy, mesh)
    with swapped(*scan) if scan is not None else contextlib.nullcontext():
        ref = cp_decoder.reference_loss(logits(reference), cp_decoder.text_documents(batch))
    cp_decoder.reference_backward(ref, reference, dist.get_world_size(group))
    return relative_step_errors(model, reference, cp, ref, group)


def relative_step_errors(
    model: torch.nn.Module,
    reference: torch.nn.Module,
    cp: torch.Tensor,
    ref: torch.Tensor,
    group: dist.ProcessGroup,
) -> Errors:
    """After a CP step's and its reference's backward passes: (CP loss averaged over ranks,
    reference loss, worst gradient difference relative to the largest reference gradient), the
    CP gradients reduced over ``group`` first; a gradient one side lacks counts as zeros."""
    from cpshard import reduce_cp_gradients

    reduce_cp_gradients(model, group)
    total = cp.clone().reshape(1)
    dist.all_reduce(total, group=group)
    total /= dist.get_world_size(group)
    want = dict(reference.named_parameters())
    largest = max(float(p.grad.abs().max()) for p in want.values() if p.grad is not None)
    worst = 0.0
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        h = want[name].grad if want[name].grad is not None else torch.zeros_like(p)
        worst = max(worst, float((g - h).abs().max()) / largest)
    return float(total), float(ref.detach()), worst


def check_relative_errors(
    results: list[dict[str, Errors]], world: int, loss_tol: float = 1e-9, grad_tol: float = 1e-8
) -> None:
    """Every rank's cases of :func:`relative_step_errors` within the bounds."""
    for rank, cases in enumerate(results):
        for name, (cp, ref, grad) in cases.items():
            where = f"rank {rank} W={world} {name}"
            assert abs(cp - ref) <= loss_tol * abs(ref), f"{where}: {cp!r} vs {ref!r}"
            assert grad <= grad_tol, f"{where}: gradient {grad:.2e} off"


def stripe_and_cache_errors(
    make_model: Callable[[], torch.nn.Module], rows: Sequence[Sequence[int]], cache: bool = True
) -> list[str]:
    """On this rank of the default group: the error a fresh ``make_model()`` (a transformers
    causal LM with a recurrent layer) raises under ``stripe``, then (``cache``) with a cache
    under ``balanced``, over the packed batch of ``rows`` (``" (model computed)"`` appended when
    its head ran; ``"no error"`` when none was raised)."""
    from cpshard import ContextParallelSharder

    out = []
    for layout, use_cache in (("stripe", False), ("balanced", True))[: 2 if cache else 1]:
        model = make_model()
        ran = []
        model.lm_head.register_forward_hook(lambda *a: ran.append(True))
        batch = cp_decoder.packed_batch(rows, model.config.vocab_size, seed=1)
        ctx, local = ContextParallelSharder(dist.group.WORLD, layout).shard(batch)
        with ctx():
            try:
                model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                      use_cache=use_cache)  # fmt: skip
                out.append("no error")
            except ValueError as exc:
                out.append(str(exc) + (" (model computed)" if ran else ""))
    return out


def check_stripe_and_cache_refused(results: list[list[str]], cache: bool = True) -> None:
    """Every rank's :func:`stripe_and_cache_errors` (one per model, or a pair with ``cache``)
    name the rank and the reason, and none came after the model's head ran."""
    for rank, messages in enumerate(results):
        stripes, caches = (messages[0::2], messages[1::2]) if cache else (messages, [])
        for msg in stripes:
            assert f"rank {rank}" in msg and "'stripe'" in msg, msg
        for msg in caches:
            assert f"rank {rank}" in msg and "use_cache=False" in msg, msg
        for msg in messages:
            assert "model computed" not in msg, msg


def check_outside_cp_runs_transformers_code(
    model: torch.nn.Module, modeling: str, family: Any
) -> None:
    """With cpshard's dispatchers installed, ``model`` (in training mode, the fused-kernel entry
    taken first) outside CP gives exactly what it gives with transformers' own functions of the
    module ``modeling`` (every one ``family``, a :class:`cpshard.integrations.hooks.Family`,
    hooks, the fused entries where this transformers has them), with a padding mask."""
    module = importlib.import_module(modeling)
    hooked = {*family.functions, *(name for name in family.fused if hasattr(module, name))}
    ids = torch.randint(1, 64, (2, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0

    def logits() -> torch.Tensor:
        return model.train()(input_ids=ids, attention_mask=mask, use_cache=False).logits

    dispatched = logits()
    found = {name: fn for name, fn in vars(module).items() if hasattr(fn, "cpshard_original")}
    assert set(found) == hooked, sorted(found)
    try:
        for name, fn in found.items():
            setattr(module, name, fn.cpshard_original)
        original = logits()
    finally:
        for name, fn in found.items():
            setattr(module, name, fn)
    torch.testing.assert_close(dispatched, original, rtol=0, atol=0)
