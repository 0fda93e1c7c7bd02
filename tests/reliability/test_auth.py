"""Control-plane auth, the OpenAI API key and loopback rules (services/common/auth.py), unit and end to end.

Unit: token resolution order (config, TLT_AUTH_TOKEN, TLT_AUTH_TOKEN_FILE),
loopback detection, the three ControlAuth modes, Bearer parsing. End to end: a
real rollout server (real replica process, real grpc.aio, real uvicorn) on
127.0.0.1 with an explicit control token and an API key: UpdateWeights without
or with a wrong token is UNAUTHENTICATED and changes nothing, /v1/* without the
key is 401 in OpenAI's error format, and both are counted in
rollout_rejected_total{reason}. A second server with no token at all shows
the default (refuse) and the explicit `insecure_local` opt-in on loopback.
Nothing is faked.
"""

from __future__ import annotations

import re

import grpc
import httpx
import pytest
import safetensors.torch

from rollout_helpers import ServerThread, tiny_checkpoint
from tlt.services.common.auth import (
    AuthConfigError,
    ControlAuth,
    is_loopback,
    resolve_api_key,
    resolve_token,
    token_matches,
)
from tlt.services.rollout.client import RolloutClient, WeightPushError

TOKEN = "control-" + "x" * 20
API_KEY = "sk-test-key"


# ---- unit ---------------------------------------------------------------------------------------


def test_token_resolution_order(tmp_path):
    f = tmp_path / "token"
    f.write_text("from-file\n")
    assert resolve_token("explicit", {"TLT_AUTH_TOKEN": "env", "TLT_AUTH_TOKEN_FILE": str(f)}) == "explicit"
    assert resolve_token("", {"TLT_AUTH_TOKEN": "env", "TLT_AUTH_TOKEN_FILE": str(f)}) == "env"
    assert resolve_token("", {"TLT_AUTH_TOKEN_FILE": str(f)}) == "from-file"
    assert resolve_token("", {}) == ""
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(AuthConfigError, match="empty"):
        resolve_token("", {"TLT_AUTH_TOKEN_FILE": str(tmp_path / "empty")})
    with pytest.raises(AuthConfigError, match="cannot read"):
        resolve_token("", {"TLT_AUTH_TOKEN_FILE": str(tmp_path / "missing")})
    assert resolve_api_key("", {"TLT_API_KEY": "k"}) == "k"
    assert resolve_api_key("", {}) == ""


def test_tokens_lose_surrounding_whitespace_from_every_source(tmp_path):
    """A Secret made from a file written by `echo` ends in a newline, in the config field as in the variables: the
    token is the text without it (gRPC metadata cannot carry a newline; the client's was stripped, not the server's)."""
    f = tmp_path / "token"
    f.write_text(" t0k\r\n")
    assert resolve_token("t0k\n", {}) == "t0k"  # [rollout] control_token / TLT_ROLLOUT__CONTROL_TOKEN
    assert resolve_token("  t0k \n", {"TLT_AUTH_TOKEN": "other"}) == "t0k"
    assert resolve_token("", {"TLT_AUTH_TOKEN": "t0k\n"}) == "t0k"
    assert resolve_token("", {"TLT_AUTH_TOKEN_FILE": str(f)}) == "t0k"
    assert ControlAuth.build("0.0.0.0", "t0k\n").check([("authorization", "Bearer t0k")]) is None


@pytest.mark.parametrize("explicit,environ,names", [
    ("t0k\nmore", {}, "control_token"),
    ("", {"TLT_AUTH_TOKEN": "t\x00k"}, "TLT_AUTH_TOKEN"),
    ("", {"TLT_AUTH_TOKEN": "t\u00e9k"}, "TLT_AUTH_TOKEN"),
    ("", {"TLT_AUTH_TOKEN_FILE": "FILE"}, "TLT_AUTH_TOKEN_FILE"),
    (" \n", {"TLT_AUTH_TOKEN": "env"}, "control_token"),  # whitespace only: a mistake, not "no token"
    ("", {"TLT_AUTH_TOKEN": "\n"}, "TLT_AUTH_TOKEN"),
])
def test_a_token_grpc_metadata_cannot_carry_is_refused(tmp_path, explicit, environ, names):
    """Refused where it is read, in one line naming the source, rather than as a gRPC traceback at the first call."""
    from tlt.services.common.config import ConfigError

    f = tmp_path / "token"
    f.write_text("abc\tdef\n")
    environ = {k: (str(f) if v == "FILE" else v) for k, v in environ.items()}
    with pytest.raises(AuthConfigError, match=names) as e:
        resolve_token(explicit, environ)
    assert "\n" not in str(e.value) and ("printable ASCII" in str(e.value) or "blank" in str(e.value))
    assert isinstance(e.value, ConfigError)  # the CLI's one-line `bad_config`, no traceback


