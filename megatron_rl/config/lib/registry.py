"""One small typed registry for every extension point (names chosen in a config).

Advantage estimators, token-weight methods, rewards, tasks and model adapters are each
a :class:`Registry`. Built-ins register through the same call as user code, so a user
extension is a peer, never a special case; registering a name twice raises, and an
unknown name raises :class:`UnknownNameError` listing the registered ones (the message
a config error shows the user).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar, overload

T = TypeVar("T")


class UnknownNameError(KeyError):
    """No object is registered under the name; the message lists the registered ones."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class Registry(Generic[T]):
    """Names -> objects of one kind.

    Args:
        kind: what the objects are, for messages ("advantage estimator", "reward").
        unknown_error: the exception type an unknown name raises (a subclass of
            :class:`UnknownNameError`, so callers can catch either).
        unknown_hint: appended to the unknown-name message (e.g. how to give a user
            function by import path instead).
    """

    def __init__(self, kind: str, *, unknown_error: type[UnknownNameError] = UnknownNameError, unknown_hint: str = ""):
        self.kind = kind
        self._unknown_error = unknown_error
        self._unknown_hint = unknown_hint
        self._items: dict[str, T] = {}

    @overload
    def register(self, name: str) -> Callable[[T], T]: ...

    @overload
    def register(self, name: str, obj: T) -> T: ...

    def register(self, name: str, obj=None):
        """Register ``obj`` under ``name`` (returns it); without ``obj``, a decorator."""
        if not name:
            raise ValueError(f"a {self.kind} needs a non-empty name")

        def add(item: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered (by {self._items[name]!r})")
            self._items[name] = item
            return item

        return add if obj is None else add(obj)

    def get(self, name: str) -> T:
        """The object registered under ``name``; an unknown name raises listing the others."""
        try:
            return self._items[name]
        except KeyError:
            hint = f" {self._unknown_hint}" if self._unknown_hint else ""
            raise self._unknown_error(
                f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}{hint}"
            ) from None

    def unregister(self, name: str) -> T | None:
        """Remove ``name`` (a no-op when absent) and return what was registered; for tests
        that register a throw-away extension."""
        return self._items.pop(name, None)

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._items)

    def items(self) -> list[tuple[str, T]]:
        """``(name, object)`` pairs in registration order."""
        return list(self._items.items())

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
