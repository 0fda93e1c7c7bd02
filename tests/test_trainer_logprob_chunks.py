"""The trainer's response logprobs computed in chunks of response tokens (lm_head recomputed in backward) give the
full-logits values and gradients, and never build more than one chunk of logits.

A tiny random Qwen2 built in code, float32, on CPU; `chunk_tokens=0` is the full-logits reference ([B, R, V] at once).
"""

from __future__ import annotations

import pytest
import torch

from tlt.services.trainer.grpo import kl_k3, masked_mean, policy_loss
from tlt.services.trainer.logprob_chunks import chunkable_head
from tlt.services.trainer.policy import TokenBatch, response_logprobs

VOCAB = 50

# Right-padded as the trainer builds them: prompts and responses of unequal lengths (one response empty), so the
# batch has padding inside the response block and before it; 15 real response tokens of 4 x 6.
PROMPTS = [(5, 6, 7), (9, 3, 4, 5, 6), (2, 8), (11, 12, 13, 14)]
RESPONSES = [(10, 11, 12, 13), (12, 13, 14, 15, 16, 17), (), (20, 21, 22, 23, 24)]


def tiny_qwen2(tied: bool = False):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied, pad_token_id=0)
    return Qwen2ForCausalLM(cfg)


def grpo_loss(out, old: torch.Tensor, ref: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """The step's loss terms: PPO-clip surrogate + k3 KL - an entropy bonus (token-mean)."""
    pl = policy_loss(out.logprobs, old, adv, out.mask, clip_low=0.2, clip_high=0.28)
    return pl.loss + 0.1 * masked_mean(kl_k3(out.logprobs, ref, out.mask), out.mask) \
        - 0.01 * masked_mean(out.entropy, out.mask)


def run(model, batch: TokenBatch, chunk: int):
    """(old logprobs, reference logprobs) without grad, then (logprobs, entropy, every parameter's gradient)."""
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        old = response_logprobs(model, batch, 0.7, chunk_tokens=chunk).logprobs
        ref = response_logprobs(model, batch, 1.3, chunk_tokens=chunk).logprobs
    # a first update moved the policy off `old`: some ratios clip, the KL is non-zero
    old, ref = old + 0.3 * torch.sin(torch.arange(old.numel()).view_as(old)), ref
    out = response_logprobs(model, batch, 0.7, with_entropy=True, entropy_grad=True, chunk_tokens=chunk)
    adv = torch.tensor([1.0, -0.5, 0.3, -1.2])[:, None].expand_as(out.logprobs)
    grpo_loss(out, old * batch.response_mask, ref * batch.response_mask, adv).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return old, ref, out.logprobs.detach(), out.entropy.detach(), grads


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_logprobs_entropy_and_grads_equal_full_logits(tied):
    model = tiny_qwen2(tied)
    batch = TokenBatch.build(PROMPTS, RESPONSES)
    want = run(model, batch, chunk=0)
    assert len(want[4]) == len(list(model.parameters()))  # every parameter has a gradient
    for chunk in (1, 4, 5, 7, 15, 1024):  # 4, 5 divide the 15 real response tokens and 7 does not
        got = run(model, batch, chunk)
        for w, g in zip(want[:4], got[:4]):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=0)
        assert got[4].keys() == want[4].keys()
        for name, w in want[4].items():
            torch.testing.assert_close(got[4][name], w, atol=1e-6, rtol=1e-5, msg=name)
        assert (got[2][2] == 0).all() and (got[3][2] == 0).all()  # the empty response: zeros, as before


def test_entropy_is_detached_unless_entropy_grad():
    model = tiny_qwen2()
    batch = TokenBatch.build(PROMPTS, RESPONSES)
    out = response_logprobs(model, batch, with_entropy=True, chunk_tokens=4)
    assert out.logprobs.requires_grad and not out.entropy.requires_grad
    with torch.no_grad():
        assert not response_logprobs(model, batch, chunk_tokens=4).logprobs.requires_grad


def test_no_more_than_one_chunk_of_logits_at_once():
    """lm_head never sees more rows than the chunk, in the forward or in the backward's recomputation."""
    model = tiny_qwen2()
    batch = TokenBatch.build(PROMPTS, RESPONSES)
    rows: list[int] = []
    model.lm_head.register_forward_hook(lambda mod, args, out: rows.append(out[..., 0].numel()))
    out = response_logprobs(model, batch, with_entropy=True, entropy_grad=True, chunk_tokens=4)
    grpo_loss(out, out.logprobs.detach(), out.logprobs.detach(), torch.ones_like(out.logprobs)).backward()
    # 15 real response tokens: 4 + 4 + 4 + 3 forward, the same again recomputed in backward (and no padding rows)
    assert max(rows) <= 4 and sum(rows) == 2 * 15, rows


def tiny_gemma2(softcap: float | None):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                       final_logit_softcapping=softcap, pad_token_id=0)
    model = Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # logits well past the cap: capping changes them
    return model


def test_a_model_that_caps_its_logits_keeps_the_full_logits_path() -> None:
    """Gemma 2 soft-caps its logits after lm_head (cap * tanh(z / cap)): chunks of lm_head(h) alone would give the
    uncapped logprobs, not what the model (and the rollout that sampled from it) computes. Such a model is not
    chunked; its logprobs with chunking asked for are the full-logits path's."""
    batch = TokenBatch.build(PROMPTS[:2], RESPONSES[:2])
    capped = tiny_gemma2(5.0)
    assert chunkable_head(capped) is None and chunkable_head(tiny_gemma2(None)) is not None
    full = response_logprobs(capped, batch, 1.0, chunk_tokens=0).logprobs
    chunked = response_logprobs(capped, batch, 1.0, chunk_tokens=2).logprobs
    torch.testing.assert_close(chunked, full)
    with torch.no_grad():
        out = capped(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    z = out.logits[0, 2:6].float()
    assert float(z.abs().max()) <= 5.0 + 1e-4  # the forward did cap
    want = torch.log_softmax(z, -1).gather(1, torch.tensor(RESPONSES[0])[:, None])[:, 0]
    torch.testing.assert_close(full[0, :4], want, atol=1e-5, rtol=0)
