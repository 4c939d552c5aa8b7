"""cpshard's hooks into transformers' modeling modules, installed family by family.

A hybrid layer (Gated DeltaNet, Mamba, Mamba2, short convolution, lightning attention) mixes
tokens through functions of its modeling module (or its own ``forward``); cpshard puts a
dispatcher in their place (:mod:`cpshard.integrations.dispatch`). transformers changes those
modules from release to release, so each one is checked before anything in it is touched:
the layer class and every hooked function must be there, and each function's leading
parameters must be the ones its dispatcher passes on. A module that matches gets every hook
and its layer class is marked ``cpshard_sequence_mixer``; one that does not is left exactly
as transformers made it, its layer class is listed with the reason
(:mod:`cpshard.guard.refusals`), and a model holding such a layer is refused under CP on every
rank, saying why, while every other family works. :func:`hook_report` tells what is active.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from cpshard.declared import declared_range
from cpshard.guard import refusals

Make = Callable[[Callable[..., Any]], Callable[..., Any]]  # original -> dispatcher

ACTIVE, INACTIVE, ABSENT = "active", "inactive", "absent"


@dataclass(frozen=True)
class Hook:
    """A dispatcher maker and the leading parameters it relies on the original to take (in
    this order; empty: it passes every argument on unchanged)."""

    make: Make
    params: tuple[str, ...] = ()


@dataclass(frozen=True)
class Family:
    """Layers of several model families hooked the same way.

    ``modules``: modeling module -> the layer class in it. ``functions``: module-level
    functions replaced by dispatchers (every one required). ``fused``: fused-kernel entries
    replaced when the module has them (a release without the fused path has nothing to turn
    off). ``methods``: methods of the layer class replaced. ``mixer``: the layer class mixes
    tokens through the hooks (marked as routed through cpshard when they are installed, refused
    under CP when its module does not match); a layer that is no mixer (an attention whose
    hook only adjusts what reaches cpshard's attention) is neither, and what it would compute
    wrong unhooked is refused where it reaches cpshard."""

    name: str
    modules: Mapping[str, str]
    functions: Mapping[str, Hook] = field(default_factory=dict)
    fused: Mapping[str, Make] = field(default_factory=dict)
    methods: Mapping[str, Hook] = field(default_factory=dict)
    mixer: bool = True


@dataclass(frozen=True)
class HookStatus:
    """One modeling module's hooks in this environment: ``active``, ``inactive`` (the module
    does not match; ``reason`` says how) or ``absent`` (this transformers has no such model)."""

    family: str
    module: str
    layer: str
    state: str
    reason: str = ""


_status: dict[str, HookStatus] = {}


def transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def _underlying(fn: Any) -> Callable[..., Any]:
    """The Python function behind ``fn``: through ``functools.wraps`` chains and the function
    modules the ``kernels`` package makes of hub-replaceable functions."""
    forward = getattr(type(fn), "forward", None)
    code = getattr(forward, "__code__", None)
    if code is not None and "func" in code.co_freevars:  # kernels' Func module around a function
        fn = forward.__closure__[code.co_freevars.index("func")].cell_contents
    return inspect.unwrap(fn)


def signature_mismatch(fn: Any, params: tuple[str, ...]) -> str | None:
    """Why ``fn`` does not take ``params`` as its leading parameters, or None."""
    if not params:
        return None
    try:
        found = list(inspect.signature(_underlying(fn)).parameters.values())
    except (TypeError, ValueError):
        return "its signature cannot be read"
    names = [p.name for p in found if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if tuple(names[: len(params)]) != params:
        return f"it takes ({', '.join(names)}), cpshard's dispatcher passes ({', '.join(params)})"
    return None


def _mismatch(module: Any, layer: str, family: Family) -> str | None:
    """Why ``module`` does not match ``family``'s hooks, or None."""
    cls = getattr(module, layer, None)
    if not isinstance(cls, type):
        return f"it has no class {layer}"
    for owner, hooks, where in ((module, family.functions, ""), (cls, family.methods, f"{layer}.")):
        for attr, hook in hooks.items():
            fn = getattr(owner, attr, None)
            if fn is None:
                return f"it has no {where}{attr}"
            original = getattr(fn, "cpshard_original", fn)
            why = signature_mismatch(original, hook.params)
            if why is not None:
                return f"its {where}{attr} does not match: {why}"
    return None


def _replace(owner: Any, attr: str, make: Make) -> None:
    fn = getattr(owner, attr)
    if not hasattr(fn, "cpshard_original"):
        dispatcher = make(fn)
        dispatcher.cpshard_original = fn  # type: ignore[attr-defined]
        setattr(owner, attr, dispatcher)


def install(family: Family) -> list[HookStatus]:
    """Hook every modeling module of ``family`` this transformers has and that matches; leave
    the others untouched and list their layer classes as refused under CP. Idempotent."""
    out = []
    for name, layer in family.modules.items():
        try:
            module = importlib.import_module(name)
        except ImportError:
            status = HookStatus(family.name, name, layer, ABSENT, "not in this transformers")
        else:
            why = _mismatch(module, layer, family)
            if why is None:
                status = _activate(module, layer, family)
            else:
                status = HookStatus(family.name, name, layer, INACTIVE, why)
                if family.mixer:
                    _deactivate(module, layer, family, why)
        _status[name] = status
        out.append(status)
    return out


def _activate(module: Any, layer: str, family: Family) -> HookStatus:
    cls = getattr(module, layer)
    for attr, hook in family.functions.items():
        _replace(module, attr, hook.make)
    for attr, make in family.fused.items():
        if getattr(module, attr, None) is not None:
            _replace(module, attr, make)
    for attr, hook in family.methods.items():
        _replace(cls, attr, hook.make)
    if family.mixer:
        cls.cpshard_sequence_mixer = True
    refusals.forget(refusals.class_key(cls))
    return HookStatus(family.name, module.__name__, layer, ACTIVE)


def _deactivate(module: Any, layer: str, family: Family, why: str) -> None:
    """List ``layer`` as refused under CP (and drop a mark an earlier install left on it)."""
    cls = getattr(module, layer, None)
    if isinstance(cls, type) and "cpshard_sequence_mixer" in vars(cls):
        del cls.cpshard_sequence_mixer
    key = refusals.class_key(cls) if isinstance(cls, type) else f"{module.__name__}.{layer}"
    refusals.note(key, _refusal(family, module.__name__, why))


def _refusal(family: Family, module: str, why: str) -> str:
    return (
        f"cpshard's {family.name} hooks are not installed: transformers {transformers_version()}'s "
        f"{module} does not match them ({why}); install a transformers release cpshard supports "
        f"({declared_range('transformers')}; `cpshard env` shows which hooks are active), or train this "
        "model without CP"
    )


def hook_report() -> Iterator[HookStatus]:
    """Every hooked modeling module's status, as :func:`install` last found it."""
    yield from _status.values()
