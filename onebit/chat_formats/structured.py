"""Structured output: sampling constrained to a grammar (JSON, a JSON schema, a tool call).

The grammar engine is llguidance (an installed package, the `serve` extra): it works from the
model's own vocabulary, computes each step's allowed-token mask on the fly (no index built
over the vocabulary per schema) and needs only numpy. A constraint is a logits processor
(sample.py's interface): it feeds the matcher the tokens sampled since its last call, then
sets every token the grammar does not allow to -inf. When the grammar is complete only the
end-of-generation tokens remain, so the reply stops there.
"""

from __future__ import annotations

import json
import weakref
from typing import Any, Optional, Sequence

import numpy as np

from ..errors import UsageError, json_object

_SPECIAL_MARK = b"\xff"  # llguidance's prefix for a special token's bytes
_tokenizers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise UsageError("structured output needs the llguidance package: pip install 'onebit[serve]'") from None
    return llguidance


def is_special(tokenizer, token_id: int) -> bool:
    """Whether llguidance sees this token as special (written `<|name|>` in a grammar, never
    matched by plain text): control tokens, and user-defined ones that look like tags (as
    llguidance's own llama.cpp bridge decides)."""
    from ..formats.tokenizer import _A_USER_DEFINED

    if tokenizer.is_special(token_id):
        return True
    piece = tokenizer.token_bytes(token_id)
    return bool(tokenizer._attrs[token_id] & _A_USER_DEFINED) and piece.startswith(b"<") and piece.endswith(b">")


def grammar_tokenizer(model):
    """The model's vocabulary as llguidance sees it (built once per tokenizer, about 10 ms per
    10k tokens): every token's bytes, special ones marked, and our own encoder for text."""
    tok = model.tokenizer
    ll = _tokenizers.get(tok)
    if ll is not None:
        return ll
    llguidance = _llguidance()
    pieces = []
    for i in range(tok.vocab_size):
        piece = tok.token_bytes(i)
        pieces.append(_SPECIAL_MARK + piece if is_special(tok, i) else piece)
    n_vocab = max(model.cfg.vocab_size, tok.vocab_size)
    pieces += [b""] * (n_vocab - len(pieces))  # output rows past the vocabulary: never allowed

    class Vocabulary:  # what llguidance.TokenizerWrapper reads
        eos_token_id = tok.eos_id
        bos_token_id = tok.bos_id
        tokens = pieces

        def __call__(self, text: bytes) -> list[int]:
            return tok.encode(text.decode("utf-8", "replace"), add_special=False, parse_special=False)

    stops = sorted(tok.stop_ids) or ([tok.eos_id] if tok.eos_id is not None else [])
    ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocabulary()), n_vocab=n_vocab, eos_token=stops)
    _tokenizers[tok] = ll
    return ll


# Compact JSON (no free whitespace): a small model left free to add blanks may add nothing else.
_JSON_OPTIONS = {"whitespace_flexible": False}


def json_grammar(schema: Optional[dict] = None) -> str:
    """A grammar for one JSON object (any object when `schema` is None)."""
    llguidance = _llguidance()
    if schema is None:
        schema = {"type": "object"}
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise UsageError(f"the JSON schema is not usable: {e}") from None


def lark_grammar(text: str) -> str:
    return _llguidance().LLMatcher.grammar_from_lark(text)


def literal(tokenizer, text: str) -> str:
    """`text` as a Lark terminal: the special token itself when the vocabulary has it as one
    (a model writes `<tool_call>` as its one token), else the quoted string."""
    tid = tokenizer.token_to_id(text)
    if tid is not None and is_special(tokenizer, tid):
        return text
    return json.dumps(text)


def json_rule(schema: Any) -> str:
    """A Lark expression matching compact JSON for `schema` (llguidance's %json extension)."""
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**_JSON_OPTIONS, **schema.get("x-guidance", {})}}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def _first_line(error: str, most: int = 300) -> str:
    """The reason in an llguidance error, without the grammar and parser state it appends."""
    line = error.strip().split("\n", 1)[0]
    return line if len(line) <= most else line[:most] + "..."


class Constraint:
    """A logits processor that allows only what continues the grammar. Make one per
    generation (it holds the parse state)."""

    def __init__(self, model, grammar: str):
        llguidance = _llguidance()
        ll = grammar_tokenizer(model)
        error = llguidance.LLMatcher.validate_grammar(grammar, ll)
        if error and not error.startswith("WARNING"):
            raise UsageError(f"the grammar is not usable: {_first_line(error)}")
        self.matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
        if self.matcher.is_error():
            raise UsageError(f"the grammar is not usable: {_first_line(self.matcher.get_error())}")
        self.n_vocab = ll.vocab_size
        self.stops = np.asarray(sorted(model.tokenizer.stop_ids), dtype=np.int64)
        self.start: Optional[int] = None  # len(tokens) at the first call: the prompt
        self.fed = 0  # generated tokens given to the matcher

    def __call__(self, tokens: Sequence[int], logits: np.ndarray) -> np.ndarray:
        if self.start is None:
            self.start = len(tokens)
        for t in tokens[self.start + self.fed:]:
            self.matcher.consume_token(int(t))  # a token the mask allowed; an error shows below
            self.fed += 1
        self._check()
        mask = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        self._check()
        out = np.full_like(logits, -np.inf)
        allowed = np.unpackbits(mask, bitorder="little")[: min(len(logits), self.n_vocab)].astype(bool)
        out[: len(allowed)][allowed] = logits[: len(allowed)][allowed]
        return out

    def _check(self) -> None:
        """The engine gave up (a grammar too large for it, a reference loop): one error, never a
        reply cut short as if it were complete."""
        if self.matcher.is_error():
            raise UsageError(f"the grammar engine gave up on this schema or grammar: "
                             f"{_first_line(self.matcher.get_error())}")

    @property
    def complete(self) -> bool:
        return self.matcher.is_accepting()


def load_schema(path: str) -> dict:
    """A JSON schema file (for `generate --json-schema`), checked before any model is loaded."""
    try:
        with open(path, "rb") as f:
            data = f.read(16 << 20)
    except OSError as e:
        raise UsageError(f"{path}: cannot read the JSON schema ({e.strerror})") from None
    schema = json_object(data, f"{path}: the JSON schema")
    check_schema(schema, path)
    return schema


def check_schema(schema: dict, where: str = "the JSON schema") -> None:
    """Refuse a schema llguidance cannot compile, with its reason."""
    llguidance = _llguidance()
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise UsageError(f"{where}: not usable as a JSON schema ({e})") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise UsageError(f"{where}: not usable as a JSON schema ({error})")
