"""Control-plane auth, the OpenAI API key and loopback checks, shared by every server.

Control plane = any call that changes a server's state or hands out its weights
(today: `tlt.v1.Rollout/UpdateWeights`, for policy and drafter weights, and
`tlt.v1.Rollout/GetWeights`). The rule, applied by
`ControlAuth.check` (constant-time comparison):

    token configured (TLT_AUTH_TOKEN, TLT_AUTH_TOKEN_FILE or the config's control_token)
        -> the call must carry gRPC metadata `authorization: Bearer <token>`; else UNAUTHENTICATED
    no token configured
        -> refused (UNAUTHENTICATED), unless the server binds loopback only AND
           `insecure_local` (`--insecure-local`) was set explicitly

A token loses its surrounding whitespace whatever its source (a Kubernetes Secret made from a file written by
`echo` ends in a newline); one that is blank after that, or holds a character an `authorization` metadata value
cannot carry (printable ASCII only), is refused where it is read (AuthConfigError, a ConfigError: one line).

`tlt run` generates a random token per run and hands it to every child via
TLT_AUTH_TOKEN (services/trainer/launcher.py), so a local run needs no setup;
clients (`RolloutClient`) read the same variable when no token is passed.

Data plane: the OpenAI endpoints take an optional API key (`TLT_API_KEY` or
the rollout config's `api_key`): when set, `Authorization: Bearer <key>` is
required on /v1/*, else 401 in OpenAI's error format (http_api.py). The key loses its surrounding whitespace
whatever its source, as a token does; one blank after that, or with a control character inside, is refused.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from tlt.services.common.config import ConfigError

TOKEN_ENV = "TLT_AUTH_TOKEN"
TOKEN_FILE_ENV = "TLT_AUTH_TOKEN_FILE"
API_KEY_ENV = "TLT_API_KEY"

class AuthConfigError(ConfigError):
    """A control token that cannot be used: its file cannot be read, or it is blank or holds a character gRPC
    metadata cannot carry. A ConfigError, so a command refuses it in one line (`bad_config`)."""


# The sources, in the order resolve_token reads them, as the error messages name them.
_CONFIG_SOURCE = "the config's token ([rollout] control_token, [trainer] rollout_token or [drafter] control_token)"


def _clean(token: str, source: str, what: str = "token") -> str:
    """The token without surrounding whitespace (a Secret made from a file written by `echo` ends in a newline);
    refused when nothing is left or when it holds what an `authorization` metadata value cannot carry
    (gRPC allows printable ASCII, 0x20-0x7E). The message names the source, never the token."""
    token = token.strip()
    if not token:
        raise AuthConfigError(f"{source}: the {what} is blank; set one or leave it empty")
    for i, ch in enumerate(token):
        if not " " <= ch <= "~":
            raise AuthConfigError(f"{source}: the {what} holds {ch!r} at position {i}; a {what} is printable ASCII "
                                  "(no newline, tab or other control character inside it)")
    return token


def resolve_token(explicit: str = "", environ: Mapping[str, str] | None = None) -> str:
    """The control token: the explicit (config) value, else $TLT_AUTH_TOKEN, else the file in $TLT_AUTH_TOKEN_FILE.

    Each without surrounding whitespace; a source that holds only whitespace, or a token with a character gRPC
    metadata cannot carry, raises AuthConfigError. An empty value means that source is not set."""
    if explicit:
        return _clean(explicit, _CONFIG_SOURCE)
    env = os.environ if environ is None else environ
    if env.get(TOKEN_ENV):
        return _clean(env[TOKEN_ENV], TOKEN_ENV)
    path = env.get(TOKEN_FILE_ENV)
    if path:
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise AuthConfigError(f"{TOKEN_FILE_ENV}={path}: cannot read the token file ({e})") from e
        if not text.strip():
            raise AuthConfigError(f"{TOKEN_FILE_ENV}={path}: the token file is empty")
        return _clean(text, f"{TOKEN_FILE_ENV}={path}")
    return ""


def resolve_api_key(explicit: str = "", environ: Mapping[str, str] | None = None) -> str:
    """The OpenAI API key: the explicit (config) value, else $TLT_API_KEY; empty means no key is required.

    Each without surrounding whitespace, as a control token (the config's kept a Secret file's newline, and every
    client was refused 401); one blank after that, or with a character a header cannot carry, is AuthConfigError."""
    if explicit:
        return _clean(explicit, "the config's API key ([rollout] api_key)", "API key")
    env = os.environ if environ is None else environ
    if env.get(API_KEY_ENV):
        return _clean(env[API_KEY_ENV], API_KEY_ENV, "API key")
    return ""


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe)."""
    import secrets

    return secrets.token_urlsafe(32)


def is_loopback(address: str) -> bool:
    """True for 127.0.0.0/8, ::1 and 'localhost' (a bare host, host:port, [v6]:port or tcp://host:port)."""
    host = address.strip()
    if "://" in host:
        host = urlsplit(host).hostname or ""
    elif host.startswith("["):
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bearer(token: str) -> str:
    return f"Bearer {token}"


def token_matches(header: str, token: str) -> bool:
    """Constant-time check of an `authorization` value ('Bearer <token>') against the token."""
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())


@dataclass(frozen=True)
class ControlAuth:
    """The control-plane policy of one server."""

    token: str
    insecure_local: bool
    host: str

    @classmethod
    def build(cls, host: str, explicit_token: str = "", insecure_local: bool = False) -> ControlAuth:
        return cls(resolve_token(explicit_token), insecure_local, host)

    @property
    def mode(self) -> str:
        """'token', 'insecure-local' (loopback, no token, explicitly allowed) or 'refuse-all'."""
        if self.token:
            return "token"
        if self.insecure_local and is_loopback(self.host):
            return "insecure-local"
        return "refuse-all"

    def check(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """None when the call may go on, else the reason it is refused."""
        mode = self.mode
        if mode == "insecure-local":
            return None
        if mode == "refuse-all":
            why = "the server binds a non-loopback address" if self.insecure_local else "--insecure-local is not set"
            return (f"control-plane calls are refused: no control token is configured ({TOKEN_ENV} or "
                    f"{TOKEN_FILE_ENV}) and {why}")
        headers = [value.decode(errors="replace") if isinstance(value, bytes) else value
                   for key, value in metadata or () if key.lower() == "authorization"]
        if len(headers) > 1:  # which one a proxy or a server would read is not defined: read neither
            return "control-plane call with more than one 'authorization' metadata entry"
        header = headers[0] if headers else ""
        if not header:
            return "control-plane call without 'authorization: Bearer <token>' metadata"
        if not token_matches(header, self.token):
            return "control-plane call with a wrong token"
        return None
