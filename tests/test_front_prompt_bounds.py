"""`encode_bounded` (services/rollout/front_prompts.py) on tokenizers that drop or merge their input.

A text over `limit x longest token x 2` characters was refused unread, on the assumption that no token covers more
characters than the vocabulary's longest string. Tokenizers that drop or fuse input break it: BERT's WordPiece drops
white space, a BPE with fuse_unk and no byte fallback makes one <unk> of a run of unknown characters, a normalizer
collapses runs of spaces. `"hi" + " " * 5000 + "hi"` (a handful of tokens) was refused at limit 64. The bound is now
taken only for a tokenizer known to keep every character (byte-level BPE, byte fallback; no dropping normalizer,
pre-tokenizer or stripping added token); any other is probed on growing prefixes and tokenised whole when they do not
decide. A probe is cut anywhere (CJK prose, code and one long word have no space to cut at) and counts only the tokens
the text past the cut cannot change. Tiny real tokenizers built here with `tokenizers`; nothing is faked but a
counting wrapper.
"""

from __future__ import annotations

import functools

import pytest
import transformers
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

from tlt.model.tokenizer import test_tokenizer as task_tokenizer
from tlt.services.rollout.front_prompts import PromptEncoder, PromptTooLong, encode_bounded

CORPUS = ["hi there, the answer is 42.", "what is 3 plus 4? it is 7.", "hello world, hi again"] * 20
GAP = "hi" + " " * 5000 + "hi"


def _fast(t: Tokenizer, **kw) -> transformers.PreTrainedTokenizerFast:
    return transformers.PreTrainedTokenizerFast(tokenizer_object=t, **kw)


@functools.cache
def wordpiece():
    t = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    t.normalizer = normalizers.BertNormalizer(lowercase=True)
    t.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    t.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=80, special_tokens=["[UNK]", "[CLS]", "[SEP]"],
                                                            show_progress=False))
    return _fast(t, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]")


@functools.cache
def fused_unk_bpe():
    t = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>"], show_progress=False))
    return _fast(t, unk_token="<unk>")


@functools.cache
def collapsing_byte_level():
    t = Tokenizer(models.BPE())
    t.normalizer = normalizers.Replace(Regex(" +"), " ")
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return _fast(t)


LOSSY = {"wordpiece": (wordpiece, GAP), "fused-unk": (fused_unk_bpe, "hi " + "\u20ac" * 5000 + " hi"),
         "collapsing": (collapsing_byte_level, GAP)}


@pytest.mark.parametrize("name", sorted(LOSSY))
def test_a_short_tokenisation_of_a_long_text_is_not_refused(name) -> None:
    make, text = LOSSY[name]
    tok = make()
    want = tok.encode(text)
    assert len(want) < 16, want  # a few tokens for 5 004 characters
    assert encode_bounded(tok, text, 64, PromptEncoder(tok).token_chars) == want
    assert PromptEncoder(tok).encode(text, 64) == want


class EncodeOnly:
    """A slow (or remote-code) tokenizer: `encode` only, no offsets; records the length of every text it encodes."""

    def __init__(self, tok) -> None:  # noqa: ANN001
        self.tok, self.lengths = tok, []

    def encode(self, text, add_special_tokens=True):  # noqa: ANN001, ANN201
        self.lengths.append(len(text))
        return self.tok.encode(text, add_special_tokens=add_special_tokens)


class Counting:
    """A tokenizer that records the length of every text it is asked to encode."""

    def __init__(self, tok) -> None:  # noqa: ANN001
        self.tok, self.lengths = tok, []

    def __getattr__(self, name):  # noqa: ANN001, ANN204
        return getattr(self.tok, name)

    def encode(self, text, add_special_tokens=True):  # noqa: ANN001, ANN201
        self.lengths.append(len(text))
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    def __call__(self, text, **kw):  # noqa: ANN001, ANN204
        self.lengths.append(len(text))
        return self.tok(text, **kw)


