"""events.jsonl: one JSON object per guard or router-health event, next to metrics.jsonl.

{"step": int, "kind": one of KINDS, "message": str}, appended and flushed at once by process 0
(a killed run leaves at most a truncated last line). The message is the one printed on stderr.
"""

from __future__ import annotations

import json
from pathlib import Path

# skip: an update left out (non-finite); spike: a loss / grad-norm spike seen (then skipped or
# rolled back); rollback: a checkpoint restored; stop: the run stopped by a guard; router /
# dead_experts: router health; warning: a threshold passed (activation RMS, update ratio)
KINDS = ("skip", "rollback", "stop", "spike", "router", "dead_experts", "warning")


class EventLog:
    """Appends events to `path` (None: records nothing, as on every process but 0)."""

    def __init__(self, path: Path | None):
        self.file = open(path, "a") if path is not None else None

    def emit(self, step: int, kind: str, message: str) -> None:
        """Records one event; `kind` must be one of KINDS."""
        if kind not in KINDS:
            raise ValueError(f"event kind {kind!r} is not one of {KINDS}")  # a bug, not the user's
        if self.file is not None:
            self.file.write(json.dumps({"step": int(step), "kind": kind, "message": message})
                            + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
