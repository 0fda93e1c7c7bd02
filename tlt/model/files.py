"""Weight files other processes read: readable as the umask says, like every other file written beside them.

safetensors 0.8's `save_file` (and so `save_pretrained`) leaves its file 0600 whatever the umask: it writes a
private temporary file and renames it into place. The config.json beside it is 0644 under the usual umask 022,
and a rollout server, an SGLang process or a colleague running as another user could read the config but not
the weights. `share_weights(folder)` gives each `*.safetensors` in the folder the mode a plain file gets.
"""

from __future__ import annotations

import os
from pathlib import Path


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc), else by setting it back."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share_weights(folder: str | Path) -> None:
    """chmod every `*.safetensors` file directly in `folder` to 0666 less the umask (what open() would give)."""
    mode = 0o666 & ~_umask()
    for path in Path(folder).glob("*.safetensors"):
        os.chmod(path, mode)