@pytest.mark.parametrize("name", sorted(LOSSY))
def test_a_long_real_text_is_still_refused_without_tokenising_it_whole(name) -> None:
    tok = Counting(LOSSY[name][0]())
    text = "hi there, the answer is 42. " * 4000  # 112 000 characters, tens of thousands of tokens
    with pytest.raises(PromptTooLong):
        PromptEncoder(tok).encode(text, 64)
    assert tok.lengths and max(tok.lengths) < len(text) // 10, tok.lengths


def test_byte_level_bpe_keeps_its_unread_refusal() -> None:
    """The task's own tokenizer (byte-level BPE, as Qwen's and Llama 3's): every character is in some token, so a
    text too long to fit is refused without a call to the tokenizer."""
    tok = Counting(task_tokenizer())
    encoder = PromptEncoder(tok)
    assert encoder.token_chars > 0
    with pytest.raises(PromptTooLong):
        encoder.encode("x" * (64 * encoder.token_chars + 1), 64)
    assert tok.lengths == []
    assert encoder.encode("1+2=", 64) == task_tokenizer().encode("1+2=")


@pytest.mark.parametrize("name", sorted(LOSSY))
def test_lossy_tokenizers_are_not_known_lossless(name) -> None:
    assert PromptEncoder(LOSSY[name][0]()).token_chars == 0


@functools.cache
def qwen_like():
    """Qwen2's layout: NFC, then byte-level BPE over the whole byte alphabet."""
    t = Tokenizer(models.BPE())
    t.normalizer = normalizers.NFC()
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\d"), "isolated"),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False)])
    t.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return _fast(t)


def byte_fallback(all_bytes: bool = True):
    """Llama 2's layout: Metaspace and `<0xXX>` pieces for what the vocabulary lacks."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256 if all_bytes else 128)}}
    for piece in ("\u2581", "h", "i", "\u2581h", "\u2581hi"):
        vocab[piece] = len(vocab)
    t = Tokenizer(models.BPE(vocab=vocab, merges=[("\u2581", "h"), ("\u2581h", "i")], byte_fallback=True,
                             unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    return _fast(t, unk_token="<unk>")


def with_a_stripping_token():
    """A byte-level BPE with RoBERTa's `<mask>` (lstrip): it takes any run of spaces before it."""
    tok = task_tokenizer().__class__(tokenizer_object=Tokenizer.from_str(task_tokenizer().backend_tokenizer.to_str()))
    tok.add_special_tokens({"mask_token": transformers.AddedToken("<mask>", lstrip=True)})
    return tok


# texts without a space or newline to cut a probe at: CJK prose, one long word, a run of unknown characters, white
# space a stripping added token takes whole, composing marks (NFC), minified code
NO_SPACE = ("\u4e2d" * 3000, "a" * 3000, "hi" + "\u20ac" * 3000 + "hi", "hi" + " " * 3000 + "<mask>",
            "e\u0301" * 1500, "x=1;" * 800)


@pytest.mark.parametrize("make, known", [
    (task_tokenizer, True), (qwen_like, True), (byte_fallback, True),
    (functools.partial(byte_fallback, all_bytes=False), False), (with_a_stripping_token, False),
])
def test_which_tokenizers_keep_the_unread_bound(make, known) -> None:
    tok = make()
    assert (PromptEncoder(tok).token_chars > 0) is known
    for text in (GAP, "hi " + "\u20ac" * 5000 + " hi", "hi there " * 600, *NO_SPACE):
        truth = tok.encode(text)
        try:  # whatever the tokenizer: refused early only when the whole text is too long (else its ids, which
            assert PromptEncoder(tok).encode(text, 64) == truth  # the caller refuses by their count)
        except PromptTooLong:
            assert len(truth) >= 64, (text[:20], len(truth))


