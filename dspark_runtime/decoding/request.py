"""A request of the decoding loop (:mod:`dspark_runtime.decoding.loop`): its state (:class:`Request`), when it ends
(:class:`Stopper`, stop strings in text and streams, :class:`TextStream`), what it asks for
(:func:`check_request`) and what it reports (:class:`GenerationStats`, :class:`GenerationResult`). Pure Python and
numpy, no model I/O; the loop's counters are :mod:`dspark_runtime.decoding.stats`.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from dspark_runtime.decoding.sampling import SamplingParams
from dspark_runtime.errors import InputError

MAX_DRAFT_LENGTH = 16  # the heuristic schedule's longest block (draft_length="auto")


@dataclass
class GenerationStats:
    """Per-request metrics. Times in milliseconds; rates per second of decode time.

    accepted_length_mean (tau): tokens committed per round, bonus included.
    acceptance_rate: accepted draft tokens / proposed draft tokens.
    accepted_by_position[k]: fraction of rounds that proposed position k+1 and accepted it.
    tokens_per_second: generated tokens / decode time (prefill excluded; the first token, which
    prefill produces, is not counted).
    draft_sources: per proposal source, rounds / proposed / accepted (the router; empty otherwise).
    placement: where each graph of the engine ran (``Engine.placement`` as "key=place,..."; empty outside an Engine).
    cached_tokens: prompt tokens whose cached positions came from the prefix cache (not prefilled).
    forced_tokens: tokens a grammar (``response_format``) forced, verified as free drafts.
    masked_drafts: draft tokens a grammar forbade (each ended its block without costing a target position).
    grammar_masks / grammar_mask_ms: allowed-token masks the grammar computed and their time in milliseconds.
    draft_ms: milliseconds of the drafting passes its rounds ran (a pass shared by a batch counts whole for each
    request in it).
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache (not prefilled)
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
    placement: str = ""  # where the engine's graphs ran ("target=cpu,draft=cuda"; dspark_runtime.backends.placement)
    draft_sources: dict = field(default_factory=dict)  # router: {source: {rounds, proposed, accepted}}
    forced_tokens: int = 0
    masked_drafts: int = 0
    grammar_masks: int = 0
    grammar_mask_ms: float = 0.0
    draft_ms: float = 0.0

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class GenerationResult:
    """text: decoded new text (stop string excluded); token_ids: generated ids (list[int]);
    finish_reason: "eos" | "length" | "stop"; logprobs: one
    :class:`~dspark_runtime.decoding.logprobs.TokenLogprob` per generated id when they were asked for, else None."""

    text: str
    token_ids: list
    finish_reason: str
    stats: GenerationStats
    logprobs: list | None = None

    def to_json(self) -> dict:
        out = {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
               "stats": self.stats.to_json()}
        if self.logprobs is not None:
            out["logprobs"] = [{"token": e.token, "logprob": e.logprob, "top": [list(t) for t in e.top]}
                               for e in self.logprobs]
        return out


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


def cut_at_stop(text: str, stop) -> str:
    """``text`` before the first occurrence of any of the ``stop`` strings (all of it when none occurs). Pure."""
    return text[:min((text.find(s) for s in stop or () if s in text), default=len(text))]


def streamable_length(text: str, stop) -> int:
    """How much of ``text`` may be streamed: everything before the first stop string, and never a tail that could
    still grow into one. Pure function."""
    if not stop:
        return len(text)
    hits = [text.find(s) for s in stop if s in text]
    if hits:
        return min(hits)
    hold = max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return len(text) - hold


