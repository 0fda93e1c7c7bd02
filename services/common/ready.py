"""`--ready-file PATH` of the servers: their bound ports and pids as JSON, written atomically once they serve
(a reader never sees a half-written file), in a folder created if missing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_ready_file(path: str, facts: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(facts))
    tmp.replace(path)
