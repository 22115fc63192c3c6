"""``resume slurm status RUN``: where a supervised run stands, from the hook's event log
(``RUN/cluster/events.jsonl``): its last launch, its last hang (with the suspects and where
their stacks are), the last stragglers named, the nodes the current allocation left out.

The log is untrusted: only its last ``TAIL`` bytes are read, each line parsed as JSON on its
own; a line that is not an event is skipped.
"""

from __future__ import annotations

from typing import Any

from resume.storage import Storage
from resume.text import clip, parse_json, short

from .events import EVENTS

__all__ = ["TAIL", "hang_line", "read_events", "status_of"]

TAIL = 4 << 20
"""Bytes of the event log read from its end."""
LEFT_OUT = ("hung_node_excluded", "straggler_replaced", "nodes_failed", "nodes_removed")


def read_events(storage: Storage) -> list[dict]:
    """The log's last events, oldest first (FileNotFoundError when the hook never ran)."""
    size = storage.size(EVENTS)
    with storage.open_read(EVENTS) as f:
        if size > TAIL:
            f.seek(size - TAIL)
        data = f.read(TAIL)
    lines = data.split(b"\n")
    if size > TAIL:
        lines = lines[1:]  # the first is cut
    out = []
    for line in lines:
        try:
            rec = parse_json(line) if line.strip() else None
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("event"), str):
            out.append(rec)
    return out


def hang_line(e: dict) -> str:
    """One hang event in one line: when, what, the suspects and their nodes, the stacks."""
    suspects = e.get("suspects") or []
    who = (f"suspect rank {','.join(map(str, suspects[:8]))} on {','.join(map(str, (e.get('suspect_nodes') or [])[:8]))}"
           if suspects else "no single suspect")
    return (f"{clip(str(e.get('at', '?')), 40)}: no progress in {clip(str(e.get('phase', '?')), 40)} for "
            f"{short(e.get('quiet_s'))}s (bound {short(e.get('bound_s'))}s) at iteration {short(e.get('iteration'))}; "
            f"{who}; stacks {clip(str(e.get('stacks', '?')), 300)}")


def status_of(events: list[dict]) -> dict[str, Any]:
    """The summary ``resume slurm status`` prints."""
    def last(*kinds: str) -> dict | None:
        return next((e for e in reversed(events) if e["event"] in kinds), None)

    # Left out by this allocation: since its hook's start; a node Slurm reports healthy again is back.
    starts = [i for i, e in enumerate(events) if e["event"] == "start"]
    left_out: list[str] = []
    for e in events[starts[-1] if starts else 0:]:
        nodes = [clip(str(n), 255) for n in e.get("nodes") or []] if isinstance(e.get("nodes"), list) else []
        if e["event"] in LEFT_OUT:
            left_out += [n for n in dict.fromkeys(nodes) if n not in left_out]
        elif e["event"] == "nodes_back":
            left_out = [n for n in left_out if n not in nodes]
    hang = last("hang")
    return {"last_launch": last("launch"), "last_hang": hang, "last_hang_line": hang_line(hang) if hang else None,
            "hangs": sum(e["event"] == "hang" for e in events), "last_stragglers": last("stragglers"),
            "left_out": left_out, "last_event": events[-1] if events else None}
