"""Clients written for vLLM send its extension parameters at their defaults (`repetition_penalty: 1.0`,
`skip_special_tokens: true`, ...): each was refused as an unknown parameter, so such a client could not talk to
this server at all. They are now taken at the values that are this server's behaviour and refused, naming the
parameter, at any other.

Real parts: the rollout server on 127.0.0.1 (native engine, one replica process), the openai SDK.
"""

from __future__ import annotations

import openai
import pytest
from rollout_helpers import ServerThread, tiny_checkpoint

DEFAULTS = {"repetition_penalty": 1.0, "min_tokens": 0, "skip_special_tokens": True,
            "spaces_between_special_tokens": True, "include_stop_str_in_output": False}
OTHERS = {"repetition_penalty": 1.2, "min_tokens": 3, "skip_special_tokens": False,
          "spaces_between_special_tokens": False, "include_stop_str_in_output": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerThread(tiny_checkpoint(tmp_path_factory.mktemp("vllm-params-model")), replicas=1) as s:
        yield s


def test_vllm_parameters_at_their_defaults_are_taken_and_change_nothing(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    plain = client.completions.create(model=server.model_name, prompt="1+2=", max_tokens=6, temperature=0)
    with_defaults = client.completions.create(model=server.model_name, prompt="1+2=", max_tokens=6, temperature=0,
                                              extra_body={**DEFAULTS, "repetition_penalty": 1})
    assert with_defaults.choices[0].text == plain.choices[0].text
    chat = client.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": "1+2="}],
                                          max_tokens=6, temperature=0, extra_body=DEFAULTS)
    assert chat.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("name", sorted(OTHERS))
def test_a_vllm_parameter_at_another_value_is_a_400_naming_it(server, name):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model_name, prompt="1+2=", max_tokens=2,
                                  extra_body={name: OTHERS[name]})
    assert e.value.body["param"] == name and "vLLM's default" in e.value.body["message"], e.value.body
