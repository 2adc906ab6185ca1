"""One table per kind of capability: a data format, an optimizer, a scheduler, a model kind, an objective.

Adding a capability is one `REGISTRY.add(name, entry)` next to its code. The table's own list of
names is what the config accepts and what an unknown name's error message offers, so the error,
the docs and the code cannot drift apart. This module imports nothing heavy: registries are read
while the config is validated, before torch is loaded.
"""

from __future__ import annotations

from typing import Generic, Iterable, TypeVar

Entry = TypeVar("Entry")


class Registry(Generic[Entry]):
    def __init__(self, kind: str, config_key: str):
        self.kind = kind  # "optimizer", in words, for messages
        self.config_key = config_key  # the config key that names an entry
        self._entries: dict[str, Entry] = {}
        self._canonical: dict[str, str] = {}  # every accepted name (aliases too) -> the entry's own name

    def add(self, name: str, entry: Entry, aliases: Iterable[str] = ()) -> Entry:
        for accepted in (name, *aliases):
            if accepted in self._canonical:
                raise ValueError(f"{self.kind} {accepted!r} is registered twice")
            self._canonical[accepted] = name
        self._entries[name] = entry
        return entry

    def names(self) -> list[str]:
        """Every name the config accepts, aliases included, in the order they were added."""
        return list(self._canonical)

    def __contains__(self, name: object) -> bool:
        return name in self._canonical

    def canonical(self, name: str) -> str:
        self.check(name)
        return self._canonical[name]

    def __getitem__(self, name: str) -> Entry:
        return self._entries[self.canonical(name)]

    def check(self, name: str) -> str:
        """The name, or a ValueError listing the known ones (pydantic prefixes it with the key)."""
        if name not in self._canonical:
            article = "an" if self.kind[:1] in "aeiou" else "a"
            raise ValueError(f"got {name!r}, which is not {article} {self.kind} tuneloop knows; use {self.choices()}")
        return name

    def choices(self) -> str:
        names = [repr(name) for name in self.names()]
        return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]