@pytest.mark.parametrize("make, text", [
    (wordpiece, "\u4e2d" * 200_000), (wordpiece, "x=1;" * 50_000), (collapsing_byte_level, "\u4e2d" * 200_000),
    (fused_unk_bpe, "ab" * 100_000), (task_tokenizer, "\u4e2d" * 3000), (qwen_like, "\u4e2d" * 1700),
], ids=["wordpiece-cjk", "wordpiece-code", "collapsing-cjk", "fused-unk-word", "byte-level-cjk", "qwen-cjk"])
def test_a_long_text_without_white_space_is_refused_on_a_prefix(make, text) -> None:
    """CJK prose, minified code, one long word: no space or newline to cut a probe at. They were tokenised whole
    (2,000,000 x a CJK character with WordPiece at a context of 64: 6 s and 1.2 GB, then accepted for the caller to
    refuse); the probe is now cut anywhere and counts only the tokens a longer text cannot change."""
    tok = Counting(make())
    with pytest.raises(PromptTooLong):
        PromptEncoder(tok).encode(text, 64)
    assert tok.lengths == [8 * 64], tok.lengths  # one probe, PROBE_CHARS_PER_TOKEN x the limit, decides


@pytest.mark.parametrize("make, text, most", [
    (wordpiece, "a" * 200_000, 1), (wordpiece, " " * 420 + "a" * 200_000, 1),
    (fused_unk_bpe, "hi" + "\u20ac" * 200_000 + "hi", 4), (with_a_stripping_token, "hi" + " " * 200_000 + "<mask>", 3),
    (collapsing_byte_level, "hi" + " " * 200_000 + "hi", 3),
], ids=["wordpiece-unk-word", "wordpiece-unk-word-at-the-cut", "fused-unk-run", "stripping-token", "collapsing-spaces"])
def test_a_long_text_of_a_few_tokens_without_white_space_is_not_refused(make, text, most) -> None:
    """One [UNK] for a whole word (92 pieces of it in the probe), one fused <unk> for a run, `<mask>` taking every
    space before it: a prefix cut inside them has more tokens than the whole text, so those at the cut are not
    counted."""
    tok = make()
    want = tok.encode(text)
    assert len(want) <= most, len(want)
    assert PromptEncoder(tok).encode(text, 64) == want


def test_a_tokenizer_without_offsets_is_probed_up_to_white_space() -> None:
    """A slow (or remote-code) tokenizer gives no words nor offsets: its probe is cut at a space and counted whole,
    as before; a text without one is tokenised whole."""

    tok = EncodeOnly(wordpiece())
    with pytest.raises(PromptTooLong):
        PromptEncoder(tok).encode("hi there, the answer is 42. " * 4000, 64)
    assert tok.lengths and max(tok.lengths) < 8 * 64, tok.lengths
    assert PromptEncoder(tok).encode("a" * 5000, 64) == wordpiece().encode("a" * 5000)


def test_a_slow_tokenizers_probe_is_cut_at_a_newline_and_counted_without_special_tokens() -> None:
    """The probe of a tokenizer without offsets is cut at the last space OR newline: code or a list of short lines
    ("hi\\n" x 4000) has no space, and was tokenised whole to be refused. The prefix is counted as the text is
    encoded: a chat prompt (add_special_tokens=False) counted with the [CLS] and [SEP] it never gets was refused
    at 62 + 2 tokens, though it is 63 and fits a context of 64."""

    from tokenizers import processors

    t = Tokenizer.from_str(wordpiece().backend_tokenizer.to_str())  # BERT's: [CLS] text [SEP]
    t.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[
        ("[CLS]", t.token_to_id("[CLS]")), ("[SEP]", t.token_to_id("[SEP]"))])
    bert = _fast(t, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]")

    tok = EncodeOnly(bert)
    with pytest.raises(PromptTooLong):
        PromptEncoder(tok).encode("hi\n" * 4000, 64)
    assert tok.lengths and max(tok.lengths) < 8 * 64, tok.lengths
    text = "hi " * 62 + "a" * 5000  # 62 x "hi", then one [UNK] for a word past max_input_chars_per_word
    want = bert.encode(text, add_special_tokens=False)
    assert len(want) == 63 and len(bert.encode(text)) == 65
    assert PromptEncoder(EncodeOnly(bert)).encode(text, 64, add_special_tokens=False) == want


