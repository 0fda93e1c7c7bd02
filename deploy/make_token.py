"""Create the deployment's control-plane token once: `python deploy/make_token.py /run/tlt/token`.

docker-compose.yml runs this as its one-shot `token` service before the rollout, drafter and trainer
start; they read the file through TLT_AUTH_TOKEN_FILE, so `MODEL_PATH=... docker compose up` guards
weight updates with no set-up (the rollout binds 0.0.0.0 there and refuses every weight update
without a token). The file lives in a named volume and is kept across restarts: only a missing or
empty file is (re)written, atomically, readable by its owner only. A TLT_AUTH_TOKEN exported in the
shell beats the file (services/common/auth.py), for trainers run outside Compose.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path


def ensure_token(path: Path) -> bool:
    """Write a fresh 256-bit token to `path` unless it already holds one; True when it wrote."""
    try:
        if path.read_text().strip():
            return False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return True


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python deploy/make_token.py FILE", file=sys.stderr)
        return 2
    path = Path(argv[0])
    wrote = ensure_token(path)
    print(f"control token {'written to' if wrote else 'kept in'} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
