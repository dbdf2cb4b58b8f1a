"""JSON and JSON-schema constraints (OpenAI ``response_format``) for the decoding loop, through llguidance.

Owns: validating a ``response_format`` object, compiling it into an llguidance matcher (:class:`GrammarCompiler`,
one per engine, holding the llguidance tokenizer built once from the engine's ``tokenizer.json``), and one
request's grammar state (:class:`Grammar`): the allowed-token mask, advancing through a draft block tentatively,
rolling back to the accepted prefix, and the tokens the grammar forces next (free drafts).

Source: llguidance (https://github.com/guidance-ai/llguidance, MIT; the optional extra ``dspark[grammar]``, pinned
``llguidance==1.9.*``; torch-free, no dependencies). What this module relies on in it (llguidance 1.9.1):

* ``LLTokenizer(tokenizer_json_text, n_vocab=, eos_token=[ids])`` reads the ``tokenizers`` JSON; ids in
  ``[0, n_vocab)`` without a token have no bytes and are never allowed. The engine's ``tokenizer.json`` may pad its
  BPE vocabulary to the model's width with placeholder entries (``[PAD151665]`` .. ``[PAD151935]`` in the Qwen2.5
  engines) that llguidance would allow inside JSON strings; :class:`GrammarCompiler` drops the tail of vocabulary
  entries no merge can produce before llguidance sees it, so those ids are never allowed either.
* ``LLMatcher(tokenizer, grammar)`` never raises on a bad grammar: it enters an error state (``is_error`` /
  ``get_error``) and stays there; consuming a token the grammar forbids does the same, and ``rollback`` does not
  leave it. Hence :meth:`Grammar.consume` validates (``validate_tokens``, no state change) before consuming.
* The mask (``fill_next_token_bitmask``: int32 words, bit ``i % 32`` of word ``i // 32`` is token ``i``) allows the
  EOS ids exactly where the grammar may end. Once nothing but EOS can follow (``is_stopped``), llguidance refuses to
  consume an EOS (error state); :class:`Grammar` then records the EOS itself, so the loop may consume and roll back
  an EOS like any other allowed token.
* ``rollback(n)`` undoes any number of consumed tokens (no depth limit: the history is kept for the whole request);
  rolling back more than was consumed is an error state, so :class:`Grammar` checks the count first.
* ``compute_ff_tokens()`` (fast-forward tokens) is the tokenization of the bytes the grammar forces, less a tail
  that could merge with what follows. Other tokenizations of the same bytes may be allowed too, so they are drafts
  to verify, not the only choice. Needs a canonical tokenizer (BPE: ``LLTokenizer.is_canonical``), else none.
* ``deep_copy()`` copies a matcher cheaply (the compiled grammar and lexer are shared): :class:`GrammarCompiler`
  caches one pristine matcher per canonical schema and hands out copies; :meth:`Grammar.fork` copies too.

Shapes and dtypes: token ids are Python ints in ``[0, vocab_size)`` (the model's logits width); :meth:`Grammar.allowed`
is bool ``[vocab_size]`` (read only); :meth:`Grammar.mask_logits` works in place on a float ``[vocab_size]`` row.

Errors: :class:`GrammarError` (an :class:`~dspark_runtime.errors.InputError`) for a bad or unsupported
``response_format`` (the message names the field); :class:`~dspark_runtime.errors.InputError` when llguidance is not
installed; :class:`~dspark_runtime.errors.DSparkError` for a token the grammar forbids in :meth:`Grammar.consume`.
Layout: :data:`JSON_LAYOUT` — one line, ``", "`` and ``": "`` between items and keys, no other whitespace (so a
model cannot spend its tokens on whitespace, and every separator is a forced token); a schema's own
``"x-guidance"`` object (llguidance's JSON options, e.g. ``{"whitespace_flexible": true}``) overrides it.
``json_schema.strict`` is accepted and changes nothing: the schema is always enforced as written (an object without
``additionalProperties: false`` may get other keys, as JSON Schema says).
"""
from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections import OrderedDict
from numbers import Integral
from pathlib import Path

