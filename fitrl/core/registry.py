"""Small explicit registries: a dict plus a decorator, so a misspelt name fails when the config
loads, with the valid names and the nearest one.

Each extension point (advantage estimator, policy loss, loss aggregation, KL estimator, reward
function, model family, rollout engine) keeps one :class:`Registry`; :mod:`fitrl.config.choices`
checks every configured name against them before a run directory exists or a model loads.
"""

from __future__ import annotations

import difflib
from typing import Callable, Generic, Iterator, TypeVar

from fitrl.core.errors import ConfigError

T = TypeVar("T")

CHECKED_ON_LOAD: list["Registry"] = []
"""Registries of extensions that live in layers above the config (the rollout engines): the
config layer cannot import them, so they put themselves here when their package is imported, and
:func:`fitrl.config.choices.check_choices` checks the config's value against each one present. The
command line imports those packages before it loads a config (fitrl/cli.py)."""


class Registry(Generic[T]):
    def __init__(self, kind: str, config_key: str, checked_on_load: bool = False):
        self.kind, self.config_key = kind, config_key
        self._items: dict[str, T] = {}
        if checked_on_load:
            CHECKED_ON_LOAD.append(self)

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@REG.register("grpo")`` over a function or class."""
        def wrap(item: T) -> T:
            self.add(name, item)
            return item
        return wrap

    def add(self, name: str, item: T) -> None:
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} registered twice")
        self._items[name] = item

    def remove(self, name: str) -> None:
        """Unregister ``name`` (a test's temporary entry)."""
        del self._items[name]

    def check(self, name: str, key: str = "") -> None:
        """Raise :class:`ConfigError` naming ``key`` (default: this registry's config key), the
        nearest valid name and every valid name, unless ``name`` is registered."""
        if name in self._items:
            return
        near = difflib.get_close_matches(name, list(self._items), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ConfigError(f"unknown {self.kind} {key or self.config_key}={name!r}{hint} "
                          f"(valid: {', '.join(self.names())})")

    def get(self, name: str) -> T:
        self.check(name)
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def in_order(self) -> list[T]:
        """The items in the order they were registered (where that order means something)."""
        return list(self._items.values())

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
