"""The stage's LoRA adapters by name: which engine adapter slot serves each.

Slots are the engine's 1 .. maxLoras. `config.lora_adapters` fills the first ones at start;
LoadAdapter reserves a free slot (`reserve`), loads the files meanwhile, and only then makes
the name servable (`commit`), or frees the slot again (`release`); UnloadAdapter `remove`s a
name. A request finds its adapter by name at Prepare, so one admitted before its adapter was
unloaded fails there (NOT_FOUND) instead of running on whatever the slot holds next.
Event-loop thread only.
"""

from __future__ import annotations

from collections.abc import Sequence

from llm_runner_svc.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)

MAX_NAME_CHARS = 128


class AdapterTable:
    def __init__(self, num_slots: int, initial: Sequence[str] = ()) -> None:
        self.num_slots = num_slots
        self._names: list[str | None] = [None] * num_slots  # slot k at index k - 1
        self._names[:len(initial)] = list(initial)
        self._loading: dict[int, str] = {}  # slot -> name being loaded into it

    @property
    def names(self) -> list[str]:
        """The names requests may give, in slot order."""
        return [n for n in self._names if n is not None]

    def by_slot(self) -> list[str | None]:
        """The name in each slot 1 .. num_slots (None: empty or loading)."""
        return list(self._names)

    def slot_of(self, name: str) -> int:
        """The slot serving `name`; NotFound naming the served ones."""
        if name in self._names:
            return self._names.index(name) + 1
        raise NotFound(f"LoRA adapter {name!r} is unknown to this stage; it serves "
                       f"{self.names}")

    def reserve(self, name: str) -> int:
        """A free slot for `name`, held until `commit` or `release`."""
        if not self.num_slots:
            raise FailedPrecondition("this stage holds no LoRA adapter slots (maxLoras 0)")
        if not name or len(name) > MAX_NAME_CHARS or not name.isprintable():
            raise InvalidArgument(f"LoRA adapter name {name[:MAX_NAME_CHARS]!r}: 1 to "
                                  f"{MAX_NAME_CHARS} printable characters")
        if name in self._names or name in self._loading.values():
            raise AlreadyExists(f"LoRA adapter {name!r} is already loaded (or loading)")
        free = [k for k in range(1, self.num_slots + 1)
                if self._names[k - 1] is None and k not in self._loading]
        if not free:
            raise ResourceExhausted(f"maxLoras {self.num_slots} adapters are resident "
                                    f"({self.names}); unload one first")
        self._loading[free[0]] = name
        return free[0]

    def commit(self, slot: int) -> None:
        self._names[slot - 1] = self._loading.pop(slot)

    def release(self, slot: int) -> None:
        self._loading.pop(slot, None)

    def remove(self, name: str) -> int:
        """Stop serving `name`; returns the slot it held."""
        slot = self.slot_of(name)
        self._names[slot - 1] = None
        return slot
