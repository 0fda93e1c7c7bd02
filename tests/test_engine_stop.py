"""Native engine: stop conditions and the incremental detokenisation they and streams read (engine/stop.py,
engine/detok.py): stop strings across token and character boundaries, SentencePiece leading spaces, clean-up,
held-back text, and the search each new token makes.

Tokenizers here are hand-built byte-piece maps or real `transformers` / `tokenizers` objects built in the test.
Nothing is faked. (Split out of test_engine_sampling.py.)
"""

from __future__ import annotations

import transformers

from tlt.services.rollout.types import FinishReason, SamplingParams


class _BytePieces:
    """A byte-level tokenizer in miniature: each token id is a byte string, decoding joins them and replaces a
    split multi-byte character by U+FFFD, as a byte-level BPE tokenizer decodes."""

    def __init__(self, pieces: dict[int, bytes]) -> None:
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens: bool = True, **kwargs) -> str:  # noqa: ANN001, ANN003
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def _emit(seq, tokens, tok, max_model_len=100):  # noqa: ANN001, ANN202
    """Append `tokens` one at a time as the engine does, checking after each; the reasons seen."""
    from tlt.services.rollout.engine.stop import check_stop

    reasons = []
    for t in tokens:
        seq.token_ids.append(t)
        reasons.append(check_stop(seq, t, tok, max_model_len))
    return reasons


def _stop_seq(max_tokens=10, eos=frozenset(), prompt=(0,), **params):  # noqa: ANN001, ANN202
    from tlt.services.rollout.engine.sequence import Sequence

    return Sequence("r", 0, prompt, SamplingParams(temperature=0.0, **params), max_tokens=max_tokens, seed=0,
                    eos_ids=eos)


def test_stop_string_whose_last_character_alone_is_new_is_found():
    tok = _BytePieces({0: b"", 1: b"abc", 2: b"d", 3: b"e"})
    seq = _stop_seq(stop=("bcd",))
    # "abc" checked: no match; then "d" completes "bcd", which starts 2 characters before the checked end
    assert _emit(seq, [1, 2], tok) == [None, FinishReason.STOP]
    assert seq.text == "a" and seq.output_ids == [1, 2]


def test_the_earliest_of_several_stop_strings_cuts_the_text():
    tok = _BytePieces({0: b"", 1: b"a", 2: b"bcxyz"})
    seq = _stop_seq(stop=("xyz", "c"))
    assert _emit(seq, [1, 2], tok) == [None, FinishReason.STOP]
    assert seq.text == "ab"  # "c" (at 2) comes before "xyz" (at 3)


def test_a_stop_string_completed_by_the_second_half_of_a_character_is_found():
    tok = _BytePieces({0: b"", 1: b"a", 2: b"\xc3", 3: b"\xa9", 4: b"z"})  # "\xc3\xa9" is U+00E9
    seq = _stop_seq(stop=("\u00e9",))
    assert _emit(seq, [1, 2, 3], tok) == [None, None, FinishReason.STOP]  # "a\ufffd", then "a\u00e9"
    assert seq.text == "a"


def test_max_tokens_context_limit_and_eos_finish_at_exactly_their_token():
    tok = _BytePieces({i: b"x" for i in range(10)})
    assert _emit(_stop_seq(max_tokens=3), [5, 5, 5], tok) == [None, None, FinishReason.LENGTH]
    # prompt of 2 + 3 outputs = the model's 5 positions: the third output is the last
    assert _emit(_stop_seq(prompt=(0, 0)), [5, 5, 5], tok, max_model_len=5) == [None, None, FinishReason.LENGTH]
    assert _emit(_stop_seq(eos=frozenset({7})), [5, 7], tok) == [None, FinishReason.STOP]
    assert _emit(_stop_seq(eos=frozenset({7}), ignore_eos=True), [5, 7], tok) == [None, None]
    assert _emit(_stop_seq(stop_token_ids=(6,)), [5, 6], tok) == [None, FinishReason.STOP]


