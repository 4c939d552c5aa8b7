"""Module-level state set for a scope and restored by token.

cpshard keeps three pieces of process state that deep model code reads without an argument to
carry them: the check mode, the step's active CP attention state and the vision sharding group.
Each is a :class:`ScopedValue`: :meth:`~ScopedValue.set` installs a value and returns a one-use
token, :meth:`~ScopedValue.reset` restores what the token's ``set`` replaced. Scopes nest and
must be reset innermost first (a token reset out of order or twice raises), so a scope left by
an exception can never leave another scope's value installed.

A plain attribute, not a ``ContextVar``: training steps are sequential and the readers
(attention layers, the vision tower, an activation-checkpoint recompute) run on the thread that
set the value.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")


class ScopeToken:
    """Restores the value that was current before the :meth:`ScopedValue.set` that returned it;
    opaque, one use."""

    __slots__ = ("_installed", "_previous", "_used")

    def __init__(self, previous: object, installed: object) -> None:
        self._previous = previous
        self._installed = installed
        self._used = False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {'used' if self._used else 'unused'}>"


class ScopedValue(Generic[T]):
    """A value installed for a scope. ``what`` names the reset in errors and ``setter`` the
    call whose tokens it takes; ``token_type`` is the :class:`ScopeToken` subclass its tokens
    are (a public API may name its own)."""

    def __init__(
        self,
        initial: T,
        what: str,
        setter: str = "set",
        token_type: type[ScopeToken] = ScopeToken,
    ) -> None:
        self._value = initial
        self._what = what
        self._setter = setter
        self._token_type = token_type

    def get(self) -> T:
        return self._value

    def set(self, value: T) -> ScopeToken:
        """Install ``value``; the token restores the value it replaces."""
        token = self._token_type(self._value, value)
        self._value = value
        return token

    def swap(self, value: T) -> T:
        """Install ``value`` and return the value it replaces, with no token (for an API whose
        own contract is a plain get/set/reset holder)."""
        previous, self._value = self._value, value
        return previous

    def reset(self, token: ScopeToken) -> None:
        """Restore the value current before the ``set`` that returned ``token``. ``TypeError``
        for anything but such a token; ``RuntimeError`` for a token used twice or reset while a
        scope set after it is still installed."""
        if not isinstance(token, self._token_type):
            raise TypeError(
                f"{self._what}: token must be the value {self._setter} returned, got "
                f"{type(token).__name__}"
            )
        if token._used:
            raise RuntimeError(f"{self._what}: this token has already been used")
        if self._value is not token._installed:
            raise RuntimeError(
                f"{self._what}: scopes must be reset in the reverse order they were set (the "
                "token's scope is not the current one: a nested scope is still set)"
            )
        token._used = True
        self._value = token._previous

    @contextmanager
    def scope(self, value: T) -> Iterator[T]:
        """Install ``value`` for the block, restored on exit (also on an exception)."""
        token = self.set(value)
        try:
            yield value
        finally:
            self.reset(token)
