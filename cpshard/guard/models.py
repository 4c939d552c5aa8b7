"""Models that mix tokens without cpshard, refused while a CP attention context is active.

Inside a CP step each rank holds a slice of every packed sequence, and only what goes through
cpshard (its attention, the mixers of :mod:`cpshard.mixers`) sees the whole sequence. A layer
that mixes tokens by other means — its own attention code (an SDPA call, a softmax of
``q @ k``, ALiBi), linear attention, a recurrence, a convolution over time — would run on the
rank's slice alone, across the boundaries of the packed documents and with no context from the
preceding ranks: the step would train wrong without an error. No list of class names decides
what is such a layer; two checks do, the first time a model runs inside a CP context:

* **before it runs** (:func:`check_model`): modules whose parameters make them a mixer over the
  sequence — ``nn.Conv1d`` with a kernel longer than one token, ``nn.RNNBase`` (LSTM, GRU, RNN) —
  raise, naming the module, before anything is computed; so do layers an integration listed
  as refused in this environment (:mod:`cpshard.guard.refusals`), with the integration's reason;
* **when its forward returns** (the audit): the forward is run again, eagerly and without
  gradient, recording every module call and which of them reached cpshard's token mixing
  (:mod:`cpshard.guard.reach`). Every call that did not is probed as it returns
  (:mod:`cpshard.guard.probe`): re-run with one token changed, a call whose other tokens'
  outputs change mixes tokens without cpshard. Under the calls that reached cpshard (or the
  model itself when none did) the innermost such call is named, and every rank raises (one
  consensus round over the host channel) instead of returning the step's result.

A model that passes is remembered and never checked again: after the first call the hooks cost
a few Python calls per module call inside a CP context (a weak-set lookup before it, a dict
lookup after it), nothing outside one, and never a device→host sync. Modules marked
``cpshard_not_sequence = True`` (a vision tower run on the rank's own frames) or whose class says
``cpshard_sequence_mixer = True`` (mixers whose convolution and recurrence an integration routes
through :mod:`cpshard.mixers`) are declared safe and skipped with their children.

What it cannot see. The audit re-runs the model's forward once, with the same arguments: a
forward with side effects outside the model (a cache object passed in, module hooks that count
calls) sees them again; :func:`auditing` tells such a hook the calls are the audit's. Mixing
inside a module whose own code also calls cpshard (an attention layer that adds, in the same
forward, a convolution of its values by ``F.conv1d``) is not separated from the cpshard call.
The probe's limits are :mod:`cpshard.guard.probe`'s.

Compiled models. The checks run eagerly, outside any compiled graph, at the call that enters the
model: ``torch.compile(model)`` calls the global hooks on its wrapper eagerly, and with
``model.compile()`` torch calls the model's hooks from its uncompiled ``_call_impl``, each hook a
frame of its own that dynamo would compile, where ``torch.compiler.is_compiling()`` holds and the
hook could not tell the model's call from a submodule's. So the hooks' code is excluded from
dynamo's frame compilation (it stays traceable inline), and the checks they call are
``torch.compiler.disable``d; the audit re-runs the model's eager forward. The refusal is the same
``ValueError`` with or without ``fullgraph``, and a model that passes compiles as before (no
graph break; inside a compiled region, where submodules' hooks are traced inline, the hooks do
nothing). Not covered: a compiled function that calls an unchecked model (``torch.compile(step)``
with ``model(...)`` inside it) traces the model's hooks inline and checks nothing; call such a
model once eagerly inside the CP context, or compile the model itself.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from cpshard.comm import Group
from cpshard.consensus import agree
from cpshard.guard import refusals
from cpshard.guard.probe import mixes_tokens
from cpshard.guard.reach import Call, current_recording, not_recording, recording
from cpshard.scoped import ScopedValue

_WHAT = "cpshard CP attention"


class Step(Protocol):
    """What the guard reads of the active CP step (the attention package's state)."""

    group: Group
    batch_size: int
    local_len: int
    derived: dict[str, object]


def _no_step() -> Step | None:
    return None


# The active step, as the attention package reads it (set by guard_models).
active_state: Callable[[], Step | None] = _no_step

_walked: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # passed the check before running
_verified: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # passed the audit too
_handles: list[torch.utils.hooks.RemovableHandle] = []


# True while an audit re-runs a model (its calls are the audit's, not the user's; one of the
# documented scopes).
_auditing: ScopedValue[bool] = ScopedValue(False, "cpshard.guard.models.auditing")
# The step's models whose first forward is running, to audit when it returns: in the step's
# state, so that a forward that raised leaves nothing behind for the next step.
_PENDING = "models awaiting their audit"


def _pending(state: Step) -> dict[int, tuple[weakref.ref[torch.nn.Module], frozenset[int]]]:
    """``{id(model): (model, ids of its modules)}`` for the step's models awaiting their audit."""
    return state.derived.setdefault(_PENDING, {})  # type: ignore[return-value]


def auditing() -> bool:
    """Whether the running module calls are an audit's re-run of a model (module hooks that
    count or record a model's calls skip them)."""
    return _auditing.get()


def _declared_safe(module: torch.nn.Module) -> bool:
    return bool(
        getattr(module, "cpshard_not_sequence", False)
        or getattr(module, "cpshard_sequence_mixer", False)
    )


def _compiled_graph(module: torch.nn.Module) -> bool:
    """A graph torch's compiler made and runs itself (``torch.fx.GraphModule``: it may consume
    its boxed arguments, so it cannot be run again); what it computes was traced from a model
    or function the check saw or could not see, not a model of the user's."""
    return isinstance(module, torch.fx.GraphModule)


# ------------------------------------------------------------------ before it runs


def mixer_problem(module: torch.nn.Module) -> str | None:
    """Why ``module``'s own parameters make it mix tokens along the sequence, or None."""
    if isinstance(module, torch.nn.Conv1d) and module.kernel_size[0] > 1:
        return f"a convolution over the sequence (Conv1d, kernel {module.kernel_size[0]})"
    if isinstance(module, torch.nn.RNNBase):
        return f"a recurrence over the sequence ({type(module).__name__})"
    return None


def _walk(root: torch.nn.Module) -> str | None:
    """Why the first module under ``root`` that cannot run under CP (a listed refusal, or a
    sequence mixer by its parameters) cannot, naming it by path; None when none is."""
    stack = [("", root)]
    while stack:
        path, module = stack.pop()
        if _declared_safe(module):
            continue
        name = path or type(root).__name__
        listed = refusals.reason(type(module))
        if listed is not None:
            return f"its module {name!r} ({type(module).__name__}) cannot run under CP: {listed}"
        problem = mixer_problem(module)
        if problem is not None:
            return _mixing(name, problem)
        children = list(module.named_children())
        stack.extend((f"{path}.{n}" if path else n, c) for n, c in reversed(children))
    return None


def _mixing(path: str, problem: str) -> str:
    return (
        f"its module {path!r} is {problem}: it would mix the tokens of this rank's shard across "
        "documents and without the other ranks' context, and train wrong. Run such models "
        "outside CP, or route the layer through cpshard"
    )


def _detail(root: torch.nn.Module, why: str) -> str:
    return f"{type(root).__name__} runs inside a CP attention context but {why}"


def _refusal(state: Step, root: torch.nn.Module, why: str) -> str:
    return f"{_WHAT}: rank {state.group.rank}: {_detail(root, why)}"


def unsharded_mixer(module: torch.nn.Module) -> str | None:
    """Why ``module`` cannot train under CP by its parameters (its first module that mixes
    tokens along the sequence, by path), or None: the check a model gets before its first call
    inside a CP context, for callers that refuse a model before any step (the trainers); what
    only its forward shows is checked when it first runs there."""
    return _walk(module)


def check_model(module: torch.nn.Module) -> None:
    """Raise ``ValueError`` (naming the rank and the module) when a module under ``module`` is a
    mixer over the sequence by its parameters; remember ``module`` when none is."""
    state = active_state()
    if state is None or module in _walked:
        return
    why = _walk(module)
    if why is not None:
        raise ValueError(_refusal(state, module, why))
    _walked.update(module.modules())


# ------------------------------------------------------------------ when its forward returns


def _eager(module: torch.nn.Module) -> Callable[..., Any]:
    """``module``'s call without compilation (hooks included)."""
    original = getattr(module, "_orig_mod", None)  # torch.compile(model)
    if isinstance(original, torch.nn.Module):
        return original
    if getattr(module, "_compiled_call_impl", None) is not None:  # model.compile()
        return module._call_impl
    return module


def _innermost_mixer(call: Call) -> Call | None:
    """The innermost call at or under ``call`` (which did not reach cpshard) that mixes tokens,
    or None when ``call`` does not."""
    if not call.mixes:
        return None
    for child in call.children:
        found = _innermost_mixer(child)
        if found is not None:
            return found
    return call


def _mixer_outside(call: Call) -> Call | None:
    """Under ``call`` (which reached cpshard), the first call that mixes tokens without it."""
    for child in call.children:
        found = _mixer_outside(child) if child.reached else _innermost_mixer(child)
        if found is not None:
            return found
    return None


def _name(root: torch.nn.Module, module: torch.nn.Module) -> str:
    names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
    return names.get(id(module)) or type(module).__name__


def audit(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Re-run ``module``'s forward on ``args``/``kwargs`` inside the active CP context, find a
    module call that mixes tokens without cpshard, and raise on every rank when one did
    (remember ``module`` when none did)."""
    state = active_state()
    if state is None:
        return
    tokens = (state.batch_size, state.local_len)

    def probe(call: Call, call_args: tuple[Any, ...], call_kwargs: dict[str, Any]) -> bool:
        with not_recording():
            return mixes_tokens(_eager(call.module), call_args, call_kwargs, tokens)

    with _auditing.scope(True), recording(_declared_safe, probe) as record, torch.no_grad():
        _eager(module)(*args, **kwargs)
    root = record.root
    found = None
    if root is not None and not root.skipped:
        found = _mixer_outside(root) if root.reached else _innermost_mixer(root)
    detail = None
    if found is not None:
        problem = (
            f"{type(found.module).__name__}, which mixes tokens along the sequence without "
            "cpshard (its own attention or recurrence code)"
        )
        detail = _detail(module, _mixing(_name(module, found.module), problem))
    agree(state.group, _WHAT, detail)  # names this rank (or the failed ones) before the detail
    _verified.update(module.modules())


def assume_verified(model: torch.nn.Module) -> None:
    """Treat ``model`` as having passed its audit, as in every step after a real job's first:
    for a simulated later step under ``FakeTensorMode`` (a memory prediction), whose tensors
    hold no values for the audit's probe to compare. The job's first step still audits it."""
    _verified.update(model.modules())


# ------------------------------------------------------------------ the hooks


def _pre_hook(module: torch.nn.Module, args: object) -> None:
    # Traced inline (a submodule called inside a compiled region): nothing to do, the eager call
    # that entered the region checked. Called as a frame of its own (the eager path, and the
    # hooks of a model.compile()d module): dynamo never compiles this code (guard_models), and
    # everything it does runs in a torch.compiler.disable'd function (its callees' frames would
    # be compiled otherwise).
    if not torch.compiler.is_compiling() and active_state() is not None:
        _before_eagerly(module)


def _post_hook(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: object
) -> None:
    if torch.compiler.is_compiling():
        return
    state = active_state()  # below: nothing to do unless a model is audited or awaits its audit
    if state is not None and (current_recording() is not None or state.derived.get(_PENDING)):
        _after_eagerly(module, args, kwargs)


def _before(module: torch.nn.Module) -> None:
    """At a module call inside a CP context: record it when a model is being audited; at a call
    of an unverified model outside any model awaiting its audit, the check before running, and
    the audit awaited at its return."""
    state = active_state()
    record = current_recording()
    if record is not None:
        record.enter(module)
        return
    if state is None or _auditing.get() or module in _verified or _compiled_graph(module):
        return
    pending = _pending(state)
    if any(id(module) in members for _, members in pending.values()):
        return
    check_model(module)
    pending[id(module)] = (weakref.ref(module), frozenset(map(id, module.modules())))


def _after(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """At a module call's return inside a CP context: record it when a model is being audited;
    audit a model awaiting its audit."""
    state = active_state()
    record = current_recording()
    if record is not None:
        record.leave(module, args, kwargs)
    elif state is not None and not _auditing.get() and _PENDING in state.derived:
        entry = _pending(state).pop(id(module), None)
        if entry is not None and entry[0]() is module:
            audit(module, args, kwargs)


_before_eagerly: Callable[[torch.nn.Module], None] = _before
_after_eagerly: Callable[[torch.nn.Module, tuple[Any, ...], dict[str, Any]], None] = _after
_skip_code: Callable[[types.CodeType], None] | None = None


def guard_models(read_state: Callable[[], Step | None]) -> None:
    """Install (once) the global module hooks that check each model the first time it runs
    inside a CP attention context (``read_state()``: the active step, None outside one: then
    they do nothing), and keep their code out of dynamo's frame compilation (reapplied at every
    call, so that nothing resetting dynamo's per-code state in between undoes it)."""
    global _before_eagerly, _after_eagerly, _skip_code, active_state
    active_state = read_state
    if _skip_code is None:
        from torch._dynamo.eval_frame import skip_code

        _before_eagerly = torch.compiler.disable(_before)
        _after_eagerly = torch.compiler.disable(_after)
        _skip_code = skip_code
    _skip_code(_pre_hook.__code__)
    _skip_code(_post_hook.__code__)
    if not _handles:
        _handles.append(torch.nn.modules.module.register_module_forward_pre_hook(_pre_hook))
        _handles.append(
            torch.nn.modules.module.register_module_forward_hook(_post_hook, with_kwargs=True)
        )
