"""Hugging Face ``Trainer`` and TRL's ``SFTTrainer`` under cpshard context parallelism, with no
patch to transformers, TRL or accelerate.

:class:`ContextParallelMixin` goes in front of any ``Trainer`` subclass; :class:`CPTrainer` is
``(ContextParallelMixin, Trainer)`` and ``CPSFTTrainer`` (:mod:`cpshard.integrations.sft`,
importable when TRL is installed) is ``(ContextParallelMixin, SFTTrainer)``. Each takes the
arguments of the class it extends plus ``cp_size``, ``layout`` and ``strategy``::

    trainer = CPSFTTrainer(model=model, args=SFTConfig(..., packing=True), cp_size=2,
                           train_dataset=ds, processing_class=tok)

The world is split into a ``(dp, cp)`` mesh (rank ``dp_index * cp + cp_index``). The mixin
selects the attention implementation ``"cpshard"``, gives every rank of a CP group the same
batches (the data loaders are sharded over the dp ranks only), shards each batch with
:class:`cpshard.ContextParallelSharder` inside the step (the hook Trainer's own
``training_step`` and ``prediction_step`` call), and runs the forward and the backward inside
the step's CP context. The Trainer's loss arithmetic stays its own: the token count
``num_items_in_batch`` is taken from the full batches, the model gets the labels shifted once
over the whole sequence as ``shift_labels``, and ``get_cp_size`` tells the Trainer that ``cp``
ranks share each batch, so each rank's loss is ``cp`` times its share and the gradient reduction
over all ``dp x cp`` ranks (DDP, FSDP2) averages to the loss of ``dp`` processes. Under CP that
loss is computed from the final hidden states by :func:`cpshard.cp_linear_cross_entropy`
(never holding the rank's logits) when the model's LM head is a plain ``nn.Linear``
(:mod:`cpshard.integrations.linear_head`), else by the model itself; ``cp_loss`` says which.

Refused, on every rank, saying what to change: a ``cp_size`` that does not divide the world,
accelerate's own context parallelism at the same time, a gradient reduction that does not span
every rank, processes that train alone (``use_cpu`` missing on CPU), a model with token mixers
cpshard does not shard, and the losses that would shift the labels again (label smoothing, a
``compute_loss_func``) or average each rank's tokens alone (a model without loss kwargs).
Evaluation reports the loss only (``prediction_loss_only``): the logits are sharded.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from cpshard.comm import Group, resolve_group
from cpshard.comm.reduce import all_reduce_sum_
from cpshard.consensus import agree
from cpshard.fingerprints import digest
from cpshard.guard.models import unsharded_mixer
from cpshard.integrations import linear_head
from cpshard.integrations import transformers as cp_transformers
from cpshard.sharder import ContextParallelSharder

try:
    from transformers import Trainer
except ImportError as exc:  # pragma: no cover - transformers is a test dependency
    raise ImportError(
        "cpshard.integrations.trainer needs transformers >= 5: pip install 'cpshard[transformers]'"
    ) from exc

__all__ = ["CPTrainer", "ContextParallelMixin"]

_WHAT = "cpshard.integrations.trainer"
_log = logging.getLogger(__name__)


class ContextParallelMixin:
    """Context parallelism for a ``transformers.Trainer`` subclass: put it first in the bases.

    Args (besides the extended class's own):
        cp_size: ranks that share each sequence (a divisor of the world size; 1 turns CP off and
            leaves the trainer unchanged).
        layout: the sharder's layout (default ``"balanced"``: documents split so that every rank's
            attention cost is even); see :class:`cpshard.ContextParallelSharder`.
        strategy: how CP attention exchanges keys and values (default ``"auto"``).
    """

    def __init__(
        self,
        *args: Any,
        cp_size: int = 1,
        layout: str = "balanced",
        strategy: str = "auto",
        **kwargs: Any,
    ) -> None:
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        _refuse_accelerate_cp(getattr(training_args, "parallelism_config", None))
        if cp_size != 1:
            _refuse_older_trainer()
        cp_transformers.register()
        self.cp_size = cp_size  # before Trainer's set-up, which may ask get_cp_size()
        super().__init__(*args, **kwargs)
        world = self.args.world_size
        problem = self._setup_problem(world)
        if world > 1 and dist.is_initialized():
            # every rank raises when any rank refuses, or when their CP settings differ
            agree(
                resolve_group(dist.group.WORLD, _WHAT),
                _WHAT,
                problem,
                {
                    "cp_size": [cp_size if isinstance(cp_size, int) else -1],
                    "layout and strategy": digest(list(f"{layout}/{strategy}".encode())),
                },
            )
        elif problem is not None:
            raise ValueError(f"{_WHAT}: rank {_launched_rank()}: {problem}")
        self._cp_group = _cp_group(world, cp_size, self.args.device.type)
        self._sharders: dict[bool, ContextParallelSharder] = {}
        self._layout, self._strategy = layout, strategy
        self._reduction_checked = False
        self.cp_loss, self.cp_loss_reason = "model", None
        if cp_size > 1:
            # fail on bad layout/strategy now, not at the first step
            self._sharder(shift_labels=True)
            self.model.set_attn_implementation(cp_transformers.ATTN_IMPLEMENTATION)
            self._choose_cp_loss()

    # ------------------------------------------------------------------ the loss

    #: The loss the extended trainer computes from the hidden states itself (TRL's fused LM
    #: head), or None: the mixin then computes it with cp_linear_cross_entropy where it can.
    _trainer_cp_loss: str | None = None

    def _choose_cp_loss(self) -> None:
        """Set ``cp_loss``: ``"cp_linear_cross_entropy"`` (the loss from the final hidden states,
        the logits never held), the extended trainer's own loss from the hidden states, or
        ``"model"`` (the model's own loss from its logits, ``cp_loss_reason`` saying why);
        install the first, and log which, once."""
        if self._trainer_cp_loss is not None:
            self.cp_loss = self._trainer_cp_loss
        else:
            self.cp_loss_reason = linear_head.head_problem(self.model)
            if self.cp_loss_reason is None:
                linear_head.install(self.model)
                self.cp_loss = "cp_linear_cross_entropy"
        because = "" if self.cp_loss_reason is None else f" ({self.cp_loss_reason})"
        _log.info("%s: the CP loss is computed by %s%s", _WHAT, self.cp_loss, because)

    def compute_loss(
        self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any
    ) -> Any:
        """The extended class's loss (its arguments passed on), asking the model for the loss
        from the hidden states where it is installed."""
        if self.cp_loss == "cp_linear_cross_entropy":
            inputs = {**inputs, linear_head.LINEAR_LOSS_KWARG: True}
        return super().compute_loss(model, inputs, *args, **kwargs)

    # ------------------------------------------------------------------ set-up checks

    def _setup_problem(self, world: int) -> str | None:
        """This rank's reason to refuse the set-up, or None."""
        cp = self.cp_size
        if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
            return f"cp_size must be an int >= 1, got {cp!r}"
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched != world:
            return (
                f"the launcher started {launched} processes but the trainer sees a world of "
                f"{world}: each process would train alone. On CPU pass use_cpu=True in the "
                "training arguments"
            )
        if world % cp:
            return f"cp_size={cp} must divide the world size {world}"
        pc = getattr(self.accelerator, "parallelism_config", None)
        accelerate_cp = _accelerate_cp_problem(pc)
        if accelerate_cp is not None:
            return accelerate_cp
        if cp == 1:
            return None
        if self.get_tp_size() > 1:
            return (
                f"tensor parallelism (tp size {self.get_tp_size()}) with cp_size={cp}: its "
                "gradients are not reduced over every rank; train with cp_size alone"
            )
        if self.args.train_sampling_strategy == "batch_rebalance":
            return (
                "train_sampling_strategy='batch_rebalance' splits batches over every rank, not "
                "over the dp ranks: choose another train_sampling_strategy under CP"
            )
        if self.args.label_smoothing_factor != 0:
            return (
                "label_smoothing_factor != 0: the label smoother shifts the labels again inside "
                "each rank's shard; set label_smoothing_factor=0 to train under CP"
            )
        if self.compute_loss_func is not None:
            return (
                "compute_loss_func: under CP it would receive this rank's shard of the labels, "
                "already shifted, and no way to count the other ranks' tokens; leave it unset"
            )
        if not self.model_accepts_loss_kwargs:
            return (
                f"{type(self.model).__name__}.forward takes no loss keyword arguments "
                "(num_items_in_batch, shift_labels): its loss would average this rank's tokens "
                "alone. Train a transformers model, or one whose forward takes **kwargs"
            )
        mixer = unsharded_mixer(self.model)
        if mixer is not None:
            return f"{type(self.model).__name__} cannot train under CP: {mixer}"
        return None

    def _check_gradient_reduction(self, model: torch.nn.Module) -> None:
        """Raise on every rank (once, at the first step) unless the wrapped model's gradient
        reduction spans all dp x cp ranks: otherwise the CP ranks' gradients, each of its
        shard, would never be added up."""
        if self._reduction_checked or self.args.world_size == 1 or self.cp_size == 1:
            return
        world = self.args.world_size
        covered = _reduced_ranks(model)
        problem = None
        if covered is None:
            problem = (
                f"the model ({type(model).__name__}) is wrapped by neither DDP nor FSDP2: no "
                "gradient reduction adds up the CP ranks' gradients"
            )
        elif covered != set(range(world)):
            problem = (
                f"the model's gradients are reduced over ranks {sorted(covered)}, not over all "
                f"{world} ranks: the CP ranks' gradients must be averaged too (DDP or FSDP2 over "
                "the whole world, the trainer's default)"
            )
        agree(resolve_group(dist.group.WORLD, _WHAT), _WHAT, problem)
        self._reduction_checked = True

    # ------------------------------------------------------------------ batches

    def _sharder(self, shift_labels: bool) -> ContextParallelSharder:
        """The sharder of the CP group (one for labels to shift, one for targets given)."""
        if shift_labels not in self._sharders:
            self._sharders[shift_labels] = ContextParallelSharder(
                self._cp_group.pg, self._layout, strategy=self._strategy, shift_labels=shift_labels
            )
        return self._sharders[shift_labels]

    def _prepare_context_parallel_inputs(
        self, model: torch.nn.Module, inputs: dict[str, Any]
    ) -> tuple[Callable[[], Any], dict[str, Any]]:
        """Trainer's CP hook (its training and prediction steps run the forward, and the
        backward, inside the returned context): this rank's shard of the batch, with the labels
        shifted once over the whole sequence as ``labels`` and ``shift_labels``."""
        if self.cp_size == 1:
            return super()._prepare_context_parallel_inputs(model, inputs)
        if model.training:
            self._check_gradient_reduction(model)
        batch = dict(inputs)
        given_targets = batch.pop("shift_labels", None)
        if given_targets is not None:
            batch["labels"] = given_targets
        ctx, local = self._sharder(shift_labels=given_targets is None).shard(batch)
        model_inputs = dict(local)
        if local.targets.labels is not None:
            model_inputs["labels"] = model_inputs["shift_labels"] = local.targets.labels
        return ctx, model_inputs

    def get_cp_size(self) -> int:
        """The ranks that share each batch: the Trainer divides the token count it gathers from
        every rank by it."""
        return self.cp_size if self.cp_size > 1 else super().get_cp_size()

    def _dp_loader(self, loader: Any) -> Any:
        """``loader`` (prepared by accelerate over every rank) sharded over the dp ranks only,
        so that the ranks of a CP group read the same batches."""
        if self.cp_size == 1:
            return loader
        dp, dp_rank = self.args.world_size // self.cp_size, self.args.process_index // self.cp_size
        shards = [
            s
            for s in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None),
                      getattr(loader, "dataset", None))  # fmt: skip
            if hasattr(s, "num_processes") and hasattr(s, "process_index")
        ]
        if not shards and self.args.world_size > 1:
            raise ValueError(
                f"{_WHAT}: rank {self.args.process_index}: the data loader "
                f"({type(loader).__name__}) is not split by accelerate's batch sampler or "
                "iterable shard, so the ranks of a CP group would not read the same batches; "
                "use a map-style dataset or a torch IterableDataset, and "
                "accelerator_config.dispatch_batches=False"
            )
        for shard in shards[:1]:
            shard.num_processes, shard.process_index = dp, dp_rank
            if dp == 1 and hasattr(shard, "even_batches"):
                # as in one process, where accelerate splits nothing: the last batch stays short
                # (evening it would repeat the first samples in it)
                shard.even_batches = False
        return loader

    def get_train_dataloader(self) -> Any:
        return self._dp_loader(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        return self._dp_loader(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        return self._dp_loader(super().get_test_dataloader(test_dataset))

    # ------------------------------------------------------------------ what is counted once

    def _track_num_input_tokens(self, inputs: Mapping[str, Any]) -> None:
        """The Trainer sums the full batch's tokens over every rank: count each CP group once."""
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        self.state.num_input_tokens_seen = before + (
            self.state.num_input_tokens_seen - before
        ) // self.cp_size

    def floating_point_ops(self, inputs: Mapping[str, Any]) -> int:
        """The step's share of the full batch's operations (the Trainer sums them over ranks)."""
        return super().floating_point_ops(inputs) // self.cp_size

    # ------------------------------------------------------------------ evaluation

    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Under CP: the loss of the rank's CP group (the mean of the ranks' shares, each
        ``cp`` times the share), on every rank of the group; logits are not returned."""
        if self.cp_size == 1:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if not prediction_loss_only:
            raise ValueError(
                f"{_WHAT}: rank {self.args.process_index}: evaluation under CP reports the loss "
                "only (each rank holds a shard of the logits): leave compute_metrics unset, or "
                "evaluate with cp_size=1"
            )
        loss = self._cp_prediction_loss(model, inputs, ignore_keys)
        if loss is None:
            return None, None, None
        group_loss = loss.detach().to(torch.float64).reshape(1).contiguous()
        all_reduce_sum_([group_loss], self._cp_group)
        return (group_loss / self.cp_size).to(loss.dtype).reshape(()), None, None

    def _cp_prediction_loss(
        self, model: torch.nn.Module, inputs: dict[str, Any], ignore_keys: list[str] | None
    ) -> torch.Tensor | None:
        """This rank's loss of an evaluation batch: Trainer's own prediction step, which
        shards the batch through the CP hook."""
        return super().prediction_step(model, inputs, True, ignore_keys)[0]

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer's evaluation loop with the losses gathered once per CP group."""
        if self.cp_size > 1:
            self.gather_function = self._gather_per_cp_group
        return super().evaluation_loop(*args, **kwargs)

    def _gather_per_cp_group(self, tensor: torch.Tensor) -> torch.Tensor:
        """``gather_for_metrics`` over the dp ranks: every rank's values gathered, one CP rank's
        kept per group (its ranks hold the same), and the last batch's repeated samples dropped
        as accelerate does."""
        data = self.accelerator.gather(tensor.contiguous())
        dp = self.args.world_size // self.cp_size
        data = data.reshape(dp, self.cp_size, -1, *tensor.shape[1:])[:, 0].flatten(0, 1)
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            data = data[: state.remainder]
        return data


def _accelerate_cp_problem(parallelism_config: Any) -> str | None:
    """Why accelerate's own context parallelism refuses to run with cpshard's, or None."""
    if parallelism_config is None or getattr(parallelism_config, "cp_size", 1) <= 1:
        return None
    return (
        f"accelerate's context parallelism is on (ParallelismConfig cp_size="
        f"{parallelism_config.cp_size}) as well as cpshard's: set its cp_size to 1 (or drop "
        "parallelism_config) and pass cp_size to the cpshard trainer alone"
    )


def _refuse_accelerate_cp(parallelism_config: Any) -> None:
    """Refuse accelerate's CP before the Trainer builds its accelerator (which may fail on it
    first, with a message about accelerate alone)."""
    problem = _accelerate_cp_problem(parallelism_config)
    if problem is not None:
        raise ValueError(f"{_WHAT}: rank {_launched_rank()}: {problem}")


# The oldest transformers whose Trainer shares a batch's token count over the CP ranks
# (``num_items_in_batch / get_cp_size()``), which the loss arithmetic above relies on; 5.15's does
# not, and every CP loss and gradient would be 1/cp of the plain trainer's.
OLDEST_TRAINER = "5.24"


def _refuse_older_trainer(version: str | None = None) -> None:
    """Refuse a transformers (``version``, default the installed one) older than
    :data:`OLDEST_TRAINER` (every rank has the same)."""
    from importlib.metadata import version as installed

    from packaging.version import Version

    version = installed("transformers") if version is None else version
    if Version(version).release < Version(OLDEST_TRAINER).release:
        raise ValueError(
            f"{_WHAT}: rank {_launched_rank()}: transformers {version}'s "
            "Trainer does not share a batch's token count over the CP ranks, so every loss and "
            f"gradient under CP would be 1/cp of the plain trainer's: install transformers >= "
            f"{OLDEST_TRAINER}"
        )


def _launched_rank() -> int:
    """This process's rank as the launcher numbered it (also where the trainer sees one process,
    or before it has set up the world)."""
    return int(os.environ.get("RANK", "0"))


def _cp_group(world: int, cp: int, device_type: str) -> Group:
    """This rank's CP group (``cp`` consecutive ranks), from a ``(dp, cp)`` device mesh over the
    world (the dp ranks are those of one CP index: the data loaders and the evaluation gather
    follow the same rank order)."""
    if world == 1:
        return resolve_group(None, _WHAT)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (world // cp, cp), mesh_dim_names=("dp", "cp"))
    return resolve_group(mesh["cp"], _WHAT)


def _reduced_ranks(model: torch.nn.Module) -> set[int] | None:
    """The global ranks over which the wrapped model's gradients are reduced: DDP's process
    group, or the union of FSDP2's parameter meshes; None when neither wraps it."""
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return set(dist.get_process_group_ranks(model.process_group))
    meshes = {p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
    if not meshes:
        return None
    return {r for mesh in meshes for r in mesh.mesh.flatten().tolist()}


class CPTrainer(ContextParallelMixin, Trainer):
    """``transformers.Trainer`` under cpshard CP (``cp_size``, ``layout``, ``strategy``); use
    it with a padding-free collator such as ``DataCollatorWithFlattening``."""