def check_request(max_new_tokens, temperature, top_k, top_p, stop, presence_penalty=0.0, frequency_penalty=0.0,
                  repetition_penalty=1.0) -> SamplingParams:
    """The sampling parameters of a request, after validating what every request shares. Raises InputError for
    ``max_new_tokens`` < 1, ``stop`` not a list of non-empty strings, or bad sampling parameters or penalties."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if stop is not None and (isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop)):
        raise InputError("stop must be a list of non-empty strings")
    params = SamplingParams(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                            repetition_penalty=repetition_penalty)
    params.validate()
    return params


class TextStream:
    """A request's text as it streams: ``on_tokens(new_ids)`` (the loop's callback) passes each new piece of text to
    ``emit`` — never a tail that could still grow into a stop string (:func:`streamable_length`) or an incomplete
    character — and :meth:`flush` passes what is left of the final text."""

    def __init__(self, decode: Callable, emit: Callable[[str], None], stop):
        self.decode, self.emit, self.stop = decode, emit, stop
        self.ids: list = []
        self.text = ""

    def on_tokens(self, new: list) -> None:
        self.ids += new
        text = self.decode(self.ids)
        text = text[:streamable_length(text, self.stop)]
        if len(text) > len(self.text) and not text.endswith("\ufffd"):
            self.emit(text[len(self.text):])
            self.text = text

    def flush(self, final: str) -> None:
        """Emit the tail of ``final`` (the finished text) held back while a character was incomplete."""
        if len(final) > len(self.text):
            self.emit(final[len(self.text):])


@dataclass
class Request:
    """A request of the decoding loop. ``out`` holds its committed tokens (the last one is the anchor of the next
    round); when ``finish_reason`` is set it is done. ``gamma``: its draft-length cap this round (with
    ``adaptive``, the heuristic schedule moves it: +2 after a fully accepted block, -1 otherwise, within
    [1, :data:`MAX_DRAFT_LENGTH`], as transformers' assisted generation). ``stats`` is filled as it decodes (times
    in ms from its submission; ``tokens_per_second`` is its own decode rate: new tokens after the first / its
    decode wall time, while sharing the batch). ``logprobs``: None, or how many alternatives (0..20) each
    committed token's :class:`~dspark_runtime.decoding.logprobs.TokenLogprob` lists (kept in ``token_logprobs``,
    one per id of ``out``); ``grammar``: a :class:`~dspark_runtime.decoding.grammar.Grammar` that masks its target
    distribution, or None; ``share``: the :class:`PromptShare` of a request whose choices share one prefill."""

    rid: int
    prompt: list
    max_new_tokens: int
    params: SamplingParams
    gamma: int
    rng: np.random.Generator
    stopper: Stopper
    on_tokens: Callable | None = None
    adaptive: bool = False
    last_survival: np.ndarray | None = None  # prefix survivals: its last drafted block's (scheduled), else observed
    fed: int = 0  # prompt tokens in the verifier's cache; it is being prefilled while fed < len(prompt)
    out: list = field(default_factory=list)
    keep: int = 0
    finish_reason: str | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    t_submit: float = 0.0
    t_first: float = 0.0
    pos_hits: Counter = field(default_factory=Counter)
    pos_tries: Counter = field(default_factory=Counter)
    hist: Counter = field(default_factory=Counter)
    logprobs: int | None = None
    token_logprobs: list = field(default_factory=list)
    grammar: Any = None
    share: "PromptShare | None" = None
    seeded: bool = False  # its rng was seeded by the caller (the draft-skip rule then leaves its rounds alone)
    _prompt_set: np.ndarray | None = None

    @property
    def token_ids(self) -> list:
        return self.out[: self.keep]

    @property
    def kept_logprobs(self) -> list | None:
        """The committed tokens' log-probabilities (one per :attr:`token_ids` entry), or None when not asked for."""
        return None if self.logprobs is None else self.token_logprobs[: self.keep]

    @property
    def prompt_set(self) -> np.ndarray:
        """int64 [P]: the prompt's distinct token ids (what the repetition penalty reads)."""
        if self._prompt_set is None:
            self._prompt_set = np.unique(np.asarray(self.prompt, dtype=np.int64))
        return self._prompt_set

    @property
    def argmax_only(self) -> bool:
        """Whether the argmax of the raw logits is all this request reads: greedy, no penalty, no grammar, no
        logprobs, no other choice waiting for its prompt's logits (a runner may then take the argmax on the
        device)."""
        return (self.params.greedy and not self.params.penalized and self.grammar is None and self.logprobs is None
                and self.share is None)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def adapt_gamma(self, drafted: int, accepted: int) -> None:
        """The heuristic schedule (``adaptive``) after a round that verified ``drafted`` tokens and accepted
        ``accepted`` of them; no-op when not adaptive or nothing was drafted."""
        if self.adaptive and drafted:
            self.gamma = min(self.gamma + 2, MAX_DRAFT_LENGTH) if accepted == drafted else max(1, self.gamma - 1)


@dataclass
class PromptShare:
    """The choices of one request (``n`` > 1) that share a single prefill: the ``leader`` feeds the prompt; when its
    last position is cached, its positions (``payload``: :meth:`~dspark_runtime.runners.base.BatchRunner.export_kv`
    of the whole prompt) and that position's raw ``logits`` (float32 [vocab]) are kept until every one of the
    ``followers`` has imported them and drawn its own first token."""

    leader: Request
    followers: list = field(default_factory=list)
    payload: tuple | None = None
    logits: np.ndarray | None = None