@pytest.mark.parametrize("address,loopback", [
    ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("localhost", True), ("127.0.0.1:50051", True),
    ("[::1]:50051", True), ("tcp://127.0.0.1:5701", True), ("tcp://[::1]:5701", True),
    ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("tcp://0.0.0.0:5701", False), ("tcp://*:5701", False),
    ("example.com", False), ("", False), ("0:0:0:0:0:0:0:1", True), ("tcp://[0:0:0:0:0:0:0:1]:5701", True),
])
def test_is_loopback(address, loopback):
    assert is_loopback(address) is loopback


def test_bearer_parsing_is_strict():
    assert token_matches("Bearer abc", "abc")
    assert token_matches("bearer abc", "abc")
    assert not token_matches("abc", "abc")  # no scheme
    assert not token_matches("Bearer abcd", "abc")
    assert not token_matches("Basic abc", "abc")
    assert not token_matches("Bearer ", "")  # an empty configured token never matches
    assert token_matches("Bearer  abc", "abc") and token_matches("Bearer abc ", "abc")  # spacing is no part of it


def test_the_api_key_loses_surrounding_whitespace_from_every_source():
    """`TLT_ROLLOUT__API_KEY` from a Secret file written by `echo` ends in a newline: the key kept it, and every
    client, sending `Bearer <key>`, was refused 401 (TLT_API_KEY with the same newline worked). A key that is blank
    once stripped is refused where it is read, as a blank control token is, never read as "no key required"."""
    assert resolve_api_key("k3y\n", {}) == "k3y"  # [rollout] api_key / TLT_ROLLOUT__API_KEY
    assert resolve_api_key(" k3y ", {"TLT_API_KEY": "other"}) == "k3y"
    assert resolve_api_key("", {"TLT_API_KEY": "k3y\r\n"}) == "k3y"
    for explicit, environ in (("  \n", {}), ("", {"TLT_API_KEY": " \n"}), ("k\ney", {})):
        with pytest.raises(AuthConfigError) as e:
            resolve_api_key(explicit, environ)
        assert "API key" in str(e.value) and "\n" not in str(e.value)


def test_a_token_may_hold_any_printable_ascii_a_space_included():
    assert resolve_token("pass phrase ~!", {}) == "pass phrase ~!"  # 0x20-0x7E: an `authorization` value carries it
    assert resolve_token("", {"TLT_AUTH_TOKEN": " pass phrase \n"}) == "pass phrase"


def test_control_auth_modes():
    md_ok = [("authorization", "Bearer t")]
    with_token = ControlAuth("t", False, "0.0.0.0")
    assert with_token.mode == "token"
    assert with_token.check(md_ok) is None
    assert "without" in with_token.check([])
    assert "wrong token" in with_token.check([("authorization", "Bearer nope")])
    assert with_token.check([("authorization", b"Bearer t")]) is None  # binary metadata values too
    # two entries: which one counts is not defined (the last won: a wrong one sent after the right one passed)
    for twice in ([("authorization", "Bearer t"), ("authorization", "Bearer nope")],
                  [("authorization", "Bearer nope"), ("authorization", "Bearer t")],
                  [("authorization", "Bearer t"), ("Authorization", "Bearer t")]):
        assert "more than one" in with_token.check(twice)
    # no token: refused by default, even on loopback
    assert ControlAuth("", False, "127.0.0.1").mode == "refuse-all"
    assert "--insecure-local is not set" in ControlAuth("", False, "127.0.0.1").check(md_ok)
    # the explicit opt-in works on loopback only
    assert ControlAuth("", True, "127.0.0.1").check([]) is None
    exposed = ControlAuth("", True, "0.0.0.0")
    assert exposed.mode == "refuse-all"
    assert "non-loopback" in exposed.check(md_ok)


# ---- end to end -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("auth-model"))


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerThread(model_dir, control_token=TOKEN, api_key=API_KEY) as s:
        yield s


