"""A character-level tokenizer for the built-in tasks (digit strings and a few symbols)."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["DEFAULT_CHARS", "REPLACEMENT", "CharTokenizer"]

# '>' doubles as the prompt/answer separator; the rest keeps small arithmetic-style tasks
# expressible. Keep the set small: at init the policy samples almost uniformly over the
# vocabulary, so every extra symbol lowers the starting reward of the digits task.
DEFAULT_CHARS = ">0123456789+-="
REPLACEMENT = "\ufffd"  # how decode shows ids that are not characters


class CharTokenizer:
    """Maps characters to ids. Ids 0, 1, 2 are pad, bos, eos; the characters follow."""

    pad_id = 0
    bos_id = 1
    eos_id = 2
    specials = ("<pad>", "<bos>", "<eos>")

    def __init__(self, chars: str = DEFAULT_CHARS, sep: str = ">") -> None:
        if len(set(chars)) != len(chars):
            raise ValueError(f"tokenizer chars must be unique, got {chars!r}")
        if sep not in chars:
            raise ValueError(f"separator {sep!r} must be one of the chars {chars!r}")
        self.chars = chars
        self.sep = sep
        self._stoi = {c: i + len(self.specials) for i, c in enumerate(chars)}
        self._itos = dict(enumerate(self.specials)) | {i: c for c, i in self._stoi.items()}
        self.sep_id = self._stoi[sep]

    @property
    def vocab_size(self) -> int:
        return len(self.specials) + len(self.chars)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        try:
            ids = [self._stoi[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the tokenizer vocabulary "
                             f"{self.chars!r}") from None
        return [self.bos_id] * bos + ids + [self.eos_id] * eos

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` up to the first eos. pad, bos and unknown ids become U+FFFD, one
        character each: dropping them would let a policy fake a short answer with them."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            out.append(self._itos[i] if i >= len(self.specials) and i in self._itos
                       else REPLACEMENT)
        return "".join(out)
