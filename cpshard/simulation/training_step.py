"""The CP training step whose memory is predicted and measured: a transformers causal LM with
the ``"cpshard"`` attention, a packed batch sharded by the sharder, the base model's forward,
the loss (:mod:`cpshard.simulation.step_loss`) from its hidden states and LM head, the backward
inside the step's CP context, then the optimizer's step; optionally sharded by FSDP2 (each
decoder layer a unit, the LM head one, the embeddings and final norm the root's). One
definition serves the fake-tensor prediction and the real CPU measurement, so both run the same
code."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from cpshard.simulation.step_loss import LOSSES, LossModule

DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp64": torch.float64,
}
OPTIMIZERS = ("adamw", "sgd", "none")


@dataclass(frozen=True)
class StepSpec:
    """What a step trains: the model's transformers ``config`` (all its layers), the parameters'
    ``dtype`` (gradients and optimizer state alike), activation ``checkpointing`` of every
    decoder layer, the ``optimizer`` (``adamw``; ``sgd`` with momentum; ``none``: no state and
    no step), the ``loss`` (a :data:`~cpshard.simulation.step_loss.LOSSES` name), and ``fsdp``:
    parameters, gradients and optimizer state sharded by FSDP2 over the CP ranks times
    ``dp_shard`` data-parallel replicas (False: replicated on every rank)."""

    config: Any
    dtype: torch.dtype = torch.bfloat16
    checkpointing: bool = False
    optimizer: str = "adamw"
    loss: str = "cross_entropy"
    fsdp: bool = False
    dp_shard: int = 1

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer: {self.optimizer!r} is not one of {OPTIMIZERS}")
        if self.loss not in LOSSES:
            raise ValueError(f"--loss: {self.loss!r} is not one of {tuple(LOSSES)}")
        if self.dp_shard < 1:
            raise ValueError(f"--dp-shard: must be >= 1, got {self.dp_shard}")
        if self.dp_shard > 1 and not self.fsdp:
            raise ValueError("--dp-shard: shards with --fsdp only")

    @property
    def layers(self) -> int:
        return int(self.config.num_hidden_layers)


def config_with_layers(config: Any, layers: int) -> Any:
    """``config`` with ``layers`` decoder layers (its per-layer lists cut to match)."""
    fields = config.to_dict()
    fields["num_hidden_layers"] = layers
    if isinstance(fields.get("layer_types"), list):
        fields["layer_types"] = fields["layer_types"][:layers]
    fields["use_cache"] = False
    return type(config)(**fields)


def build_model(spec: StepSpec, layers: int) -> torch.nn.Module:
    """``spec``'s causal LM with ``layers`` decoder layers, in training mode, on the ``"cpshard"``
    attention (under ``FakeTensorMode`` when one is active: no real weights)."""
    import transformers

    from cpshard.integrations import transformers as cp_transformers

    cp_transformers.register()
    config = config_with_layers(spec.config, layers)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=spec.dtype)
    model.set_attn_implementation(cp_transformers.ATTN_IMPLEMENTATION)
    if spec.checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    return model.train()


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's decoder layers (``base_model.layers``; a base model's own)."""
    layers = getattr(model.base_model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"--model: {type(model).__name__} has no decoder layer list")
    return layers


def make_optimizer(spec: StepSpec, model: torch.nn.Module) -> torch.optim.Optimizer | None:
    """``spec``'s optimizer over ``model``'s parameters, its state made (one step on zero
    gradients, the gradients then dropped): the state a step after the first holds."""
    if spec.optimizer == "none":
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    if spec.optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=1e-5)
    else:
        opt = torch.optim.SGD(params, lr=1e-5, momentum=0.9)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


def packed_batch(doc_ids: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    """The ``[1, S]`` packed batch of documents ``doc_ids`` (0: padding) the step trains on:
    token ids cycling through the vocabulary (0, the pad id, on padding), labels the same
    (-100 on padding)."""
    tokens = (torch.arange(doc_ids.shape[1]) % max(1, vocab_size - 1) + 1).view(1, -1)
    pad = doc_ids == 0
    return {
        "input_ids": tokens.masked_fill(pad, 0),
        "labels": tokens.masked_fill(pad, -100),
        "_packed_seq_ids": doc_ids,
    }


class CausalStep(torch.nn.Module):
    """A causal LM's training forward as one module: its base model, then ``loss`` (holding the
    LM head) from the last hidden states. One module, so that FSDP2 has one root whose forward
    starts the step (:func:`fully_shard_step`)."""

    def __init__(self, model: torch.nn.Module, loss: LossModule) -> None:
        super().__init__()
        self.base = model.base_model
        self.loss = loss

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        hidden = self.base(input_ids=input_ids, position_ids=position_ids).last_hidden_state
        return self.loss(hidden, labels)


def world_mesh() -> Any:
    """A 1-D ``DeviceMesh`` over every rank of the default group: what FSDP2 shards over (the CP
    ranks times the data-parallel replicas)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def fully_shard_step(step: CausalStep, mesh: Any) -> None:
    """FSDP2 (``fully_shard``) over ``mesh``: each decoder layer a unit, the LM head one (unless
    tied to the embeddings), the root ``step`` holding the rest (embeddings, final norm)."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(step.base):
        fully_shard(layer, mesh=mesh)
    head = step.loss.head.weight
    if not any(p is head for p in step.base.parameters()):
        fully_shard(step.loss, mesh=mesh)
    fully_shard(step, mesh=mesh)


def forward_backward(
    step: CausalStep,
    local: Any,
    ctx: Callable[[], AbstractContextManager],
    convert: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> None:
    """One forward and backward of ``step`` on this rank's sharded batch ``local`` inside the
    step's CP context ``ctx`` (``convert``: how a batch tensor enters the model, e.g. as a fake
    tensor). Nothing of the step outlives it but the parameters' gradients."""
    input_ids, position_ids = convert(local["input_ids"]), convert(local["position_ids"])
    labels = convert(local.targets.labels)
    with ctx():
        loss = step(input_ids, position_ids, labels)
        loss.backward()
