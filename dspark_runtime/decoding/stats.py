"""What the decoding loop counts: a loop's aggregate :class:`BatchStats` (counters; histograms and rates computed when
read), a request's counters (:func:`count_verdict`, :func:`finish_request_stats`), and one round's clock
(:class:`RoundMeter`): its wall and drafting times, the :class:`RoundRecord` of the loop's round trace, and the steady
rounds the skip rule's round-time ratio learns from. Pure Python, no model I/O.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class RoundRecord:
    """One round of :class:`~dspark_runtime.decoding.loop.DecodingLoop` (kept where the loop's ``round_trace`` is a
    list; ``benchmarks/evalsets.py`` ``round_kinds`` summarises them by kind).

    rows: decoding requests verified; prefilling: prompt chunks fed in the round; prompt_tokens: their tokens;
    verify_tokens: anchors + drafts verified (sum of 1 + l_r); pass_tokens: what the target pass computes for the
    decoding rows, padding included (the runner's ``pass_rows``); drafted: whether the drafting pass ran; probe:
    whether it ran as a probe of the skip rule (drafting was not expected to pay); wall_s: seconds inside ``step``;
    draft_s: of them, the drafting pass's (0.0 where it did not draft); committed: tokens the round's verification
    committed (bonus included; not a request's first token, which the last chunk of its prompt gives);
    expected_drafted / expected_undrafted: the skip rule's expected tok/s for drafting and for verifying anchors only
    (:meth:`~dspark_runtime.scheduling.draft_skip.DraftSkipRule.pays`), None where it did not weigh them; ratio: the
    measured round-time ratio ``k`` it read (None where it did not weigh).
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
    """Aggregate metrics of a decoding loop.

    rounds: verify rounds (rounds in which requests decoded); target_calls: verifier graph calls (one per round,
    two where a round's prompt chunks went in a call of their own); prefill_tokens / prefill_chunks: prompt tokens
    and chunks fed; cached_prompt_tokens: prompt tokens reused from the prefix cache instead; mixed_rounds: verify
    rounds that also fed prompt tokens; prefill_s: seconds of verifier calls spent on prompt tokens (a merged pass
    is shared by token count; inside wall_s); first_tokens / ttft_s: requests that got their first token and the
    sum of their times to it (seconds from submission), prefix_hit_requests / ttft_prefix_hit_s: the same for those
    that reused cached prefix positions; verify_tokens: tokens verified in all rounds (sum of B); proposed /
    accepted / wasted: draft tokens verified / accepted / rejected; committed: tokens committed by rounds (bonus
    included); wall_s: seconds inside ``step``; draft_skipped: rounds that ran no drafting pass because drafts were
    not expected to pay; constrained_requests / forced_tokens / masked_drafts: requests with a grammar, tokens it
    forced (verified as free drafts) and draft tokens it forbade. Read-only, computed when read: batch_histogram (rounds by requests),
    verify_length_histogram (request-rounds by verify length), accepted_by_position[k] (fraction of request-rounds
    verifying position k+1 that accepted it), tokens_per_second (committed / wall_s), decode_tokens_per_second
    (committed / (wall_s - prefill_s)), accepted_length_mean (committed per request-round).
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
    draft_skipped: int = 0
    constrained_requests: int = 0
    forced_tokens: int = 0
    masked_drafts: int = 0
    _batch: Counter = field(default_factory=Counter, repr=False, compare=False)
    _vlen: Counter = field(default_factory=Counter, repr=False, compare=False)
    _pos_hits: Counter = field(default_factory=Counter, repr=False, compare=False)
    _pos_tries: Counter = field(default_factory=Counter, repr=False, compare=False)

    @property
    def batch_histogram(self) -> dict:
        return {str(k): v for k, v in sorted(self._batch.items())}

    @property
    def verify_length_histogram(self) -> dict:
        return {str(k): v for k, v in sorted(self._vlen.items())}

    @property
    def accepted_by_position(self) -> list:
        return [self._pos_hits[k] / self._pos_tries[k] for k in sorted(self._pos_tries)]

    @property
    def tokens_per_second(self) -> float:
        return self.committed / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        dec = self.wall_s - self.prefill_s
        return self.committed / dec if dec > 0 else 0.0

    @property
    def accepted_length_mean(self) -> float:
        return self.committed / sum(self._vlen.values()) if self._vlen else 0.0

    def to_json(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if not k.startswith("_") and k != "draft_skipped"}
        for k in ("batch_histogram", "verify_length_histogram", "accepted_by_position", "tokens_per_second",
                  "decode_tokens_per_second", "accepted_length_mean"):
            out[k] = getattr(self, k)
        out["draft_skipped"] = self.draft_skipped
        return out

    def count_first_token(self, req) -> None:
        """``req`` got its first token (its ``stats.ttft_ms`` set)."""
        self.first_tokens += 1
        self.ttft_s += req.stats.ttft_ms / 1e3
        if req.stats.cached_tokens:
            self.prefix_hit_requests += 1
            self.ttft_prefix_hit_s += req.stats.ttft_ms / 1e3

    def count_round(self, rows: int, prompt_chunks: list) -> None:
        """A round verified ``rows`` decoding requests and fed ``prompt_chunks`` (token counts) of prompts."""
        self.prefill_tokens += sum(prompt_chunks)
        self.prefill_chunks += len(prompt_chunks)
        if rows:
            self.rounds += 1
            self._batch[rows] += 1
            self.mixed_rounds += bool(prompt_chunks)


def count_verdict(stats: BatchStats, req, ell: int, n: int) -> None:
    """``req`` verified ``ell`` drafted tokens this round and the target accepted the first ``n``: its counters and
    the loop's (one more committed token: the correction or the bonus)."""
    s = req.stats
    s.num_rounds += 1
    s.proposed += ell
    s.accepted += n
    req.hist[ell] += 1
    stats._vlen[ell] += 1
    for k in range(ell):
        req.pos_tries[k] += 1
        req.pos_hits[k] += k < n
        stats._pos_tries[k] += 1
        stats._pos_hits[k] += k < n
    stats.verify_tokens += 1 + ell
    stats.proposed += ell
    stats.accepted += n
    stats.wasted += ell - n
    stats.committed += n + 1


def finish_request_stats(req, sources: dict | None) -> None:
    """Fill ``req.stats`` when it finishes (its tokens cut to ``keep``): counts, times in ms, rates, its histograms;
    ``sources``: the drafter's per-source counts (``Drafter.source_stats``), None without a drafter."""
    now = time.perf_counter()
    s = req.stats
    s.new_tokens = len(req.out)
    s.decode_ms = (now - req.t_first) * 1e3
    s.total_ms = (now - req.t_submit) * 1e3
    if s.num_rounds:
        s.accepted_length_mean = (len(req.out) - 1) / s.num_rounds
    if s.proposed:
        s.acceptance_rate = s.accepted / s.proposed
    s.accepted_by_position = [req.pos_hits[k] / req.pos_tries[k] for k in sorted(req.pos_tries)]
    s.draft_length_histogram = {str(k): v for k, v in sorted(req.hist.items())}
    if sources is not None:
        s.draft_sources = sources
    if s.decode_ms > 0:
        s.tokens_per_second = (len(req.out) - 1) / (s.decode_ms / 1e3)


class RoundMeter:
    """One round's clock, started when the round starts: its wall time and its drafting pass's, the round trace's
    record, and the steady rounds (no prompt chunk, no admission, every request drafted last round too) whose wall
    time the skip rule's round-time ratio learns from (:meth:`DraftSkipRule.record_round`)."""

    def __init__(self, stats: BatchStats):
        self.stats = stats
        self.t0 = time.perf_counter()
        self.committed0 = stats.committed
        self.drafted = self.probe = False
        self.steady = True  # a round that does not draft is steady; a drafting one says
        self.draft_s = 0.0

    def draft(self, propose, *, probe: bool, steady: bool):
        """Run and time the drafting pass ``propose()``; returns what it returns."""
        self.drafted, self.probe, self.steady = True, probe, steady
        t = time.perf_counter()
        out = propose()
        self.draft_s = time.perf_counter() - t
        return out

    def idle(self) -> None:
        """The round had nothing to do."""
        self.stats.wall_s += time.perf_counter() - self.t0

    def end(self, *, rows: int, prompt_chunks: list, verify_lengths: list, pass_tokens: int, skip, trace: list | None,
            table: dict | None, learn: bool) -> None:
        """Close the round: its wall time into the stats; a :class:`RoundRecord` onto ``trace`` (a list, or None);
        with ``learn`` (a steady-candidate round: decoding rows, a profiled ``table``, the skip rule on, no prompt
        chunk, no admission) and a steady round, its time into ``skip`` (the round's
        :class:`~dspark_runtime.scheduling.draft_skip.DraftSkipRule`)."""
        wall = time.perf_counter() - self.t0
        self.stats.wall_s += wall
        if trace is not None:
            exp_d, exp_0 = skip.last_expected or (None, None)
            trace.append(RoundRecord(
                rows=rows, prefilling=len(prompt_chunks), prompt_tokens=sum(prompt_chunks),
                verify_tokens=sum(verify_lengths), pass_tokens=pass_tokens, drafted=self.drafted, probe=self.probe,
                wall_s=wall, draft_s=self.draft_s, committed=self.stats.committed - self.committed0,
                expected_drafted=exp_d, expected_undrafted=exp_0, ratio=None if exp_d is None else skip.ratio()))
        if learn and self.steady:
            skip.record_round(table, pass_tokens, wall, self.draft_s)
