"""N-gram prompt lookup (:func:`ngram_match`, pure) and two drafters of the
:class:`~dspark_runtime.drafting.base.Drafter` interface: :class:`NgramDrafter` (prompt lookup, no weights) and
:class:`LMDrafter` (a standalone draft LM over its own runner). The DSpark drafter is
:class:`dspark_runtime.drafting.dspark.DSparkDrafter`; the router is :class:`dspark_runtime.drafting.router.Router`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dspark_runtime.decoding.prefix_cache import concat_blocks, payload_bytes
from dspark_runtime.decoding.sampling import process_logits, sample
from dspark_runtime.drafting.base import Drafter, Proposal


# ------------------------------------------------------------------------------------------- n-gram match


@dataclass(frozen=True)
class NgramMatch:
    """One prompt-lookup result.

    tokens: the proposed continuation, list[int] of length <= gamma (empty on a miss).
    ngram: length n of the matched suffix (0 on a miss).
    support: number of earlier occurrences of that n-gram in the context (0 on a miss); the continuation
        follows the most recent one.
    start: context index of the first continuation token (-1 on a miss).
    extent: how many tokens the context's suffix and the text before ``start`` agree on, counting back from
        the anchor (>= ngram; capped at ``MAX_EXTENT``; 0 on a miss). A long extent means the output is
        copying a span of the context (a signature, a docstring, a repeated line), where the continuation
        is accepted far more often than after a coincidental 1-3 token match.
    """

    tokens: list = field(default_factory=list)
    ngram: int = 0
    support: int = 0
    start: int = -1
    extent: int = 0

    @property
    def length(self) -> int:
        """Continuation length (number of proposed tokens)."""
        return len(self.tokens)


def ngram_match(context: np.ndarray, gamma: int, max_ngram: int = 3, min_ngram: int = 1) -> NgramMatch:
    """Prompt lookup with its match quality. Pure function.

    context: int64 [L], every committed token (the last one is the anchor). Tries n = max_ngram down to
    min_ngram: the context's last n tokens are searched among the earlier windows; the longest n with a hit
    wins, and the continuation (up to ``gamma`` tokens) follows its most recent earlier occurrence -- the
    same proposal as :func:`ngram_lookup`. Returns an :class:`NgramMatch`.
    """
    context = np.asarray(context, dtype=np.int64)
    L = len(context)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        if n <= 0:
            break
        tail = context[L - n:]
        windows = np.lib.stride_tricks.sliding_window_view(context[:L - 1], n)  # starts 0..L-1-n
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the token after the most recent match
            return NgramMatch(context[start:start + gamma].tolist(), n, int(hits.size), start,
                              match_extent(context, start, n))
    return NgramMatch()


MAX_EXTENT = 32


def match_extent(context: np.ndarray, start: int, n: int, cap: int = MAX_EXTENT) -> int:
    """Length of the agreement between the context's suffix and the tokens before ``start``, counted back
    from the anchor: the largest e <= cap (and e <= start) with context[L-e:] == context[start-e:start].
    ``n`` tokens are known to agree already. Pure function; int."""
    L = len(context)
    e = min(cap, start)
    if e <= n:
        return min(n, e)
    a = context[L - e:][::-1]
    b = context[start - e:start][::-1]
    diff = np.flatnonzero(a != b)
    return int(diff[0]) if diff.size else e


def ngram_lookup(context: np.ndarray, gamma: int, max_ngram: int = 3, min_ngram: int = 1) -> list:
    """Continuation of the most recent earlier match of the context's last n tokens.

    context: int64 [L]. Tries n = max_ngram down to min_ngram; returns up to ``gamma`` tokens
    (list[int], possibly empty). Pure function (:func:`ngram_match` without the match quality).
    """
    return ngram_match(context, gamma, max_ngram, min_ngram).tokens


# ------------------------------------------------------------------------------------------- drafters


class NgramDrafter(Drafter):
    """Prompt-lookup drafting (no weights): the continuation of the most recent earlier occurrence of the last
    ``n`` committed tokens (n = max_ngram .. min_ngram). Proposals are point masses, which keeps rejection
    sampling exact; a miss proposes nothing and the round is a plain target step.
    (Saxena 2023, "Prompt Lookup Decoding"; transformers' ``prompt_lookup_num_tokens``.)

    Raises ValueError unless 1 <= min_ngram <= max_ngram."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def begin(self, req) -> None:
        pass

    def remove(self, rid) -> None:
        pass

    def propose_batch(self, reqs: list, gammas: list, only=None) -> list:
        return [Proposal(ngram_lookup(np.asarray(r.prompt + r.out, dtype=np.int64), g, self.max_ngram,
                                      self.min_ngram) if only is None or r.rid in only else [])
                for r, g in zip(reqs, gammas)]


class LMDrafter(Drafter):
    """A standalone draft LM of the same tokenizer, run autoregressively over its own runner (a
    :class:`~dspark_runtime.runners.sequence.BatchRunner`: one request, or several packed/slotted like the verifier): each
    of the γ draft steps is one graph call over every request still drafting.

    Each request's draft cache is kept aligned with its committed context: the positions of rejected drafts are
    rolled back (O(1)) and the committed tokens the cache lacks (the bonus token, the last draft when all were
    accepted, a round the router sent elsewhere) are fed at the start of the next proposal.

    ``confidence_threshold`` (static-threshold baseline, docs/design.md section 1 step 4; transformers'
    ``assistant_confidence_threshold``): a request's block ends after its first draft token whose draft
    probability (max softmax of the draft logits) is below it. The rule reads the draft's own distribution only,
    so sampling stays exact.

    ``prefix_cache`` (a :class:`~dspark_runtime.decoding.prefix_cache.PrefixCache`, the engine's, or None): the draft cache
    of a joining request starts from the cached ``"draft"`` blocks of its prompt, and a request that leaves stores
    its draft cache's full blocks (the runner must export and import positions: the scatter KV layout).
    """

    name = "lm"

    def __init__(self, runner, confidence_threshold: float | None = None, prefix_cache=None):
        self.runner = runner
        self.confidence_threshold = confidence_threshold
        self.prefix_cache = prefix_cache
        self._cached: dict = {}  # rid -> the tokens whose KV the draft cache holds
        self._known: dict = {}  # rid -> a prefix length of _cached known to equal the committed context

    def begin(self, req) -> None:
        self.runner.add(req.rid)
        self._known[req.rid] = 0
        ctx = req.prompt[:-1]
        if self.prefix_cache is not None and ctx:
            blocks = self.prefix_cache.lookup(ctx, "draft", count=False)  # the loop counts the target's lookup
            if blocks:
                self.runner.import_kv(req.rid, *concat_blocks(blocks))
        n = self.runner.length(req.rid)
        if len(ctx) > n:
            self.runner.prefill(req.rid, ctx[n:])
        self._cached[req.rid] = list(ctx)

    def remove(self, rid) -> None:
        if self.prefix_cache is not None and rid in self._cached:
            def export(start: int, end: int) -> tuple:
                payload = self.runner.export_kv(rid, start, end)
                return payload, payload_bytes(payload)

            self.prefix_cache.insert(self._cached[rid][: self.runner.length(rid)], "draft", export)
        self.runner.remove(rid)
        self._cached.pop(rid, None)
        self._known.pop(rid, None)

    def _sync(self, rid, context: list) -> list:
        """Roll ``rid``'s cache back to its longest prefix shared with ``context``; return the rest.

        Committed context only grows, so the prefix up to the previous proposal's context is known to match:
        compare only past it (O(γ) per round). At least the last context token is returned (its logits give
        the next draft token), even when the cache holds the whole context: a router can commit exactly the
        tokens this drafter had drafted and cached."""
        cached = self._cached[rid]
        m = min(len(cached), len(context) - 1)
        n = min(self._known[rid], m)
        while n < m and cached[n] == context[n]:
            n += 1
        self.runner.rollback(rid, n)
        self._cached[rid] = cached[:n]
        self._known[rid] = len(context)
        return context[n:]

    def propose_batch(self, reqs: list, gammas: list, only=None) -> list:
        drafting = [(r, g) for r, g in zip(reqs, gammas) if g > 0 and (only is None or r.rid in only)]
        pending = {r.rid: self._sync(r.rid, r.prompt + r.out) for r, _ in drafting}
        toks = {r.rid: [] for r in reqs}
        qs = {r.rid: [] for r in reqs}
        gam = dict((r.rid, g) for r, g in drafting)
        live = [r for r, _ in drafting]
        while live:
            outs = self.runner.step([(r.rid, pending[r.rid]) for r in live])
            nxt = []
            for r, lg in zip(live, outs):
                logits = lg[-1]
                self._cached[r.rid] += pending[r.rid]
                if r.params.greedy:
                    t = int(np.argmax(logits))
                else:
                    q = process_logits(logits, r.params)
                    t = sample(q, r.rng)
                    qs[r.rid].append(q)
                toks[r.rid].append(t)
                pending[r.rid] = [t]
                stop = len(toks[r.rid]) >= gam[r.rid]
                if not stop and self.confidence_threshold is not None:
                    z = logits - logits.max()
                    stop = 1.0 / np.exp(z, dtype=np.float64).sum() < self.confidence_threshold
                if not stop:
                    nxt.append(r)
            live = nxt
        return [Proposal(toks[r.rid], np.stack(qs[r.rid]) if qs[r.rid] else None) for r in reqs]
