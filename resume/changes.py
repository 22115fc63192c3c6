"""Settings in the code that differ from the checkpoint: refused unless named as intended.

Compared before anything is loaded: the structure of every optimizer (param groups and the
parameters each holds), every scalar setting of each group, and the schedule's configuration.
Another structure is a ``ContinuityError`` naming the optimizer, the group and both shapes; another
setting is a ``ContinuityError`` naming optimizer, group, field and both values, unless accepted
(``Coordinator(accept_changes=[...])`` or ``RESUME_ACCEPT_CHANGES``). An accepted change keeps the
code's value and is recorded in the next manifest as ``changes: [{step, item, from, to}]``. A name
matches an item when it is the item, a prefix of it or its last field; ``lr`` and ``initial_lr``
name the peak LR (the groups' ``initial_lr`` and the schedulers' ``base_lrs``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ContinuityError, UsageError
from .text import short

__all__ = ["ACCEPT_ENV", "AcceptChanges", "Change", "check_structure", "schedule_changes", "setting_changes"]

ACCEPT_ENV = "RESUME_ACCEPT_CHANGES"
"""Comma-separated names of accepted changes, for a requeued job (added to the constructor's)."""

_PEAK_ALIASES = {"lr", "initial_lr"}
_PEAK_ITEMS = {"initial_lr", "base_lrs"}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\[\d+\])?(\.[A-Za-z_][A-Za-z0-9_]*(\[\d+\])?)*$")


@dataclass(frozen=True)
class Change:
    """One setting whose value in the code differs from the checkpoint's."""

    item: str
    """``optimizer[i].group[j].FIELD`` or ``schedule[i].KEY``."""
    saved: Any
    live: Any
    where: str = ""
    """For messages: the optimizer's class and the group's name."""

    def record(self, step: int) -> dict:
        return {"step": step, "item": self.item, "from": self.saved, "to": self.live}


@dataclass(frozen=True)
class AcceptChanges:
    """The changes a restart may apply (names as in the module docstring)."""

    names: tuple[str, ...] = ()

    @classmethod
    def parse(cls, names: Iterable[str] | str | None, *, env: Mapping[str, str] = os.environ) -> AcceptChanges:
        given = [("accept_changes", n) for n in ([names] if isinstance(names, str) else list(names or ()))]
        # In the environment, empty items (a trailing comma) are nothing; given by name, a mistake.
        given += [(ACCEPT_ENV, n) for n in env.get(ACCEPT_ENV, "").split(",") if n.strip()]
        out = []
        for source, name in given:
            name = name.strip() if isinstance(name, str) else name
            if not isinstance(name, str) or not _NAME.match(name):
                raise UsageError(f"{source}: expected names like 'weight_decay', 'optimizer[0]', "
                                 f"'schedule[0].base_lrs', actual {name!r}")
            out.append(name)
        return cls(tuple(dict.fromkeys(out)))

    def __bool__(self) -> bool:
        return bool(self.names)

    def accepts(self, item: str) -> bool:
        last = item.rsplit(".", 1)[-1]
        for name in self.names:
            if name in _PEAK_ALIASES and last in _PEAK_ITEMS:
                return True
            if item == name or last == name or item.startswith((name + ".", name + "[")):
                return True
        return False


def _group_label(opt_index: int, opt: dict, group_index: int, group: dict | None) -> str:
    name = (group or {}).get("name")
    return (f"optimizer[{opt_index}] ({opt.get('class', '?')}) group[{group_index}]"
            + (f" {name!r}" if name is not None else ""))


def _shape(groups: list[dict]) -> str:
    return "[" + ", ".join(f"{i}{' ' + repr(g.get('name')) if g.get('name') is not None else ''}: "
                           f"{g.get('params')} params" for i, g in enumerate(groups)) + "]"


_REBUILD_HINT = ("the program builds another optimizer structure than the checkpoint holds (a stage "
                 "change?): read the checkpoint's values with coord.peek() before building the optimizers "
                 "(runbooks/restart-refused.md)")


def check_structure(saved: list[dict], live: list[dict]) -> None:
    """Raise ContinuityError when the optimizers' structure differs (never a corrupt checkpoint)."""
    if len(saved) != len(live):
        raise ContinuityError("optimizers", f"{len(saved)} ({', '.join(o.get('class', '?') for o in saved)})",
                              f"{len(live)} ({', '.join(o.get('class', '?') for o in live)})", _REBUILD_HINT)
    for i, (s, a) in enumerate(zip(saved, live)):
        if s.get("class") != a.get("class"):
            raise ContinuityError(f"optimizer[{i}].class", s.get("class"), a.get("class"), _REBUILD_HINT)
        s_groups, a_groups = s.get("groups", []), a.get("groups", [])
        if len(s_groups) != len(a_groups):
            raise ContinuityError(f"optimizer[{i}].param_groups ({s.get('class')})",
                                  f"{len(s_groups)} groups {_shape(s_groups)}",
                                  f"{len(a_groups)} groups {_shape(a_groups)}", _REBUILD_HINT)
        for j, (sg, ag) in enumerate(zip(s_groups, a_groups)):
            label = _group_label(i, s, j, sg)
            if sg.get("params") != ag.get("params"):
                raise ContinuityError(f"{label}.params", f"{sg.get('params')} parameters",
                                      f"{ag.get('params')} parameters", _REBUILD_HINT)
            if sg.get("names") != ag.get("names"):
                raise ContinuityError(f"{label}.params", f"parameters {sg.get('names')}",
                                      f"other parameters {ag.get('names')}", _REBUILD_HINT)


def setting_changes(saved: list[dict], live: list[dict]) -> list[Change]:
    """Every param-group setting whose code value differs from the checkpoint's (structure equal)."""
    out = []
    for i, (s, a) in enumerate(zip(saved, live)):
        for j, (sg, ag) in enumerate(zip(s.get("groups", []), a.get("groups", []))):
            s_set, a_set = sg.get("settings", {}), ag.get("settings", {})
            moving = set(a.get("moving", []))
            # A field the checkpoint did not record (a newer torch added a default) is not a change;
            # nor is one the code now declares moving (the load restores it).
            for key in sorted(s_set):
                if key not in moving and s_set[key] != a_set.get(key):
                    out.append(Change(f"optimizer[{i}].group[{j}].{key}", s_set[key], a_set.get(key),
                                      _group_label(i, s, j, sg)))
    return out


def schedule_changes(saved: list[dict], live: list[dict]) -> list[Change]:
    """Every scheduler setting whose code value differs; another number of schedulers is refused."""
    if len(saved) != len(live):
        raise ContinuityError("schedule", f"{len(saved)} schedulers "
                              f"({', '.join(str(s.get('class')) for s in saved)})",
                              f"{len(live)} schedulers ({', '.join(str(s.get('class')) for s in live)})",
                              "the program declares other schedules than the checkpoint recorded")
    out = []
    for i, (s, a) in enumerate(zip(saved, live)):
        for key in sorted(set(s) | set(a)):
            if s.get(key) != a.get(key):
                out.append(Change(f"schedule[{i}].{key}", s.get(key), a.get(key), f"schedule[{i}] ({s.get('class')})"))
    return out


def refuse(change: Change, *, hint: str = "") -> ContinuityError:
    name = change.item.rsplit(".", 1)[-1]
    return ContinuityError(
        change.item, short(change.saved), short(change.live),
        f"{change.where}: the code sets another value than the checkpoint holds; "
        f"{hint or 'to train on with the code value, accept it'}: "
        f"Coordinator(accept_changes=[{name!r}]) or {ACCEPT_ENV}={name} (runbooks/restart-refused.md)")

