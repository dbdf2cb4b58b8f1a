"""A request of the decoding loop (:mod:`dspark_runtime.decoding.loop`): its state (:class:`Request`), when it ends
(:class:`Stopper`, stop strings in text and streams), and the metrics a run reports (:class:`GenerationStats` per
request, :class:`GenerationResult`, :class:`BatchStats` per loop). Pure Python and numpy, no model I/O.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from dspark_runtime.decoding.sampling import SamplingParams

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


@dataclass
class Request:
    """A request of the decoding loop. ``out`` holds its committed tokens (the last one is the anchor of the next
    round); when ``finish_reason`` is set it is done. ``gamma``: its draft-length cap this round (with
    ``adaptive``, the heuristic schedule moves it: +2 after a fully accepted block, -1 otherwise, within
    [1, :data:`MAX_DRAFT_LENGTH`], as transformers' assisted generation). ``stats`` is filled as it decodes (times
    in ms from its submission; ``tokens_per_second`` is its own decode rate: new tokens after the first / its
    decode wall time, while sharing the batch)."""

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

    @property
    def token_ids(self) -> list:
        return self.out[: self.keep]

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RoundRecord:
    """One round of :class:`~dspark_runtime.decoding.loop.DecodingLoop` (kept where the loop's ``round_trace`` is a list;
    ``scripts/evalsets.py`` ``round_kinds`` summarises them by kind).

    rows: decoding requests verified; prefilling: prompt chunks fed in the round; prompt_tokens: their tokens;
    verify_tokens: anchors + drafts verified (sum of 1 + l_r); pass_tokens: what the target pass computes for the
    decoding rows, padding included (the runner's ``pass_rows``); drafted: whether the drafting pass ran; probe:
    whether it ran as a probe of the skip rule (drafting was not expected to pay, :mod:`dspark_runtime.scheduling.draft_skip`);
    wall_s: seconds inside ``step``; draft_s: of them, the drafting pass's (0.0 where it did not draft); committed:
    tokens the round's verification committed (bonus included; not a request's first token, which the last chunk of
    its prompt gives); expected_drafted / expected_undrafted: the skip rule's expected tok/s for drafting and for
    verifying anchors only this round (:meth:`~dspark_runtime.scheduling.draft_skip.DraftSkipRule.pays`, the verifier priced at
    the measured round-time ratio),
    None where the rule did not weigh them (no drafter, no skip rule, no profiled table, nothing known yet);
    ratio: that measured round-time ratio ``k`` as the rule read it this round (None where it did not weigh).
    """

    rows: int
    prefilling: int
    prompt_tokens: int
    verify_tokens: int
    pass_tokens: int
    drafted: bool
    probe: bool
    wall_s: float
    committed: int
    draft_s: float = 0.0
    expected_drafted: float | None = None
    expected_undrafted: float | None = None
    ratio: float | None = None


@dataclass
class BatchStats:
    """Aggregate metrics of a batched run.

    rounds: verify rounds (rounds in which requests decoded); target_calls: verifier graph calls (one per round,
    two where a round's prompt chunks went in a call of their own); prefill_tokens: prompt tokens fed;
    prefill_chunks: prompt chunks fed (one per prefilling request and round); cached_prompt_tokens: prompt tokens
    reused from the prefix cache instead (:mod:`dspark_runtime.decoding.prefix_cache`); mixed_rounds: verify rounds that also
    fed prompt tokens (rounds a whole-prompt prefill would have stalled); prefill_s: seconds of verifier calls spent
    on prompt tokens (a merged pass is shared by token count; inside wall_s); first_tokens / ttft_s: requests that
    got their first token and the sum of their times to it (seconds from submission), prefix_hit_requests /
    ttft_prefix_hit_s: the same for those that reused cached prefix positions (mean TTFT = ttft_s / first_tokens);
    decode_tokens_per_second: committed tokens / (wall_s - prefill_s); verify_tokens: tokens verified in all rounds (anchors + drafts), i.e. sum of B;
    proposed/accepted: draft tokens verified / accepted; wasted: verified draft tokens the target rejected;
    committed: tokens committed by rounds (bonus included); batch_histogram: rounds by number of requests;
    verify_length_histogram: request-rounds by verify length l_r; accepted_by_position[k]: fraction of
    request-rounds verifying position k+1 that accepted it; wall_s: seconds inside ``step``;
    tokens_per_second: committed tokens / wall_s (aggregate, prefill time included); draft_skipped: rounds that ran
    no drafting pass because drafts were not expected to pay (:meth:`DecodingLoop._drafting_pays`, any mode with a
    profiled cost table).
    """

    rounds: int = 0
    verify_tokens: int = 0
    proposed: int = 0
    accepted: int = 0
    wasted: int = 0
    committed: int = 0
    target_calls: int = 0
    prefill_tokens: int = 0
    prefill_chunks: int = 0
    cached_prompt_tokens: int = 0
    mixed_rounds: int = 0
    prefill_s: float = 0.0
    first_tokens: int = 0
    ttft_s: float = 0.0
    prefix_hit_requests: int = 0
    ttft_prefix_hit_s: float = 0.0
    wall_s: float = 0.0
    batch_histogram: dict = field(default_factory=dict)
    verify_length_histogram: dict = field(default_factory=dict)
    accepted_by_position: list = field(default_factory=list)
    tokens_per_second: float = 0.0
    decode_tokens_per_second: float = 0.0
    accepted_length_mean: float = 0.0
    draft_skipped: int = 0

    def to_json(self) -> dict:
        return dict(self.__dict__)