import numpy as np

from dspark_runtime.errors import DSparkError, InputError

INSTALL_HINT = "JSON / JSON-schema output needs the grammar extra: pip install 'dspark[grammar]'"
RESPONSE_FORMAT_KEYS = ("type", "json_schema")
JSON_SCHEMA_KEYS = ("name", "schema", "strict", "description")
CACHE_SIZE = 64  # pristine matchers kept per compiler (one per distinct schema)
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for json_schema.name


#: llguidance JSON options every schema compiles with unless its "x-guidance" says otherwise (module docstring)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


_NEG_INF_BITS = np.float32(-np.inf).view(np.uint32)


def masked_rows(
    rows: np.ndarray,  # float32 [R, vocab]
    masks: list,  # R bool [vocab] (True = allowed), e.g. Grammar.allowed() per row
    inplace: bool = False,  # write into ``rows`` (a C-contiguous float32 array the caller owns)
) -> np.ndarray:  # float32 [R, vocab]: -inf where not allowed, the other values unchanged bit for bit
    """The rows with every disallowed entry set to -inf, by bitwise select on the float32 bit patterns (branch-free:
    a mask of mixed entries costs what an all-allowed one does, where ``np.where`` or boolean indexing slow down
    several-fold), into a copy or, with ``inplace``, into ``rows`` (one temporary instead of three: a verify block's
    arrays are megabytes, and fresh ones cost page faults). Raises ValueError when the shapes or dtypes disagree."""
    x = rows if inplace else np.array(rows, dtype=np.float32, order="C")
    keep = np.stack(masks)
    if keep.shape != x.shape or keep.dtype != np.bool_ or x.dtype != np.float32 or not x.flags.c_contiguous:
        raise ValueError(f"masks must be {x.shape[0]} bool rows of {x.shape[-1]} over C-contiguous float32 rows, got "
                         f"{keep.dtype} {keep.shape} over {x.dtype} {x.shape}")
    xb = x.view(np.uint32)
    km = keep.view(np.uint8).astype(np.uint32)
    np.negative(km, out=km)  # 0xFFFFFFFF where allowed, 0 elsewhere
    xb &= km
    np.invert(km, out=km)
    km &= _NEG_INF_BITS
    xb |= km
    return x


class GrammarError(InputError):
    """An invalid or unsupported ``response_format`` or JSON schema; the message names the field and the fix."""


def _short(msg: str, limit: int = 300) -> str:
    """llguidance's message on one line, at most ``limit`` characters (parser dumps cut off)."""
    msg = msg.split("\n<state>")[0]
    msg = " ".join(msg.split())
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def _padding_start(tok: dict) -> int | None:
    """The first id of the tail of a BPE vocabulary no merge produces (placeholder rows that pad the vocabulary to
    the model's width), or None when there is none or the model is not a plain BPE with merges."""
    model = tok.get("model") or {}
    vocab, merges = model.get("vocab"), model.get("merges")
    if model.get("type") != "BPE" or not isinstance(vocab, dict) or not merges:
        return None
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None
    made = set()
    for m in merges:
        a, b = m if isinstance(m, (list, tuple)) else m.split(" ", 1)
        made.add(a + b)
    real = [i for t, i in vocab.items() if len(t) == 1 or t in made]
    real += [a["id"] for a in tok.get("added_tokens") or ()]
    end = max(real, default=-1) + 1
    return end if any(i >= end for i in vocab.values()) else None


def _id_count(tok: dict) -> int:
    """1 + the largest id of a ``tokenizers`` JSON (its model's vocabulary and its added tokens)."""
    vocab = (tok.get("model") or {}).get("vocab") or {}
    n = max(vocab.values(), default=-1) + 1 if isinstance(vocab, dict) else len(vocab)
    return max([n] + [a["id"] + 1 for a in tok.get("added_tokens") or ()])


