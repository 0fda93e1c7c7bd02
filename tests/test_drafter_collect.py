"""`engine_samples` (what `tlt drafter warmup` collects with) against an independent reference: the
one-prompt `transformers` loop of `sample_features`, on a tiny random Qwen2.

Greedy, both must give the same responses, and the engine's features (the state each response token was
sampled from, fp16) must be the `transformers` forward's at the same positions. The engine's windows are
the rollout's format, [p_last, r_0, .., r_{R-2}]: the reference's windows from p_last without their last row.
Sampled, a sequence's draw depends only on its seed, not on what else is in flight.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tlt.model.testing import random_checkpoint
from tlt.services.drafter.collect import engine_samples, features_message, sample_features


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return random_checkpoint(tmp_path_factory.mktemp("collect") / "m")


PROMPTS = [[5, 17, 33, 2 + k, 9] for k in range(3)] + [[40, 41, 42, 43, 44, 45, 46, 47, 48]]


def _joined(windows) -> tuple[np.ndarray, np.ndarray]:
    """One sequence's windows (one token of overlap) back into its tokens and features."""
    tokens = [windows[0].tokens] + [w.tokens[1:] for w in windows[1:]]
    feats = [windows[0].features] + [w.features[1:] for w in windows[1:]]
    return np.concatenate(tokens), np.concatenate(feats)


def _by_seq(samples) -> dict[str, list]:
    out: dict[str, list] = {}
    for s in samples:
        out.setdefault(s.seq_id.rsplit("@", 1)[0], []).append(s)
    return out


def test_greedy_engine_samples_match_the_transformers_loop(model_dir) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = AutoTokenizer.from_pretrained(model_dir).eos_token_id
    got = _by_seq(engine_samples(model_dir, PROMPTS, 24, temperature=0.0, window_tokens=8))
    assert sorted(got) == [f"p{i}-0" for i in range(len(PROMPTS))]
    for i, p in enumerate(PROMPTS):
        ref = sample_features(model, [p], 24, 0.0, eos_token_id=eos, window_tokens=8, prefix=f"p{i}-")
        ref_tokens, ref_feats = _joined(ref)
        tokens, feats = _joined(got[f"p{i}-0"])
        assert all(w.response_start in (0, 1) for w in got[f"p{i}-0"])  # only the first window starts at p_last
        assert got[f"p{i}-0"][0].response_start == 1 and ref[0].response_start == 1
        np.testing.assert_array_equal(tokens, ref_tokens[:-1])  # the same greedy response, its last token dropped
        assert tokens[0] == p[-1]
        np.testing.assert_allclose(feats.astype(np.float32), ref_feats[:-1].astype(np.float32), atol=2e-2, rtol=1e-2)
        assert got[f"p{i}-0"][0].seq_tokens == len(tokens)


def test_a_sampled_sequence_depends_on_its_seed_not_on_its_company(model_dir) -> None:
    alone = engine_samples(model_dir, PROMPTS[:1], 24, temperature=1.0, seed=7, window_tokens=64)
    crowd = engine_samples(model_dir, PROMPTS, 24, temperature=1.0, seed=7, window_tokens=64)
    other = engine_samples(model_dir, PROMPTS[:1], 24, temperature=1.0, seed=8, window_tokens=64)
    first = [s for s in crowd if s.seq_id.startswith("p0-0@")]
    np.testing.assert_array_equal(_joined(alone)[0], _joined(first)[0])
    # the features come from batches of other shapes: equal to fp16 rounding, not bitwise
    np.testing.assert_allclose(_joined(alone)[1].astype(np.float32), _joined(first)[1].astype(np.float32), atol=1e-3,
                               rtol=2e-3)
    assert not np.array_equal(_joined(alone)[0], _joined(other)[0])  # another seed, another draw


def test_progress_counts_every_response(model_dir) -> None:
    seen: list[int] = []
    engine_samples(model_dir, PROMPTS, 8, temperature=1.0, progress=seen.append)
    assert sum(seen) == len(PROMPTS) and all(k > 0 for k in seen)


def test_a_response_stops_at_the_context_and_a_prompt_that_fills_it_is_a_one_line_error(model_dir) -> None:
    """--max-new-tokens past the context: the engine refuses such a request, which failed the whole warm-up with a
    traceback (the transformers loop it replaced ran on); each response is now capped at the context left."""
    from tlt.services.common.config import ConfigError
    from tlt.services.rollout.engine.config import EngineConfig
    from tlt.services.rollout.engine.engine import LLMEngine

    limit = LLMEngine(model_dir, EngineConfig(max_num_seqs=1, kv_cache_mb=64)).max_model_len
    got = engine_samples(model_dir, [PROMPTS[0]], limit * 2, temperature=1.0, window_tokens=4096)
    assert got and got[0].seq_tokens <= limit
    with pytest.raises(ConfigError, match="no room for a response"):
        engine_samples(model_dir, [[7] * limit], 8)


def test_prompt_i_is_drawn_with_seed_plus_i(model_dir) -> None:
    """Sequence i draws with seed + i (the docstring's promise): the same prompt twice in one collection gives two
    draws, not one sample twice, and prompt i's draw is the one a collection of it alone at seed + i makes."""
    same = _by_seq(engine_samples(model_dir, [PROMPTS[3], PROMPTS[3]], 24, temperature=1.0, seed=7, window_tokens=64))
    alone = _by_seq(engine_samples(model_dir, [PROMPTS[3]], 24, temperature=1.0, seed=8, window_tokens=64))
    np.testing.assert_array_equal(_joined(same["p1-0"])[0], _joined(alone["p0-0"])[0])
    assert not np.array_equal(_joined(same["p0-0"])[0], _joined(same["p1-0"])[0])


def test_a_sequence_without_a_group_is_its_own_group() -> None:
    hidden = torch.zeros(4, 8)
    seq = features_message("s3", torch.tensor([1, 2, 3, 4]), hidden, 2, 0)
    assert seq.group_id == "s3" and seq.response_start == 2
    assert features_message("s3", torch.tensor([1, 2, 3, 4]), hidden, 2, 0, group_id="g").group_id == "g"


def test_a_feature_message_carries_its_policy_version_replica_tokens_and_features() -> None:
    # the trainer's pushed features are built here: the buffer trains newest policy first by this version
    hidden = torch.arange(8, dtype=torch.float32).reshape(4, 2) / 4
    seq = features_message("s3", torch.tensor([1, 2, 3, 4]), hidden, 2, 5, replica_id=3)
    assert (seq.policy_version, seq.replica_id, list(seq.token_ids), seq.hidden_size) == (5, 3, [1, 2, 3, 4], 2)
    np.testing.assert_array_equal(np.frombuffer(seq.features, np.float16).reshape(4, 2), hidden.numpy())


def test_the_transformers_loop_samples_at_a_temperature_below_one(model_dir) -> None:
    # temperature 0.7 draws from the softened distribution (seeded), not the greedy argmax
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    greedy = _joined(sample_features(model, [PROMPTS[0]], 16, 0.0))[0]
    drawn = [_joined(sample_features(model, [PROMPTS[0]], 16, 0.7, seed=s))[0] for s in (1, 1, 2)]
    np.testing.assert_array_equal(drawn[0], drawn[1])
    assert not np.array_equal(drawn[0], greedy) and not np.array_equal(drawn[0], drawn[2])
