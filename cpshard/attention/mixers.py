"""Token mixers CP attention does not shard, refused while a CP attention context is active.

Inside a CP step each rank holds a slice of every packed sequence, and only the attention that
goes through cpshard sees the whole sequence. A layer that mixes tokens along the sequence by
other means — a convolution over time, a recurrence (linear attention, delta rules, state-space
scans, RNNs) — would run on the rank's slice alone, across the boundaries of the packed
documents and with no state from the preceding ranks: the step would train wrong without an
error. So the first time a model runs inside a CP attention context, :func:`guard_models`'s
hook walks its modules and raises, on every rank (each runs the same model), naming the first
such module, before anything is computed. Models it passes are remembered and never walked
again.

What is refused: ``nn.Conv1d`` with a kernel longer than one token, ``nn.RNNBase`` (LSTM, GRU,
RNN), and modules whose class names say they are such a mixer (``MIXER_NAMES``: Gated DeltaNet,
Mamba mixers, RWKV time mixing, linear attention, ...). Modules marked with
``cpshard_not_sequence = True`` (a vision tower run on the rank's own frames) and modules whose
class says ``cpshard_sequence_mixer = True`` (mixers whose convolution and recurrence run through
:mod:`cpshard.mixers` under CP, set by an integration) are skipped with their children.

Compiled models. The check runs eagerly, outside any compiled graph, at the call that enters the
model: ``torch.compile(model)`` calls the global hooks on its wrapper eagerly, and with
``model.compile()`` (``nn.Module.compile``) torch calls the model's hooks from its uncompiled
``_call_impl``, each hook a frame of its own that dynamo would compile, where
``torch.compiler.is_compiling()`` holds and the hook could not tell the model's call from a
submodule's. So the hook's code is excluded from dynamo's frame compilation (it stays traceable
inline), and the check it calls is ``torch.compiler.disable``d: the refusal is the same
``ValueError`` with or without ``fullgraph``, and a model that passes compiles as before (no graph
break; inside a compiled region, where submodules' hooks are traced inline, the hook does
nothing). Not covered: a compiled function that calls an unchecked model (``torch.compile(step)``
with ``model(...)`` inside it) traces the model's hooks inline; call such a model once eagerly
inside the CP context, or compile the model itself.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable

import torch

from cpshard.attention.state import active_state

# Class-name fragments of token mixers that carry state along the sequence.
MIXER_NAMES = (
    "GatedDeltaNet",
    "DeltaNet",
    "MambaMixer",
    "Mamba2Mixer",
    "RwkvSelfAttention",
    "RwkvFeedForward",
    "LinearAttention",
    "Retention",
    "ShortConv",
    "RecurrentBlock",
    "Rglru",
)

_verified: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
_handle: torch.utils.hooks.RemovableHandle | None = None


def mixer_problem(module: torch.nn.Module) -> str | None:
    """Why ``module`` mixes tokens along the sequence outside CP attention, or None."""
    if isinstance(module, torch.nn.Conv1d) and module.kernel_size[0] > 1:
        return f"a convolution over the sequence (Conv1d, kernel {module.kernel_size[0]})"
    if isinstance(module, torch.nn.RNNBase):
        return f"a recurrence over the sequence ({type(module).__name__})"
    name = type(module).__name__
    hit = next((f for f in MIXER_NAMES if f in name), None)
    if hit is not None:
        return f"a token mixer cpshard does not shard ({name})"
    return None


def _walk(root: torch.nn.Module) -> tuple[str, str] | None:
    """``(qualified name, problem)`` of the first unsupported mixer under ``root``, or None."""
    stack = [("", root)]
    while stack:
        path, module = stack.pop()
        if getattr(module, "cpshard_not_sequence", False) or getattr(
            module, "cpshard_sequence_mixer", False
        ):
            continue
        problem = mixer_problem(module)
        if problem is not None:
            return path or type(root).__name__, problem
        children = list(module.named_children())
        stack.extend((f"{path}.{n}" if path else n, c) for n, c in reversed(children))
    return None


def unsharded_mixer(module: torch.nn.Module) -> str | None:
    """Why ``module`` cannot train under CP (its first token mixer that CP attention does not
    shard, by its path), or None: the check a model gets on its first call inside a CP context,
    for callers that refuse a model before any step (the trainers)."""
    found = _walk(module)
    if found is None:
        return None
    path, problem = found
    return (
        f"its module {path!r} is {problem}: it would mix the tokens of this rank's shard across "
        "documents and without the other ranks' context, and train wrong. Run such models "
        "outside CP, or without this layer"
    )


def check_model(module: torch.nn.Module) -> None:
    """Raise ``ValueError`` (naming the rank and the module) when ``module`` has a token mixer
    CP attention does not shard; remember it (and its modules) when it has none."""
    state = active_state()
    if state is None or module in _verified:
        return
    problem = unsharded_mixer(module)
    if problem is not None:
        raise ValueError(
            f"cpshard CP attention: rank {state.group.rank}: {type(module).__name__} runs "
            f"inside a CP attention context but {problem}"
        )
    _verified.update(module.modules())


_check_eagerly: Callable[[torch.nn.Module], None] = check_model
_skip_code: Callable[[types.CodeType], None] | None = None


def _pre_hook(module: torch.nn.Module, args: object) -> None:
    # Traced inline (a submodule called inside a compiled region): nothing to do, the eager call
    # that entered the region checked. Called as a frame of its own (the eager path, and the
    # hooks of a model.compile()d module): dynamo never compiles this code (guard_models).
    if not torch.compiler.is_compiling() and active_state() is not None:
        _check_eagerly(module)


def guard_models() -> None:
    """Install (once) the global module pre-hook that checks each model the first time it runs
    inside a CP attention context (a no-op outside one), and keep its code out of dynamo's frame
    compilation (reapplied at every call, so that nothing resetting dynamo's per-code state in
    between undoes it)."""
    global _handle, _check_eagerly, _skip_code
    if _skip_code is None:
        from torch._dynamo.eval_frame import skip_code

        _check_eagerly = torch.compiler.disable(check_model)
        _skip_code = skip_code
    _skip_code(_pre_hook.__code__)
    if _handle is None:
        _handle = torch.nn.modules.module.register_module_forward_pre_hook(_pre_hook)
