"""The generation loop: target-only decoding and speculative decoding with a pluggable drafter.

One speculative round (docs/design.md section 1, steps 1 and 5; Leviathan et al. 2023, Chen et al.
2023)::

    drafts, q = drafter.propose(context, gamma)         # draft gamma tokens after the anchor x0
    logits    = target.step([x0, d_1 .. d_gamma])        # one verify pass, gamma + 1 positions
    n, next   = accept(drafts, q, p(logits))             # pure function (acceptance.py)
    target.rollback(to: anchor + n accepted drafts)      # O(1) length pointer
    commit d_1..d_n, next                                # `next` is the new anchor (bonus token)

Model calls live in ``DecoderRunner`` and the drafters; acceptance and token selection are pure
functions in :mod:`dspark_runtime.acceptance` and :mod:`dspark_runtime.sampling`.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from dspark_runtime.acceptance import greedy_accept, rejection_accept
from dspark_runtime.backend import OrtDecoder
from dspark_runtime.kvcache import KVCache, causal_mask
from dspark_runtime.router import ngram_match
from dspark_runtime.sampling import SamplingParams, process_logits, sample

PREFILL_CHUNK = 256


class DecoderRunner:
    """One sequence's view of a decoder graph: the backend plus its KV cache.

    ``step(tokens)`` feeds tokens after the cached ones and returns logits float32 [q, vocab].

    ``row_multiple`` (int >= 1): every graph call is padded to a multiple of this many rows (the extra
    rows repeat the last token after the real ones; their logits and KV entries are dropped), which makes
    the verifier's results independent of the call's row count where the kernels are not
    (:mod:`dspark_runtime.invariance`). 1 = no padding.
    """

    def __init__(self, backend: OrtDecoder, row_multiple: int = 1):
        self.backend = backend
        self.row_multiple = row_multiple
        self.cache = KVCache(backend.empty_kv(1))
        self._feats = None  # float32 [capacity, m * hidden]: target features by position (DSpark context)

    @property
    def features(self) -> np.ndarray | None:
        """Target features of the cached positions, float32 [length, m * hidden] (a view), or None when
        the graph outputs none. Rolled back with the KV cache (same length pointer)."""
        return None if self._feats is None else self._feats[: self.cache.length]

    @property
    def length(self) -> int:
        return self.cache.length

    def reset(self) -> None:
        self.cache.reset()

    def step(self, tokens) -> np.ndarray:
        """Feed ``tokens`` (list of int, q >= 1) at positions length..length+q-1; returns [q, vocab].
        The call is padded to a multiple of ``row_multiple`` rows (padding never reaches the cache length,
        the logits or the features)."""
        q, past = len(tokens), self.cache.length
        fed = list(tokens) + [tokens[-1]] * ((-q) % self.row_multiple)
        n = len(fed)
        ids = np.asarray(fed, dtype=np.int64)[None]
        pos = np.arange(past, past + n, dtype=np.int64)[None]
        out = self.backend.step(ids, pos, causal_mask(n, past), self.cache.view())
        self.cache.update(out.kv, past + q)
        if out.features is not None:
            f = out.features[0, :q]
            if self._feats is None or self._feats.shape[0] < past + q:
                grown = np.empty((max(1024, 2 * (past + q)), f.shape[-1]), dtype=np.float32)
                if self._feats is not None:
                    grown[:past] = self._feats[:past]
                self._feats = grown
            self._feats[past:past + q] = f
        return out.logits[0, :q]

    def prefill(self, tokens, chunk: int = PREFILL_CHUNK) -> np.ndarray:
        """Feed a prompt in chunks of ``chunk`` tokens (at most the backend's ``max_q``, where it has one: a
        TensorRT engine's prefill profile); returns the last position's logits [vocab]."""
        chunk = min(chunk, getattr(self.backend, "max_q", chunk))
        if chunk > self.row_multiple:  # a padded chunk must still fit the backend's max_q
            chunk -= chunk % self.row_multiple
        logits = None
        for s in range(0, len(tokens), chunk):
            logits = self.step(tokens[s:s + chunk])
        return logits[-1]

    def rollback(self, length: int) -> None:
        self.cache.rollback(length)


def decoder_runner(backend, row_multiple: int = 1):
    """The one-sequence runner for ``backend``'s ``causal_lm`` graph: a :class:`DecoderRunner` for the growing and
    capacity KV layouts, a :class:`~dspark_runtime.slots.SlotSequence` (same interface) for the scatter layout."""
    spec = getattr(backend, "spec", None)
    if spec is not None and spec.kv_layout == "scatter":
        from dspark_runtime.slots import SlotSequence

        return SlotSequence(backend, row_multiple=row_multiple)
    return DecoderRunner(backend, row_multiple=row_multiple)


class Drafter(Protocol):
    """A source of draft blocks.

    ``propose(context, gamma, params, rng)`` -> (tokens list[int] of length l <= gamma,
    probs float [l, vocab] of the processed draft distributions the tokens were drawn from, or
    None when greedy or when the proposal is deterministic (a point mass on each token)).
    ``context`` is every committed token (prompt + generated), the last one being the anchor.
    Optionally ``observe(n_accepted)`` is called after each verification (calibration, metrics).
    """

    name: str

    def begin(self, prompt: list) -> None: ...

    def propose(self, context: list, gamma: int, params: SamplingParams, rng) -> tuple: ...


class LMDrafter:
    """A standalone draft LM of the same tokenizer, run autoregressively with its own KV cache.

    The cache is kept aligned with the committed context: after a round, the positions of the
    rejected drafts are rolled back (O(1)) and the missing committed tokens (the bonus token, and
    the last draft if all were accepted) are fed at the start of the next proposal.

    ``confidence_threshold`` (static-threshold baseline, docs/design.md section 1 step 4; the same rule
    as transformers' ``assistant_confidence_threshold``): stop drafting after the first token whose
    draft probability (softmax of the draft logits, max over the vocabulary) is below it. The
    decision uses the draft's own distribution only, never the target's, so sampling stays exact.
    """

    name = "lm"

    def __init__(self, runner: DecoderRunner, confidence_threshold: float | None = None):
        self.runner = runner
        self.confidence_threshold = confidence_threshold
        self._cached: list = []  # the tokens whose KV the draft cache holds
        self._known = 0  # a prefix length of _cached known to equal the committed context

    def begin(self, prompt: list) -> None:
        self.runner.reset()
        self._cached = []
        self._known = 0
        if len(prompt) > 1:
            self.runner.prefill(prompt[:-1])
            self._cached = list(prompt[:-1])

    def _sync(self, context: list) -> list:
        """Roll the cache back to its longest prefix shared with ``context``; return the rest.

        Committed context only grows, so the prefix up to the previous proposal's context is
        known to match: compare only past it (O(gamma) per round, not O(context)). At least the last
        context token is returned (its logits give the next draft token), even when the cache already holds
        the whole context: a router can commit exactly the tokens this drafter had drafted and cached."""
        m = min(len(self._cached), len(context) - 1)
        n = min(self._known, m)
        while n < m and self._cached[n] == context[n]:
            n += 1
        self.runner.rollback(n)
        self._cached = self._cached[:n]
        return context[n:]

    def propose(self, context: list, gamma: int, params: SamplingParams, rng) -> tuple:
        pending = self._sync(context)
        self._known = len(context)
        tokens, probs = [], []
        for k in range(gamma):
            logits = self.runner.step(pending)[-1]
            self._cached += pending
            if params.greedy:
                t = int(np.argmax(logits))
            else:
                q = process_logits(logits, params)
                t = sample(q, rng)
                probs.append(q)
            tokens.append(t)
            pending = [t]
            if self.confidence_threshold is not None and k + 1 < gamma:
                z = logits - logits.max()
                top = 1.0 / np.exp(z, dtype=np.float64).sum()  # max softmax probability
                if top < self.confidence_threshold:
                    break
        return tokens, (np.stack(probs) if probs else None)


class NgramDrafter:
    """Prompt-lookup drafting (no weights): find the most recent earlier occurrence of the last
    ``n`` committed tokens (n = max_ngram .. min_ngram) in the context and propose the tokens that
    followed it. Proposals are deterministic (point masses), which keeps rejection sampling exact.
    A miss proposes nothing and the round is a plain target step.
    (Saxena 2023, "Prompt Lookup Decoding"; transformers' ``prompt_lookup_num_tokens``.)
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def begin(self, prompt: list) -> None:
        pass

    def propose(self, context: list, gamma: int, params: SamplingParams, rng) -> tuple:
        return ngram_lookup(np.asarray(context, dtype=np.int64), gamma, self.max_ngram, self.min_ngram), None


def ngram_lookup(context: np.ndarray, gamma: int, max_ngram: int = 3, min_ngram: int = 1) -> list:
    """Continuation of the most recent earlier match of the context's last n tokens.

    context: int64 [L]. Tries n = max_ngram down to min_ngram; returns up to ``gamma`` tokens
    (list[int], possibly empty). Pure function (:func:`dspark_runtime.router.ngram_match` without the match
    quality).
    """
    return ngram_match(context, gamma, max_ngram, min_ngram).tokens


@dataclass
class GenerationStats:
    """Per-request metrics. Times in milliseconds; rates per second of decode time.

    accepted_length_mean (tau): tokens committed per round, bonus included.
    acceptance_rate: accepted draft tokens / proposed draft tokens.
    accepted_by_position[k]: fraction of rounds that proposed position k+1 and accepted it.
    tokens_per_second: generated tokens / decode time (prefill excluded; the first token, which
    prefill produces, is not counted).
    draft_sources: per proposal source, rounds / proposed / accepted (the router; empty otherwise).
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    num_rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    accepted_length_mean: float = 0.0
    acceptance_rate: float = 0.0
    accepted_by_position: list = field(default_factory=list)
    draft_length_histogram: dict = field(default_factory=dict)
    ttft_ms: float = 0.0
    decode_ms: float = 0.0
    total_ms: float = 0.0
    tokens_per_second: float = 0.0
    drafter: str = "none"
    draft_sources: dict = field(default_factory=dict)  # router: {source: {rounds, proposed, accepted}}

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class GenerationResult:
    """text: decoded new text (stop string excluded); token_ids: generated ids (list[int]);
    finish_reason: "eos" | "length" | "stop"."""

    text: str
    token_ids: list
    finish_reason: str
    stats: GenerationStats

    def to_json(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "stats": self.stats.to_json()}


class DraftSchedule:
    """Draft length per round: fixed, or the "heuristic" schedule (+2 after a fully accepted
    block, -1 otherwise; as transformers' assisted generation), within [1, max_length]."""

    def __init__(self, initial: int, adaptive: bool, max_length: int = 16):
        self.gamma, self.adaptive, self.max_length = initial, adaptive, max_length

    def update(self, proposed: int, accepted: int) -> None:
        if not self.adaptive:
            return
        self.gamma = min(self.gamma + 2, self.max_length) if accepted == proposed else max(1, self.gamma - 1)


def select_token(logits: np.ndarray, params: SamplingParams, rng) -> int:
    """The next token from ``logits`` float [vocab]: the argmax when greedy, else a sample of the processed
    distribution (temperature, top-k, top-p) drawn with ``rng``."""
    if params.greedy:
        return int(np.argmax(logits))
    return sample(process_logits(logits, params), rng)


class Stopper:
    """When a request ends: EOS, max_new_tokens and stop strings (one request's; the single and the batched loops
    share it). ``check(tokens, start)`` -> (keep_count, reason or None)."""

    def __init__(self, eos_ids, max_new_tokens: int, stop: list, decode: Callable):
        self.eos, self.max_new, self.stop, self.decode = set(eos_ids), max_new_tokens, stop, decode

    def check(self, tokens: list, start: int) -> tuple:
        """tokens: all generated ids; start: index of the first id committed this round.
        A round may overshoot max_new_tokens: only the first max_new_tokens ids count."""
        limit = min(len(tokens), self.max_new)
        for i in range(start, limit):
            if tokens[i] in self.eos:
                return i + 1, "eos"
        if self.stop and start < limit:
            text = self.decode(tokens[:limit])
            for s in self.stop:
                if s in text:
                    # the shortest token prefix whose text contains the stop string
                    for j in range(start + 1, limit + 1):
                        if s in self.decode(tokens[:j]):
                            return j, "stop"
        if limit >= self.max_new:
            return limit, "length"
        return limit, None


def generate_tokens(target: DecoderRunner, prompt: list, *, max_new_tokens: int, params: SamplingParams,
                    eos_ids, drafter: Drafter | None = None, draft_length: int = 5, adaptive: bool = False,
                    seed: int | None = None, stop: list | None = None, decode: Callable = None,
                    on_tokens: Callable | None = None) -> tuple:
    """Generate up to ``max_new_tokens`` after ``prompt`` (list of token ids).

    With ``drafter=None`` this is target-only decoding (one target step per token); otherwise
    speculative decoding, lossless: greedy output equals target-only greedy output, and sampled
    output follows the target's processed distribution (rejection sampling on the processed p
    and q; Leviathan et al. 2023, Algorithm 1).

    Returns (token_ids list[int], finish_reason str, GenerationStats). ``on_tokens(new_ids)``
    is called with every batch of committed tokens.
    """
    rng = np.random.default_rng(seed)
    stats = GenerationStats(prompt_tokens=len(prompt), drafter=getattr(drafter, "name", "none"))
    stopper = Stopper(eos_ids, max_new_tokens, stop or [], decode)
    t0 = time.perf_counter()
    target.reset()
    last_logits = target.prefill(prompt)
    x0 = select_token(last_logits, params, rng)
    out = [x0]
    stats.ttft_ms = (time.perf_counter() - t0) * 1e3
    t_dec = time.perf_counter()
    keep, reason = stopper.check(out, 0)
    if on_tokens:
        on_tokens(out[:keep])
    pos_hits: Counter = Counter()
    pos_tries: Counter = Counter()
    hist: Counter = Counter()
    schedule = DraftSchedule(draft_length, adaptive)
    if drafter is not None and reason is None:
        drafter.begin(prompt)
    while reason is None:
        before = len(out)
        if drafter is None:
            logits = target.step([out[-1]])[-1]
            out.append(select_token(logits, params, rng))
            stats.num_rounds += 1
        else:
            gamma = max(1, min(schedule.gamma, max_new_tokens - len(out)))
            context = prompt + out
            drafts, q = drafter.propose(context, gamma, params, rng)
            ell = len(drafts)  # verify length: a drafter may propose fewer than gamma (n-gram miss)
            base = target.length
            logits = target.step([out[-1]] + drafts)
            d = np.asarray(drafts, dtype=np.int64)
            if params.greedy:
                n, nxt = greedy_accept(d, logits)
            else:
                p = process_logits(logits, params)
                if q is None:  # deterministic proposal: point masses
                    q = np.zeros((ell, p.shape[-1]), dtype=p.dtype)
                    q[np.arange(ell), d] = 1.0
                n, nxt = rejection_accept(d, q, p, rng)
            target.rollback(base + 1 + n)
            observe = getattr(drafter, "observe", None)
            if observe is not None:
                observe(n)
            out += drafts[:n] + [nxt]
            stats.num_rounds += 1
            stats.proposed += ell
            stats.accepted += n
            hist[ell] += 1
            for k in range(ell):
                pos_tries[k] += 1
                pos_hits[k] += k < n
            if ell:
                schedule.update(ell, n)
        keep, reason = stopper.check(out, before)
        if on_tokens:
            on_tokens(out[before:keep])
    out = out[:keep]
    now = time.perf_counter()
    stats.new_tokens = len(out)
    stats.decode_ms = (now - t_dec) * 1e3
    stats.total_ms = (now - t0) * 1e3
    if stats.num_rounds:
        stats.accepted_length_mean = (len(out) - 1) / stats.num_rounds
    if stats.proposed:
        stats.acceptance_rate = stats.accepted / stats.proposed
    stats.accepted_by_position = [pos_hits[k] / pos_tries[k] for k in sorted(pos_tries)]
    stats.draft_length_histogram = {str(k): v for k, v in sorted(hist.items())}
    stats.draft_sources = dict(getattr(drafter, "source_stats", None) or {})
    if stats.decode_ms > 0:
        stats.tokens_per_second = (len(out) - 1) / (stats.decode_ms / 1e3)
    return out, reason, stats