def test_a_probe_whose_settled_tokens_reach_the_limit_refuses_the_text() -> None:
    """`limit` tokens do not fit a context of `limit` (no room for one generated token): a probe settling exactly
    that many refuses the text on it, as one settling more does; it was tokenised whole and handed on. A byte-level
    BPE whose one long token is 16 characters: 6 x "z", then that token over and over; the probe (64 characters at a
    limit of 8) settles 6 + 2 = 8 tokens (those ending 16 characters before its end)."""
    word = "abcdefghijklmnop"
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = []
    for k in range(2, len(word) + 1):
        merges.append((word[:k - 1], word[k - 1]))
        vocab[word[:k]] = len(vocab)
    t = Tokenizer(models.BPE(vocab, merges))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok = Counting(_fast(t))
    text = ("z" * 6 + word * 10)[:8 * 8 + 40]
    assert len(tok.tok.encode(text)) == 13 and 0 < PromptEncoder(tok).token_chars
    with pytest.raises(PromptTooLong, match="at least 8 tokens"):
        PromptEncoder(tok).encode(text, 8)
    assert tok.lengths == [8 * 8], tok.lengths


def test_a_cut_word_whose_marks_the_normaliser_drops_is_not_counted() -> None:
    """The word at a probe's cut is not counted with WordPiece: the text past the cut may make it one [UNK]. It
    usually ends inside the probe's margin anyway, but not where the normaliser drops what follows it (BERT's strips
    combining marks): 90 x "a" then 522 x U+0301 then 20 x "a" is one word of 110 letters, one [UNK], while the
    probe (512 characters) holds the 90 letters as 90 pieces, well before its margin."""
    text = "a" * 90 + "\u0301" * 522 + "a" * 20
    want = wordpiece().encode(text)
    assert want == [wordpiece().unk_token_id]
    assert PromptEncoder(wordpiece()).encode(text, 64) == want


def test_stop_ids_and_the_kv_bound_at_their_edges() -> None:
    """A stop token id equal to the vocabulary size is outside it; a sequence of exactly the KV cache's tokens
    fits, and with no max_tokens it takes the rest of the context (not the whole context again on the prompt)."""
    from tlt.services.rollout.front_prompts import bad_stop_ids, kv_problem

    assert bad_stop_ids((5, 99), 100) is None
    assert "outside the vocabulary [0, 100)" in bad_stop_ids((5, 100), 100)
    assert kv_problem(10, 90, 200, 100, "prompt", "max_tokens") is None
    assert "give max_tokens <= 90" in kv_problem(10, 91, 200, 100, "prompt", "max_tokens")
    assert kv_problem(10, None, 100, 100, "prompt", "max_tokens") is None
    problem = kv_problem(10, None, 101, 100, "prompt", "max_tokens")
    assert "the default max_tokens (the rest of the context, 91)" in problem and "holds 100 tokens" in problem


def test_a_pre_tokenizer_that_removes_its_delimiter_gets_no_unread_bound() -> None:
    """A Split pre-tokenizer with behavior "removed" drops the characters it splits on (every space here), so a byte
    level BPE behind it does not keep every character: `"hi" + " " * 5000 + "hi"` is two tokens, not a text the
    unread bound may refuse at a context of 64."""
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(" ", "removed"),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False)])
    t.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = _fast(t)
    assert PromptEncoder(tok).token_chars == 0
    assert PromptEncoder(tok).encode(GAP, 64) == tok.encode(GAP) and len(tok.encode(GAP)) == 2


def test_a_dropping_normalizer_nested_in_sequences_is_found() -> None:
    """A tokenizer.json may nest Sequence normalizers (and pre-tokenizers); a Strip two levels down drops the
    spaces around the text all the same, so `" " * 5000 + "hi"` is one token: the tokenizer is not known to keep
    every character, and the text is not refused unread at a context of 64."""
    import json

    spec = json.loads(qwen_like().backend_tokenizer.to_str())  # a Sequence built in Python is flattened: read one
    spec["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Sequence", "normalizers": [
        {"type": "Strip", "strip_left": True, "strip_right": True}]}]}
    tok = _fast(Tokenizer.from_str(json.dumps(spec)))
    text = " " * 5000 + "hi"
    assert PromptEncoder(tok).token_chars == 0
    assert PromptEncoder(tok).encode(text, 64) == tok.encode(text) and len(tok.encode(text)) == 1
