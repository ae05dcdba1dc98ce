"""LaTeX tokenization for the formula model and its metrics.

Two views of the same text:

- the model's vocabulary: one id per im2latex token (`\\frac`, `{`, `x`), a
  `tokenizers` WordLevel model over whitespace-split normalized LaTeX, saved
  beside the weights as a standard `tokenizer.json`;
- the metric view: `latex_tokens` splits any LaTeX string into commands,
  escaped symbols and single characters, ignoring whitespace, so that
  `\\frac{1}{2}` and `\\frac { 1 } { 2 }` score the same.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)

_METRIC_TOKEN = re.compile(r"\\[A-Za-z]+|\\.|\S")


def latex_tokens(text: str) -> list[str]:
    """Split LaTeX into commands (`\\alpha`), escaped symbols (`\\{`) and single characters."""
    return _METRIC_TOKEN.findall(text)


def normalize_spacing(text: str) -> str:
    """Collapse whitespace to the single spaces of the normalized im2latex form."""
    return " ".join(text.split())


def build_vocabulary(formulas: Iterable[str], extra_tokens: Iterable[str] = ()) -> list[str]:
    """Special tokens first, then every token seen, in a stable (sorted) order."""
    seen = set(extra_tokens)
    for formula in formulas:
        seen.update(formula.split())
    seen.difference_update(SPECIAL_TOKENS)
    return [*SPECIAL_TOKENS, *sorted(seen)]


def read_vocab_file(path: str | Path) -> list[str]:
    """Tokens of an im2latex vocabulary file, one per line (blank lines skipped)."""
    return [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]


def build_tokenizer(vocabulary: list[str]) -> PreTrainedTokenizerFast:
    """A WordLevel tokenizer whose decode joins tokens with single spaces."""
    vocab = {token: i for i, token in enumerate(vocabulary)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=512,
    )


def encode_formula(tokenizer: PreTrainedTokenizerFast, formula: str, max_length: int) -> list[int]:
    """Token ids of `formula` followed by EOS, or [] when it is longer than `max_length`."""
    ids = tokenizer.convert_tokens_to_ids(formula.split())
    if len(ids) + 1 > max_length:
        return []
    return [*ids, tokenizer.eos_token_id]
