"""Small explicit registries: a dict plus a decorator, so a misspelt name fails at config
time with the list of valid names (and the nearest one)."""

from __future__ import annotations

import difflib
from typing import Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    def __init__(self, kind: str, config_key: str):
        self.kind, self.config_key = kind, config_key
        self._items: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def wrap(fn: F) -> F:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._items[name] = fn
            return fn
        return wrap

    def get(self, name: str) -> F:
        if name not in self._items:
            from fitrl.config.schema import ConfigError

            near = difflib.get_close_matches(name, list(self._items), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"unknown {self.kind} {self.config_key}={name!r}{hint} (valid: {', '.join(sorted(self._items))})")
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)
