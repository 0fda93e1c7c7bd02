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

    class EncodeOnly:
        def __init__(self) -> None:
            self.tok, self.lengths = wordpiece(), []

        def encode(self, text, add_special_tokens=True):  # noqa: ANN001, ANN201
            self.lengths.append(len(text))
            return self.tok.encode(text, add_special_tokens=add_special_tokens)

    tok = EncodeOnly()
    with pytest.raises(PromptTooLong):
        PromptEncoder(tok).encode("hi there, the answer is 42. " * 4000, 64)
    assert tok.lengths and max(tok.lengths) < 8 * 64, tok.lengths
    assert PromptEncoder(tok).encode("a" * 5000, 64) == wordpiece().encode("a" * 5000)