def _sentencepiece_tokenizer():
    """A Llama-2 / Mistral / TinyLlama style tokenizer (the decoder transformers' LlamaConverter writes, whose
    Strip(" ", 1, 0) drops the first token's leading space), built in code."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, "\u2581The": 2, "\u2581answer": 3, "\u2581is": 4, "\u2581Paris": 5,
             "\u2581Observation": 6, ":": 7, "<0xC3>": 8, "<0xA9>": 9, "\u2581caf": 10}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    t.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=t, eos_token="</s>", unk_token="<unk>")


def test_a_sentencepiece_outputs_leading_space_is_kept_and_a_stop_string_on_it_found():
    """The output was decoded alone, so the decoder's strip took the space the model wrote: the stop string
    " Observation:" at the start of the output was never found, and prompt + completion lost a space."""
    from tlt.services.rollout.engine.detok import continuation_text

    tok = _sentencepiece_tokenizer()
    prompt, out = (2, 3, 4), [6, 7, 5]  # "The answer is" + " Observation: Paris"
    whole = tok.decode([*prompt, *out])
    assert continuation_text(tok, prompt, out) == whole[len(tok.decode(prompt)):] == " Observation: Paris"
    seq = _stop_seq(prompt=prompt, stop=(" Observation:",))
    assert _emit(seq, out[:2], tok) == [None, FinishReason.STOP] and seq.text == ""
    seq = _stop_seq(prompt=prompt, stop=(" Paris",))
    assert _emit(seq, out, tok) == [None, None, FinishReason.STOP] and seq.text == " Observation:"


def test_incremental_text_is_the_one_shot_text_and_decodes_a_window_not_the_output():
    """Every token decoded the whole output for the stop check (quadratic: ~1 ms a token per sequence at 4k
    tokens on the engine's loop). The window's text must equal one decode of prompt + output, characters split
    into byte-fallback pieces included, while each decode sees a bounded number of tokens."""
    import random

    from tlt.services.rollout.engine.detok import CONTEXT_TOKENS, IncrementalText, continuation_text

    tok = _sentencepiece_tokenizer()
    longest = []
    real = type(tok).decode

    def spy(self, ids, *a, **kw):  # noqa: ANN001, ANN202
        longest.append(len(ids))
        return real(self, ids, *a, **kw)

    rng = random.Random(0)
    for trial in range(30):
        prompt = [rng.choice([2, 3, 4, 10]) for _ in range(rng.randint(1, 8))]
        # (8, 9): "é" in two byte pieces, a character split across tokens (valid UTF-8: a sampled invalid byte
        # run decodes to a different count of U+FFFD depending on where a window cuts it, as in vLLM)
        out = [t for _ in range(rng.randint(1, 300)) for t in rng.choice([[2], [3], [4], [5], [6], [7], [10], [8, 9]])]
        inc = IncrementalText(tok, prompt)
        type(tok).decode, longest[:] = spy, []
        try:
            for t in out:
                inc.push([t])
            inc.flush()
        finally:
            type(tok).decode = real
        assert inc.text == continuation_text(tok, prompt, out), trial
        assert max(longest) <= CONTEXT_TOKENS + 4, max(longest)  # a window, however long the output
    seq = _stop_seq(max_tokens=1000, prompt=(2, 3), stop=("zzz",))  # the engine's stop check decodes the same way
    type(tok).decode, longest[:] = spy, []
    try:
        assert set(_emit(seq, [5, 6, 7] * 100, tok, max_model_len=1000)) == {None}
    finally:
        type(tok).decode = real
    assert max(longest) <= CONTEXT_TOKENS + 4, max(longest)


def test_the_streamed_text_of_a_sentencepiece_output_joins_to_its_completion_text():
    # the HTTP stream decodes as the engine does (after the prompt's last tokens): a stream that dropped the
    # leading space could not be completed by the engine's text (TextStream.finish sends nothing it cannot append)
    from tlt.services.rollout.engine.detok import continuation_text
    from tlt.services.rollout.openai_convert import TextStream

    tok = _sentencepiece_tokenizer()
    prompt, out = (2, 3, 4), [6, 7, 5]
    stream = TextStream(tok, (), prompt=prompt)
    deltas = [stream.push([t]) for t in out]
    assert deltas[0] == " Observation"
    assert "".join(deltas) + stream.finish(continuation_text(tok, prompt, out)) == " Observation: Paris"


def test_a_tokenizer_that_cleans_up_spaces_still_finds_stop_strings_and_streams_its_text():
    """transformers' clean_up_tokenization_spaces rewrites text already decoded when the next token comes
    (" it '" then "s": " it's"): the window's earlier text was no prefix of the new one, the incremental text
    stopped growing for good, and a stop string after it was never found."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from tlt.services.rollout.engine.detok import continuation_text
    from tlt.services.rollout.openai_convert import TextStream

    vocab = {"<unk>": 0, "\u0120it": 1, "\u0120'": 2, "s": 3, "\u0120STOP": 4, "\u0120ok": 5, "\u0120hi": 6, "\u0120.": 7}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", clean_up_tokenization_spaces=True)
    out = [1, 2, 3, 5, 7, 5, 4, 5]
    assert continuation_text(tok, (6,), out) == tok.decode(out) == " it's ok. ok STOP ok"
    seq = _stop_seq(max_tokens=20, prompt=(6,), stop=(" STOP",))
    assert _emit(seq, out[:7], tok)[-1] == FinishReason.STOP and seq.text == " it's ok. ok"
    seq = _stop_seq(max_tokens=20, prompt=(6,), stop=("it's",))  # only the cleaned text holds it
    assert _emit(seq, out[:3], tok)[-1] == FinishReason.STOP and seq.text == " "
    stream = TextStream(tok, (), prompt=(6,))
    sent = "".join(stream.push([x]) for x in out)
    assert sent + stream.finish(continuation_text(tok, (6,), out)) == " it's ok. ok STOP ok"


def test_the_prompt_context_reaches_past_special_tokens_and_starts_on_a_character():
    """The context was exactly the prompt's last 5 tokens: 5 special tokens (which the decode skips) left the strip
    to the output again, and a cut inside a byte-fallback character made the whole run U+FFFD, so the context was
    dropped; either way a Llama-2 style output lost its leading space and a stop string on it."""
    from tlt.services.rollout.engine.detok import continuation_text

    tok = _sentencepiece_tokenizer()
    for prompt in ((2, 3, 4, 1, 1, 1, 1, 1), (2, 3, 4, 8, 9, 8, 9, 8, 9)):  # ... </s> x5; ... "ééé" in byte pieces
        assert continuation_text(tok, prompt, [5]) == " Paris", prompt
        seq = _stop_seq(prompt=prompt, stop=(" Paris",))
        assert _emit(seq, [5], tok) == [FinishReason.STOP] and seq.text == ""


def test_a_stray_byte_does_not_freeze_the_text():
    """A byte after a byte-fallback character turns the whole run into U+FFFD, so the window's earlier text ("é")
    was no prefix of the new one ("���"), and a prefix check froze the text for good: a stop string after it was
    never found, and the stream sent nothing more."""
    from tlt.services.rollout.openai_convert import TextStream

    tok = _sentencepiece_tokenizer()
    out = [4, 8, 9, 9, 4, 5, 6, 7]  # " is" "é" <stray 0xA9> " is Paris Observation:"
    seq = _stop_seq(max_tokens=20, prompt=(2, 3), stop=(" Paris",))
    assert _emit(seq, out[:6], tok)[-1] == FinishReason.STOP and seq.text.endswith(" is")
    stream = TextStream(tok, (), prompt=(2, 3))
    assert "".join(stream.push([t]) for t in out).endswith(" Observation:")
    # a stream fed engine steps of several tokens (speculation) joins to the completion's one-shot text
    from tlt.services.rollout.engine.detok import continuation_text

    final = continuation_text(tok, (2, 3), out)
    stream = TextStream(tok, (".",), prompt=(2, 3))
    sent = "".join(stream.push(out[i:i + 2]) for i in range(0, len(out), 2))
    assert sent + stream.finish(final) == final


def test_a_stream_never_sends_text_it_holds_back():
    # text shorter than the holdback: a negative slice end took characters from the end instead of none
    from tlt.services.rollout.openai_convert import TextStream

    tok = _BytePieces({1: b" the", 2: b" it"})
    stream = TextStream(tok, ("x" * 12,))  # holds back 11 characters
    assert [stream.push([1]), stream.push([2])] == ["", ""]
    assert stream.finish(" the it") == " the it"


def test_a_stream_holds_back_as_much_as_its_longest_stop_string_may_have_begun():
    """With several stop strings the stream holds back len(longest) - 1 characters: holding back for the shortest
    (".": nothing) sent " go STOP her", the start of " STOP here", which the engine's text then cuts, so the
    client kept text the completion does not have (and the last chunk could add nothing)."""
    from tlt.services.rollout.openai_convert import TextStream

    tok = _BytePieces({1: b" go", 2: b" STOP", 3: b" her", 4: b"e"})
    stream = TextStream(tok, (".", " STOP here"))
    sent = "".join(stream.push([t]) for t in (1, 2, 3))
    assert sent == " go"  # 12 characters, 9 held back
    assert stream.finish(" go") == ""


def test_a_streamed_completion_decodes_after_the_prompt_as_the_engine_does():
    """A completions stream decoded its tokens without the prompt's last tokens: a SentencePiece decoder's strip
    took the output's leading space, the stream sent "Observation" where the completion's text reads
    " Observation", and the last chunk could not follow it (the client's text lost its tail)."""
    from tlt.services.rollout.engine.detok import continuation_text
    from tlt.services.rollout.openai_convert import CompletionChoiceStream
    from tlt.services.rollout.types import CompletionOutput, StepOutput, Versions

    tok = _sentencepiece_tokenizer()
    prompt, out = (2, 3, 4), [6, 7, 5]
    final = continuation_text(tok, prompt, out)
    stream = CompletionChoiceStream(tok, (), None, prompt=prompt)
    parts = [stream.push(StepOutput("r", 0, [t])) for t in out[:-1]]
    c = CompletionOutput("r", 0, list(prompt), out, final, FinishReason.LENGTH, Versions())
    parts.append(stream.finish(c))
    assert [text for text, _ in parts] == [" Observation", ":", " Paris"]


def test_a_bpe_tokenizer_is_not_cleaned_up_as_transformers_does_not_clean_it():
    # transformers 5 skips clean_up_tokenization_spaces for a BPE model (it would corrupt BPE text): cleaning it
    # here found stop strings in text the completion would not hold
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from tlt.services.rollout.engine.detok import cleans_up, continuation_text

    vocab = {"<unk>": 0, "\u0120it": 1, "\u0120.": 2, "\u0120'": 3, "s": 4}
    t = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", clean_up_tokenization_spaces=True)
    assert not cleans_up(tok)
    assert continuation_text(tok, (1,), [1, 2, 3, 4]) == tok.decode([1, 2, 3, 4]) == " it . 's"


def test_a_sentencepiece_tokens_logprobs_keep_its_leading_space():
    """Each logprob's token was decoded on its own, so the decoder's strip took the space of every `▁word` token:
    the tokens read "Observation", ":", "Paris" in a text " Observation: Paris", `text_offset` drifted one
    character left per word, and the chat `bytes`, joined as OpenAI documents, did not rebuild the content."""
    from tlt.model.tokenizer import test_tokenizer
    from tlt.services.rollout.engine.detok import continuation_text
    from tlt.services.rollout.openai_convert import chat_logprobs, completion_logprobs
    from tlt.services.rollout.token_text import token_text_and_bytes

    tok = _sentencepiece_tokenizer()
    prompt, out = (2, 3, 4), [6, 7, 5, 10, 8, 9]  # "The answer is" + " Observation: Paris café" (é in 2 byte pieces)
    text = continuation_text(tok, prompt, out)
    assert text == " Observation: Paris caf\u00e9"
    lp = completion_logprobs(tok, out, [-0.1] * len(out), [{5: -0.1, 6: -0.2}] * len(out), 1, text)
    assert lp.tokens == [" Observation", ":", " Paris", " caf", "<0xC3>", "<0xA9>"]
    assert lp.text_offset == [0, 12, 13, 19, 23, 23]
    assert lp.top_logprobs[0] == {" Paris": -0.1, " Observation": -0.2}
    chat = chat_logprobs(tok, out, [-0.1] * len(out), None, 0)
    assert bytes(b for c in chat.content for b in c.bytes).decode() == text
    # a byte-level BPE tokenizer's (GPT-2, Qwen, Llama 3: the task's) tokens read as before, on their own
    task = test_tokenizer()
    for i in range(len(task)):
        alone = task.decode([i])
        if "\ufffd" not in alone:
            assert token_text_and_bytes(task, i) == (alone, list(alone.encode())), i


def test_a_long_stop_string_does_not_make_the_short_ones_search_the_whole_text(monkeypatch):
    """Each new token searched every stop string from (checked end - the LONGEST stop string's length): one long
    stop string beside short ones made every token search the whole output again, quadratic in its length. Each
    string is now searched from where a match of its own length could begin."""
    from tlt.services.rollout.engine import detok

    starts: dict[str, list[int]] = {}

    class Recorded(str):
        def find(self, sub, start=0, *rest):  # noqa: ANN001, ANN202
            starts.setdefault(sub, []).append(start)
            return str.find(self, sub, start, *rest)

    cleaned = detok.IncrementalText.cleaned
    monkeypatch.setattr(detok.IncrementalText, "cleaned", lambda self: Recorded(cleaned(self)))
    tok = _BytePieces({0: b"", 1: b"ab", 2: b"q"})
    seq = _stop_seq(max_tokens=400, stop=("x" * 5000, "q"))
    reasons = _emit(seq, [1] * 300 + [2], tok, max_model_len=1000)
    assert reasons[-1] == FinishReason.STOP and reasons[:-1] == [None] * 300 and seq.text == "ab" * 300
    assert max(starts["q"]) >= 2 * 299 - detok.CLEANUP_HOLDBACK, starts["q"][-3:]  # near the end, not 0


def test_a_slow_tokenizer_that_cleans_up_spaces_is_cleaned_as_its_decode_cleans():
    """A slow (Python) tokenizer has no backend model to tell BPE from the rest, and its `decode` cleans up spaces
    when `clean_up_tokenization_spaces` is set: taking it for one that does not clean left " ." and " 's" in the
    completion's text (unlike one decode of it), and a stop string "it's" was never found."""
    from tlt.services.rollout.engine.detok import cleans_up, continuation_text

    class Words(transformers.PreTrainedTokenizer):
        """Whitespace-split words; decode joins them with spaces (transformers then cleans " ." -> ".")."""

        def __init__(self, **kw) -> None:  # noqa: ANN003
            self.vocab = {"<unk>": 0, "hello": 1, ".": 2, "world": 3, "it": 4, "'s": 5}
            super().__init__(unk_token="<unk>", **kw)

        @property
        def vocab_size(self) -> int:
            return len(self.vocab)

        def get_vocab(self) -> dict[str, int]:
            return dict(self.vocab)

        def _tokenize(self, text: str) -> list[str]:
            return text.split()

        def _convert_token_to_id(self, token: str) -> int:
            return self.vocab.get(token, 0)

        def _convert_id_to_token(self, i: int) -> str:
            return next(t for t, j in self.vocab.items() if j == i)

        def convert_tokens_to_string(self, tokens: list[str]) -> str:
            return " ".join(tokens)

    tok = Words(clean_up_tokenization_spaces=True)
    assert getattr(tok, "backend_tokenizer", None) is None and cleans_up(tok)
    out = [2, 3, 2, 4, 5]
    assert tok.decode([1, *out]) == "hello. world. it's"
    assert continuation_text(tok, (1,), out) == ". world. it's"
    seq = _stop_seq(max_tokens=20, prompt=(1,), stop=("it's",))
    assert _emit(seq, out, tok)[-1] == FinishReason.STOP and seq.text == ". world. "


def test_the_prompt_context_ends_before_a_byte_run_a_special_token_follows():
    """The decode skips special tokens, so a prompt's last byte pieces and the output's first ones are one run
    across a `</s>`: the context kept "é</s>" and the output's stray byte turned the prompt's "é" into U+FFFD too,
    so the stream sent a U+FFFD more than the completion's text, and a prompt cut inside "é" before its `</s>` left
    no context at all (the output's leading space lost)."""
    from tlt.services.rollout.engine.detok import continuation_text
    from tlt.services.rollout.openai_convert import TextStream

    tok = _sentencepiece_tokenizer()
    prompt, out = (2, 3, 4, 8, 9, 1), [9, 5]  # "The answer isé</s>" + <stray 0xA9> " Paris"
    final = continuation_text(tok, prompt, out)
    assert final == "\ufffd Paris"
    stream = TextStream(tok, (), prompt=prompt)
    assert [stream.push([t]) for t in out] == ["", "\ufffd Paris"]
    prompt = (2, 3, 4, 8, 1)  # "The answer is" + <0xC3> (half of "é") + </s>
    assert continuation_text(tok, prompt, [5]) == " Paris"
    seq = _stop_seq(prompt=prompt, stop=(" Paris",))
    assert _emit(seq, [5], tok) == [FinishReason.STOP] and seq.text == ""


def test_an_output_that_opens_with_a_special_token_keeps_its_leading_space():
    """A first output token that decodes to no text (a special token the decode skips) moved the window past the
    prompt's context, so the next token was decoded as the window's first and the SentencePiece strip took its
    space: the stream sent "Paris" for " Paris", and a stop string " Paris" was never found."""
    from tlt.services.rollout.openai_convert import TextStream

    tok = _sentencepiece_tokenizer()
    prompt, out = (2, 3, 4), [1, 5, 7]  # "The answer is" + </s> " Paris:"
    stream = TextStream(tok, (), prompt=prompt)
    assert [stream.push([t]) for t in out] == ["", " Paris", ":"]
    seq = _stop_seq(prompt=prompt, stop=(" Paris",))
    assert _emit(seq, out[:2], tok) == [None, FinishReason.STOP] and seq.text == ""


def test_a_byte_run_the_last_token_ends_is_searched_once():
    """At the last token (max_tokens) the held byte run is flushed into the text; had the run stayed held it was
    searched again after it (" café" searched as " caféé"): a stop string "éé" ended a completion that holds one
    "é", reported finish_reason "stop" for "length" and cut its text to " caf"."""
    tok = _sentencepiece_tokenizer()
    out = [10, 8, 9]  # " caf" "é" (2 byte pieces), the last at max_tokens
    seq = _stop_seq(max_tokens=3, prompt=(2,), stop=("éé",))
    assert _emit(seq, out, tok) == [None, None, FinishReason.LENGTH]
    seq = _stop_seq(max_tokens=3, prompt=(2,), stop=("é",))
    assert _emit(seq, out, tok) == [None, None, FinishReason.STOP] and seq.text == " caf"


def test_an_output_after_a_prompt_cut_inside_a_character_is_cleaned_up_too():
    """A prompt that ends inside a character is no context (its U+FFFD would take the output's first bytes), and
    the output is decoded on its own: that text went out uncleaned, so with a tokenizer that cleans up spaces the
    completion read " it . ok" where its decode reads " it. ok"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from tlt.services.rollout.engine.detok import continuation_text

    vocab = {"<unk>": 0, "\u0120it": 1, "\u0120.": 2, "\u0120ok": 3, "\u00e6": 4}  # 4: the byte 0xE6 alone
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", clean_up_tokenization_spaces=True)
    prompt, out = (3, 4), [1, 2, 3]  # " ok" + half a character
    assert tok.decode(prompt) == " ok\ufffd"
    assert continuation_text(tok, prompt, out) == tok.decode(out) == " it. ok"