def _rejected(server, reason: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{server.server.http_port}/metrics", timeout=30).text
    m = re.search(r'^rollout_rejected_total\{reason="%s"\} ([0-9.e+]+)$' % re.escape(reason), text, re.M)
    return float(m.group(1)) if m else 0.0


def _lm_head(model_dir):
    return {"lm_head.weight": safetensors.torch.load_file(str(model_dir / "model.safetensors"))["lm_head.weight"]}


def test_update_weights_needs_the_bearer_token(server, model_dir):
    tensors = _lm_head(model_dir)
    before_count = _rejected(server, "unauthenticated")
    with RolloutClient(server.grpc_address, control_token=TOKEN, timeout_s=60) as good:
        before = good.status().versions.policy
        for token in ("wrong", TOKEN[:-1], TOKEN + "x"):
            with RolloutClient(server.grpc_address, control_token=token, timeout_s=60) as bad:
                with pytest.raises(grpc.RpcError) as e:
                    bad.update_weights(tensors, "policy", before + 1)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "wrong token" in e.value.details()
        # no metadata at all, and the token without the Bearer scheme
        for metadata in (None, (("authorization", TOKEN),)):
            from tlt.services.common.weights import iter_chunks, pack_state_dict
            from tlt.v1 import common_pb2

            manifest, payload = pack_state_dict(tensors, common_pb2.WEIGHT_KIND_POLICY, before + 1)
            with pytest.raises(grpc.RpcError) as e:
                good.stub.UpdateWeights(iter_chunks(manifest, payload), metadata=metadata, timeout=60)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert good.status().versions.policy == before  # nothing applied
        assert _rejected(server, "unauthenticated") >= before_count + 5
        resp = good.update_weights(tensors, "policy", before + 1)  # the right token goes through
        assert resp.ok and good.status().versions.policy == before + 1


def test_openai_endpoints_need_the_api_key(server):
    base = server.base_url
    body = {"model": server.model_name, "prompt": "1+1=", "max_tokens": 2}
    before = _rejected(server, "unauthenticated")
    answered = _answered(server, "completions", "401")
    twice = [("Authorization", "Bearer wrong"), ("Authorization", f"Bearer {API_KEY}")]  # ambiguous: refused
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, twice, twice[::-1]):
        r = httpx.post(f"{base}/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 401
        err = r.json()["error"]
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key" and err["message"]
        assert httpx.get(f"{base}/models", headers=headers, timeout=30).status_code == 401
    ok = httpx.post(f"{base}/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"]
    # health and metrics stay open for probes
    assert httpx.get(f"http://127.0.0.1:{server.server.http_port}/health", timeout=30).status_code == 200
    assert _rejected(server, "unauthenticated") >= before + 10
    # the refusals are answers of the endpoint: in http_requests_total beside its 200s (they were left out)
    assert _answered(server, "completions", "401") == answered + 5


def _answered(server, endpoint: str, status: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{server.server.http_port}/metrics", timeout=30).text
    line = f'rollout_http_requests_total{{endpoint="{endpoint}",status="{status}"}} '
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line))


def test_openai_client_with_the_key(server):
    import openai

    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60)
    assert client.completions.create(model=server.model_name, prompt="2+2=", max_tokens=2).choices
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="nope", max_retries=0, timeout=60).models.list()


def test_a_token_with_a_trailing_newline_on_both_ends(model_dir, tmp_path):
    """The repro: rollout and trainer given the same Secret value, ending in a newline. The trainer's push goes
    through (it crashed with grpc 'Illegal header value'), as does a client sending the clean token (refused)."""
    tensors = _lm_head(model_dir)
    with ServerThread(model_dir, control_token=TOKEN + "\n") as s:
        for token in (TOKEN + "\n", TOKEN):
            with RolloutClient(s.grpc_address, control_token=token, timeout_s=60) as c:
                version = c.status().versions.policy
                assert c.update_weights(tensors, "policy", version + 1).ok
                assert c.status().versions.policy == version + 1


def test_no_token_refuses_unless_insecure_local(model_dir, monkeypatch):
    """No token anywhere: refused by default; `insecure_local` on 127.0.0.1 lets an unauthenticated push in."""
    monkeypatch.delenv("TLT_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("TLT_AUTH_TOKEN_FILE", raising=False)
    tensors = _lm_head(model_dir)
    with ServerThread(model_dir) as s, RolloutClient(s.grpc_address, timeout_s=60) as c:
        assert s.server.config.host == "127.0.0.1"  # the default bind is loopback
        with pytest.raises(grpc.RpcError) as e:
            c.update_weights(tensors, "policy", 1)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "--insecure-local" in e.value.details()
        assert c.status().versions.policy == 0
    with ServerThread(model_dir, insecure_local=True) as s, RolloutClient(s.grpc_address, timeout_s=60) as c:
        resp = c.update_weights(tensors, "policy", 1)
        assert resp.ok and c.status().versions.policy == 1
    _ = WeightPushError  # (imported for readers: a refused push with ok=false raises it; auth refusals are RpcErrors)
