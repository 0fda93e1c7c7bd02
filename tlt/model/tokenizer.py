"""The task tokenizer: byte-level BPE trained with `tokenizers` on the task's text, with a ChatML template.

Digits are split one per token before BPE (so numbers are always digit
sequences and arithmetic is learnable), the rest is GPT-2/Qwen style
byte-level BPE, so any text round-trips exactly. Special tokens follow Qwen:
`<|endoftext|>` (also the pad token), `<|im_start|>`, `<|im_end|>` (the end of
an assistant turn, hence the eos token). The chat template is Qwen's ChatML
without a default system prompt; for one user turn with the generation
prompt it produces exactly `tlt.task.format_chat(question)`.

Training is seeded and deterministic: the same seed gives the same vocabulary.
"""

from __future__ import annotations

import tempfile
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
VOCAB_SIZE = 384  # 256 bytes + 3 specials + merges; the task's text needs fewer, training stops early
CORPUS_PROBLEMS = 4000

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _corpus(seed: int) -> list[str]:
    from tlt.task import format_prompt, generate_problems

    return [format_prompt(p) + p.solution + IM_END + "\n" for p in generate_problems(CORPUS_PROBLEMS, seed)]


def build_tokenizer(out_dir: str | Path, seed: int = 0) -> PreTrainedTokenizerFast:
    """Train the BPE tokenizer on task text drawn with `seed`, save it (HF format) to out_dir and return it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\d"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        extra_special_tokens=[IM_START],
        unk_token=None,
        bos_token=None,
        padding_side="left",
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out, save_jinja_files=False)  # chat_template inside tokenizer_config.json
    return fast


@cache
def test_tokenizer() -> PreTrainedTokenizerFast:
    """The seed-0 task tokenizer, built once per process (for tests); the folder it is saved to goes with the call
    (the tokenizer is the in-memory one: each process left a folder in /tmp)."""
    with tempfile.TemporaryDirectory(prefix="tlt-tokenizer-") as folder:
        return build_tokenizer(folder, seed=0)


test_tokenizer.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test, when imported into a test module


def load_tokenizer(model_dir: str | Path):  # noqa: ANN201 - a transformers PreTrainedTokenizerBase
    """The checkpoint folder's tokenizer, from its own files only. One transformers cannot read (a tokenizer.json
    left as a Git LFS pointer or cut short, a tokenizer.model whose library is missing) is a CheckpointError naming
    the folder and why: it was a JSONDecodeError traceback that named no file."""
    from transformers import AutoTokenizer

    from tlt.model.folder import CheckpointError

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - whatever the user's files make transformers or tokenizers raise
        why = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        raise CheckpointError(f"{model_dir}: its tokenizer files cannot be loaded ({why}); copy them again (a "
                              "repository cloned without git-lfs leaves pointer files) or save the tokenizer with "
                              "tokenizer.save_pretrained(DIR)") from None
