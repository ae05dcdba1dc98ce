"""LaTeX tokenization for the formula model and its metrics.

Two views of the same text:

- the model's vocabulary: one id per im2latex token (`\\frac`, `{`, `x`), a
  `tokenizers` WordLevel model over whitespace-split normalized LaTeX, saved
  beside the weights as a standard `tokenizer.json`; a vocabulary may also hold
  merged tokens (`learn_merges`), runs of tokens the model writes in one step,
  stored with their single spaces (`_ {`) so that decoding gives the same spaced text;
- the metric view: `latex_tokens` splits any LaTeX string into commands,
  escaped symbols and single characters, ignoring whitespace, so that
  `\\frac{1}{2}` and `\\frac { 1 } { 2 }` score the same.
"""

from __future__ import annotations

import re
import weakref
from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import pairwise
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from models.formula.style import ALIASES, canonical_latex

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)

_METRIC_TOKEN = re.compile(r"\\[A-Za-z]+|\\.|\S")


def latex_tokens(text: str) -> list[str]:
    """Split LaTeX into commands (`\\alpha`), escaped symbols (`\\{`) and single characters,
    each alias in Texel's spelling (`models.formula.style`): what the scores compare."""
    return [ALIASES.get(token, token) for token in _METRIC_TOKEN.findall(text)]


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


def learn_merges(formulas: Iterable[str], count: int) -> list[str]:
    """`count` merged tokens, byte-pair style: the most frequent pair of adjacent tokens
    in `formulas` becomes one token, again and again; each is written as its im2latex
    tokens joined by single spaces. Ties go to the pair seen first, so the same formulas
    give the same merges."""
    sequences = [formula.split() for formula in formulas]
    merges: list[str] = []
    while len(merges) < count:
        pairs = Counter(pair for tokens in sequences for pair in pairwise(tokens))
        if not pairs:
            break
        (left, right), seen = pairs.most_common(1)[0]
        if seen < 2:
            break
        merged = f"{left} {right}"
        merges.append(merged)
        sequences = [_merge_pair(tokens, left, right, merged) for tokens in sequences]
    return merges


def _merge_pair(tokens: list[str], left: str, right: str, merged: str) -> list[str]:
    out, i = [], 0
    while i < len(tokens):
        if i + 1 < len(tokens) and tokens[i] == left and tokens[i + 1] == right:
            out.append(merged)
            i += 2
        else:
            out.append(tokens[i])
            i += 1
    return out


class _Merged:
    """A vocabulary's merged tokens, by their first im2latex token."""

    def __init__(self, vocabulary: Iterable[str]) -> None:
        self.longest: dict[str, int] = {}
        self.tokens: set[str] = set()
        for token in vocabulary:
            parts = token.split(" ")
            if len(parts) > 1:
                self.tokens.add(token)
                self.longest[parts[0]] = max(self.longest.get(parts[0], 0), len(parts))

    def apply(self, tokens: Sequence[str]) -> list[str]:
        """`tokens` with the longest merged token taken first at each position."""
        out, i = [], 0
        while i < len(tokens):
            for n in range(min(self.longest.get(tokens[i], 1), len(tokens) - i), 1, -1):
                run = " ".join(tokens[i : i + n])
                if run in self.tokens:
                    out.append(run)
                    i += n
                    break
            else:
                out.append(tokens[i])
                i += 1
        return out


_merged: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_tokens(tokenizer: PreTrainedTokenizerFast, formula: str) -> list[str]:
    """`formula` as the tokens the model writes: its im2latex tokens, runs of them
    merged where the vocabulary has a merged token (the longest first)."""
    merged = _merged.get(tokenizer)
    if merged is None:
        merged = _merged[tokenizer] = _Merged(tokenizer.get_vocab())
    return merged.apply(formula.split())


def encode_formula(tokenizer: PreTrainedTokenizerFast, formula: str, max_length: int) -> list[int]:
    """Token ids of `formula` (`model_tokens`) followed by EOS, or [] when it is longer
    than `max_length`."""
    ids = tokenizer.convert_tokens_to_ids(model_tokens(tokenizer, canonical_latex(formula)))
    if len(ids) + 1 > max_length:
        return []
    return [*ids, tokenizer.eos_token_id]