class GrammarCompiler:
    """One per engine: the llguidance tokenizer built once from the engine's tokenizer."""

    def __init__(self, tokenizer_json: str | Path, vocab_size: int, eos_ids: list[int]):
        """``tokenizer_json``: the engine's ``tokenizer/tokenizer.json``; ``vocab_size``: the model's logits width
        (ids the tokenizer lacks are never allowed); ``eos_ids``: the end-of-sequence ids, the only tokens allowed
        once the grammar is complete.

        Raises:
            InputError: llguidance is not installed (names the extra), or the tokenizer does not fit.
        """
        try:
            import llguidance
            import llguidance.numpy as llg_numpy
        except ImportError as e:
            raise InputError(INSTALL_HINT) from e
        if not isinstance(vocab_size, Integral) or isinstance(vocab_size, bool) or vocab_size <= 0:
            raise InputError(f"grammar: vocab_size must be a positive integer, got {vocab_size!r}")
        vocab_size = int(vocab_size)
        eos = [int(i) for i in eos_ids]
        if not eos or any(not 0 <= i < vocab_size for i in eos):
            raise InputError(f"grammar: eos_ids must be ids in [0, {vocab_size}), got {list(eos_ids)!r}")
        path = Path(tokenizer_json)
        if not path.is_file():
            raise InputError(f"grammar: tokenizer file {path} not found (the engine's tokenizer/tokenizer.json)")
        text = path.read_text(encoding="utf-8")
        tok = json.loads(text)
        pad = _padding_start(tok)
        if pad is not None:  # placeholder rows: drop them, llguidance then never allows their ids
            tok["model"]["vocab"] = {t: i for t, i in tok["model"]["vocab"].items() if i < pad}
            text = json.dumps(tok, ensure_ascii=False)
        self.tokenizer_size = pad if pad is not None else _id_count(tok)  # ids the tokenizer has
        try:
            self.ll_tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
        except Exception as e:  # llguidance raises ValueError for a vocabulary wider than vocab_size
            raise InputError(f"grammar: llguidance cannot use {path} with vocab_size {vocab_size}: {_short(str(e))}") \
                from e
        self._llg, self._llg_numpy = llguidance, llg_numpy
        self.vocab_size = vocab_size
        self.eos_ids = eos
        self.version = llguidance.__version__
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # schemas compiled (cache misses)
        self.cache_hits = 0
        self.compile_seconds = 0.0

    def compile(self, response_format: dict) -> "Grammar":
        """A fresh :class:`Grammar` at its start state for an OpenAI ``response_format`` of type ``json_object``
        (any JSON object) or ``json_schema`` (``{"name", "schema", "strict", "description"}``). Compiled schemas are
        cached by their canonical JSON; each call returns an independent state.

        Raises:
            GrammarError: unknown type or keys, missing or non-object schema, a schema llguidance refuses.
        """
        key, schema = self._schema(response_format)
        with self._lock:
            pristine = self._cache.get(key)
            if pristine is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return Grammar(pristine.deep_copy(), self)
        t0 = time.perf_counter()
        field = "response_format.json_schema.schema" if response_format.get("type") == "json_schema" \
            else "response_format"
        try:
            grm = self._llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"{field}: llguidance refuses the schema: {_short(str(e))}; fix the schema") from e
        m = self._llg.LLMatcher(self.ll_tokenizer, grm, log_level=0)
        if m.is_error():
            raise GrammarError(f"{field}: llguidance refuses the schema: {_short(m.get_error())}; fix the schema or "
                               "use supported JSON Schema keywords (github.com/guidance-ai/llguidance, "
                               "docs/json_schema.md)")
        with self._lock:
            self.compiled += 1
            self.compile_seconds += time.perf_counter() - t0
            self._cache[key] = m
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return Grammar(m.deep_copy(), self)

    @staticmethod
    def _schema(rf) -> tuple[str, dict]:
        """(canonical JSON, schema) of a ``response_format``; raises :class:`GrammarError` naming the field."""
        if not isinstance(rf, dict):
            raise GrammarError(f"response_format must be an object, got {type(rf).__name__}")
        extra = sorted(set(rf) - set(RESPONSE_FORMAT_KEYS))
        if extra:
            raise GrammarError(f"response_format: unknown key(s) {extra}; allowed: {list(RESPONSE_FORMAT_KEYS)}")
        kind = rf.get("type")
        if kind == "json_object":
            if "json_schema" in rf:
                raise GrammarError("response_format.json_schema: only with type 'json_schema' (got type "
                                   "'json_object'); drop it or set type to 'json_schema'")
            schema = {"type": "object"}
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if js is None:
                raise GrammarError("response_format.json_schema: missing; type 'json_schema' needs "
                                   '{"name": ..., "schema": {...}}')
            if not isinstance(js, dict):
                raise GrammarError(f"response_format.json_schema: must be an object, got {type(js).__name__}")
            extra = sorted(set(js) - set(JSON_SCHEMA_KEYS))
            if extra:
                raise GrammarError(f"response_format.json_schema: unknown key(s) {extra}; allowed: "
                                   f"{list(JSON_SCHEMA_KEYS)}")
            name = js.get("name")
            if name is not None and (not isinstance(name, str) or not _NAME.match(name)):
                raise GrammarError(f"response_format.json_schema.name: {name!r} must be 1-64 characters of a-z, A-Z, "
                                   "0-9, _ and -")
            if js.get("strict") is not None and not isinstance(js["strict"], bool):
                raise GrammarError(f"response_format.json_schema.strict: must be true, false or null, got "
                                   f"{js['strict']!r}")
            if js.get("description") is not None and not isinstance(js["description"], str):
                raise GrammarError("response_format.json_schema.description: must be a string")
            if "schema" not in js:
                raise GrammarError("response_format.json_schema.schema: missing; give the JSON Schema the output must "
                                   "follow (an object)")
            schema = js["schema"]
            if not isinstance(schema, dict):
                raise GrammarError(f"response_format.json_schema.schema: must be a JSON Schema object, got "
                                   f"{type(schema).__name__}")
        elif kind == "text":
            raise GrammarError("response_format.type: 'text' needs no grammar (do not compile it)")
        else:
            raise GrammarError(f"response_format.type: {kind!r} is not supported; use 'text', 'json_object' or "
                               "'json_schema'")
        try:
            key = json.dumps(schema, sort_keys=True, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise GrammarError(f"response_format.json_schema.schema: not plain JSON ({e})") from e
        return key, schema


class Grammar:
    """One request's grammar state (an llguidance matcher). Tokens are int ids of the model vocabulary.

    Statistics (plain attributes): ``masks_computed`` and ``mask_seconds`` (llguidance's mask plus its unpacking),
    ``tokens_consumed``, ``rollbacks``, ``forced_calls``.
    """

    def __init__(self, matcher, compiler: GrammarCompiler):
        self._m = matcher
        self._c = compiler
        self.vocab_size = compiler.vocab_size
        self._eos = frozenset(compiler.eos_ids)
        self._bits = compiler._llg_numpy.allocate_token_bitmask(1, self.vocab_size)
        self._allowed: np.ndarray | None = None  # the mask at the current state, computed on demand
        self._real = 0  # tokens llguidance consumed
        self._eos_after_stop = 0  # EOS ids consumed after the grammar stopped (llguidance refuses them)
        self.masks_computed = 0
        self.mask_seconds = 0.0
        self.tokens_consumed = 0
        self.rollbacks = 0
        self.forced_calls = 0

    def allowed(self) -> np.ndarray:
        """bool [vocab_size], read only: True where the token is allowed at the current state (EOS ids only where
        the grammar may end). A new array per state: one kept across :meth:`consume` stays as it was."""
        if self._allowed is None:
            t0 = time.perf_counter()
            self._c._llg_numpy.fill_next_token_bitmask(self._m, self._bits)
            words = self._bits if sys.byteorder == "little" else self._bits.astype("<i4")
            a = np.unpackbits(words.view(np.uint8), count=self.vocab_size, bitorder="little").view(bool)
            a.flags.writeable = False
            self._allowed = a
            self.masks_computed += 1
            self.mask_seconds += time.perf_counter() - t0
        return self._allowed

    def mask_logits(self, logits: np.ndarray) -> None:
        """Set the disallowed entries of a float [vocab_size] row to -inf, in place."""
        if logits.shape != (self.vocab_size,) or logits.dtype.kind != "f":
            raise ValueError(f"mask_logits wants a float [{self.vocab_size}] row, got {logits.dtype} {logits.shape}")
        a = self.allowed()
        if np.count_nonzero(a) * 8 < a.size:  # few allowed (structure, enums): keep those, fill the rest
            idx = np.flatnonzero(a)
            keep = logits[idx]
            logits.fill(-np.inf)
            logits[idx] = keep
        else:
            np.copyto(logits, -np.inf, where=~a)

    def allows(self, token: int) -> bool:
        """Whether ``token`` is allowed at the current state (no state change)."""
        token = int(token)
        if not 0 <= token < self.vocab_size:
            return False
        if self._allowed is not None:
            return bool(self._allowed[token])
        if self._m.is_stopped():
            return token in self._eos and not self._m.is_error()
        return self._m.validate_tokens([token]) == 1

    def consume(self, tokens: list[int]) -> None:
        """Advance through ``tokens``, all or none.

        Raises:
            DSparkError: a token is out of range or not allowed where it comes (the state is left unchanged).
        """
        toks = [int(t) for t in tokens]
        if not toks:
            return
        for t in toks:
            if not 0 <= t < self.vocab_size:
                raise DSparkError(f"grammar: token {t} is outside the vocabulary [0, {self.vocab_size})")
        n = 0 if self._m.is_stopped() else self._m.validate_tokens(toks)
        if n and not self._m.consume_tokens(toks[:n]):
            err = _short(self._m.get_error())
            raise DSparkError(f"grammar: llguidance failed to consume validated tokens {toks[:n]}: {err}")
        rest = toks[n:]
        if rest and not (self._m.is_stopped() and all(t in self._eos for t in rest)):
            pos = n
            if self._m.is_stopped():  # only EOS may follow
                pos += next(j for j, t in enumerate(rest) if t not in self._eos)
            if n:
                self._m.rollback(n)
            raise DSparkError(f"grammar: token {toks[pos]} (position {pos} of {toks}) is not allowed by the "
                              "response_format grammar here; only allowed tokens can be consumed")
        self._real += n
        self._eos_after_stop += len(rest)
        self.tokens_consumed += len(toks)
        self._allowed = None

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` consumed tokens (0 <= n <= tokens consumed so far)."""
        if not 0 <= n <= self._real + self._eos_after_stop:
            raise ValueError(f"grammar: cannot roll back {n} tokens, {self._real + self._eos_after_stop} consumed")
        if n == 0:
            return
        k = min(n, self._eos_after_stop)
        self._eos_after_stop -= k
        if n > k:
            if not self._m.rollback(n - k):
                raise DSparkError(f"grammar: llguidance failed to roll back {n - k} tokens: "
                                  f"{_short(self._m.get_error())}")
            self._real -= n - k
        self.rollbacks += 1
        self._allowed = None

    def forced(self, limit: int) -> list[int]:
        """At most ``limit`` tokens the grammar forces next (llguidance's fast-forward tokens; [] when none or when
        only EOS can follow), without consuming them."""
        if limit <= 0 or self._m.is_stopped():
            return []
        self.forced_calls += 1
        return list(self._m.compute_ff_tokens()[:limit])

    @property
    def finished(self) -> bool:
        """The grammar accepts the text so far and allows nothing but EOS."""
        return self._m.is_stopped() and not self._m.is_error()

    def fork(self) -> "Grammar":
        """An independent copy at the same state (llguidance ``deep_copy``; statistics start at zero)."""
        g = Grammar(self._m.deep_copy(), self._c)
        g._real, g._eos_after_stop = self._real, self._eos_after_stop
        return g
