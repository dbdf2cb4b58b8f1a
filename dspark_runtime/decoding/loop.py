"""The decoding core: one round loop over a set of requests — one request is a set of one.

``Engine.generate``, ``Engine.generate_batch``, ``Engine.batch()`` and the server all run
:class:`DecodingLoop`; the drafters share one interface (:mod:`dspark_runtime.drafting.drafters`), the runners another
(:mod:`dspark_runtime.runners.sequence`). One round (docs/design.md section 1 steps 1-5; DSpark paper section 4 and
Algorithm 1; Leviathan et al. 2023, Algorithm 1)::

    admit waiting requests (a KV row each; their prompts are fed from this round on)   # join between rounds
    proposals = drafter.propose_batch(active)                            # one drafter pass for the decoding rows
    l_r       = verify lengths: fixed γ | static threshold | scheduler   # scheduler: Algorithm 1 over all
    chunks    = plan_prefill(prompt tokens left, block lengths)          # chunked prefill, dspark_runtime.scheduling.prefill
    logits    = target.step([(r, [anchor_r] + drafts_r[:l_r]) for r] + prompt chunks)   # ONE verifier pass
    per request: accept (greedy / rejection sampling with its own RNG), roll back, commit, stop checks
    a prompt fed to its end: its first token x0 from the chunk's last logits; it decodes from the next round
    finished requests leave (their KV slots are freed)

Chunked prefill: a joining prompt is fed a chunk per round (at most ``prefill_budget`` tokens while others decode,
the runner's ``max_chunk`` when none does), so decoding requests keep committing tokens while it is prefilled
instead of waiting for the whole prompt. The chunks ride in the verify pass, or in a second call of the same round
where that computes fewer rows (the scatter layout's padded rows; :func:`dspark_runtime.scheduling.prefill.plan_prefill`).
A position's logits do not depend on how its prompt was chunked on the scatter layout and alone (row padding), so
greedy output is unchanged. With a prefix cache (:mod:`dspark_runtime.decoding.prefix_cache`, the engine's) a joining request
starts from the cached positions of its prompt's longest cached prefix, and a leaving one stores its own.

Target-only decoding is the same loop without a drafter (every round verifies each request's anchor alone).
The round verifies ``sum_r (1 + l_r)`` token positions; its cost is read from the cost table at ``B``, the positions
the runner's pass computes (its ``pass_rows``: that sum on the packed layout, ``R x max_r(1 + l_r)`` on the scatter
layout, which pads each request's row to the longest, then to the probed row multiple by a longer row or a dummy row,
:func:`dspark_runtime.runners.scatter.padded_shape`) — the quantity the scheduler and the skip rule weigh. A request's
state, stop rule and metrics are :mod:`dspark_runtime.decoding.request`.
Each request owns its RNG (``seed``), so a sampled request gives the same tokens whatever else shares its batch;
a greedy request's tokens equal decoding it alone, target-only — bit for bit on the scatter KV layout (one batch
row per request) and alone on any layout (:func:`dspark_runtime.runners.sequence.batch_runner`).
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Callable

import numpy as np

from dspark_runtime.decoding.acceptance import greedy_accept, rejection_accept
from dspark_runtime.scheduling.draft_skip import SKIP_PROBE_EVERY, SKIP_PROBE_MAX, DraftSkipRule  # noqa: F401 (re-exported)
from dspark_runtime.drafting.drafters import Proposal
from dspark_runtime.errors import DSparkError, InputError
from dspark_runtime.scheduling.cost_table import check_cost_table, cost_table_at
from dspark_runtime.scheduling.prefill import DEFAULT_PREFILL_BUDGET, plan_prefill
from dspark_runtime.scheduling.prefill import prefill_budget as auto_prefill_budget
from dspark_runtime.decoding.prefix_cache import concat_blocks, payload_bytes
from dspark_runtime.decoding.request import MAX_DRAFT_LENGTH, BatchStats, GenerationStats, Request, RoundRecord, Stopper
from dspark_runtime.decoding.sampling import SamplingParams, process_logits, sample

def select_token(logits: np.ndarray, params: SamplingParams, rng) -> int:
    """The next token from ``logits`` float [vocab]: the argmax when greedy, else a sample of the processed
    distribution (temperature, top-k, top-p) drawn with ``rng``."""
    if params.greedy:
        return int(np.argmax(logits))
    return sample(process_logits(logits, params), rng)


class DecodingLoop:
    """The round loop (continuous batching; one request is a set of one): ``submit`` requests, call ``step`` (one
    round) until done, or ``run``.

    Args:
        target: the verifier's runner (:func:`dspark_runtime.runners.sequence.batch_runner`: a
            :class:`~dspark_runtime.runners.scatter.ScatterRunner`, :class:`~dspark_runtime.runners.packed.PackedRunner` or
            :class:`~dspark_runtime.runners.sequence.SequenceRunner`).
        drafter: a drafter of the :mod:`dspark_runtime.drafting.drafters` interface
            (:class:`~dspark_runtime.drafting.dspark.DSparkDrafter`, :class:`~dspark_runtime.drafting.router.Router`,
            :class:`~dspark_runtime.drafting.drafters.LMDrafter`, :class:`~dspark_runtime.drafting.drafters.NgramDrafter`) or
            None for target-only decoding (every round verifies each request's anchor alone).
        eos_ids: end-of-sequence ids; decode: ids -> text (stop strings).
        mode: "fixed" (verify min(γ, drafted) tokens), "scheduled" (paper Algorithm 1 over all requests'
            calibrated prefix survivals and ``cost_table``; needs a drafter with a confidence head).
            A static threshold is the drafter's ``confidence_threshold``.
        cost_table: the manifest's ``speculation.cost_table`` dict: needed for "scheduled", and the auto prefill
            budget reads it. Each round reads it at the cached positions its pass reads (the target runner's
            ``attended_positions`` of the decoding requests: the longest one's, or the scatter / packed layout's
            whole slot array; :func:`dspark_runtime.scheduling.cost_table.cost_table_at` over its context buckets).
        max_batch: most requests decoding or being prefilled at once; more wait in the queue and join between
            rounds (a :class:`~dspark_runtime.runners.sequence.SequenceRunner` target holds one).
        prefill_budget: prompt tokens fed per round while other requests decode (chunked prefill), an int >= 1, or
            "auto": :func:`dspark_runtime.scheduling.prefill.prefill_budget` of ``cost_table`` at each round's cached
            positions (:data:`~dspark_runtime.scheduling.prefill.DEFAULT_PREFILL_BUDGET` without a table); default
            :data:`~dspark_runtime.scheduling.prefill.DEFAULT_PREFILL_BUDGET`. ``self.prefill_budget`` is the last round's.
        prefix_cache: a :class:`~dspark_runtime.decoding.prefix_cache.PrefixCache` shared across loops (the engine's), or
            None: a joining request starts from the cached positions of its prompt's longest cached prefix, and a
            request that leaves stores its cached positions' full blocks (the target runner must export and import
            positions: ``export_kv`` / ``import_kv``, the scatter KV layout).
        draft_skip: rounds skip the drafting pass when it is not expected to pay (:meth:`_drafting_pays`); None:
            in scheduled mode only (with fixed lengths the rule reads measured wall times, so it is opt-in there).
    Raises InputError for an unknown mode, a missing or malformed cost table, a bad max_batch or prefill_budget.
    """

    def __init__(self, target, drafter=None, *, eos_ids=(), decode: Callable | None = None,
                 mode: str = "fixed", cost_table: dict | None = None, max_batch: int = 8,
                 prefill_budget: int | str | None = None, prefix_cache=None, draft_skip: bool | None = None):
        prefill_budget = DEFAULT_PREFILL_BUDGET if prefill_budget is None else prefill_budget
        if cost_table:
            try:
                check_cost_table(cost_table)
            except ValueError as e:
                raise InputError(str(e)) from None
        self._auto_budget = prefill_budget == "auto"
        if self._auto_budget:  # the reference context's until a round with decoding requests says otherwise
            prefill_budget = auto_prefill_budget(cost_table, max_chunk=target.max_chunk)
        if isinstance(prefill_budget, bool) or not isinstance(prefill_budget, int) or prefill_budget < 1:
            raise InputError(f"prefill_budget must be a positive integer (prompt tokens per round) or 'auto', got "
                             f"{prefill_budget!r}")
        if mode not in ("fixed", "scheduled"):
            raise InputError(f"unknown verify-length mode {mode!r}: use 'fixed' or 'scheduled'")
        if mode == "scheduled" and not cost_table:
            raise InputError("scheduled verify lengths need the engine's cost table; run `dspark-export profile`")
        if not isinstance(max_batch, int) or max_batch < 1:
            raise InputError(f"max_batch must be a positive integer, got {max_batch!r}")
        self.target, self.drafter = target, drafter
        self._observe = getattr(drafter, "observe", None)  # the router learns from each round's verdicts
        self._sources = getattr(drafter, "source_stats", None)  # the router's per-request source counts
        self.eos_ids, self.decode = list(eos_ids), decode
        self.mode, self.cost_table, self.max_batch = mode, cost_table, max_batch
        self.prefill_budget, self.prefix_cache = prefill_budget, prefix_cache
        self.waiting: list = []
        self.prefilling: list = []  # admitted, prompt being fed (oldest first)
        self.active: list = []  # decoding
        self.stats = BatchStats()
        self._pos_hits: Counter = Counter()
        self._pos_tries: Counter = Counter()
        self._vlen: Counter = Counter()
        self._bhist: Counter = Counter()
        self._next_id = 0
        self.default_gamma, self.default_adaptive = 5, False  # Engine.batch sets the engine's defaults
        self.skip = DraftSkipRule(observed=mode == "fixed")  # whether a round's drafting pass pays
        self.draft_skip = mode == "scheduled" if draft_skip is None else bool(draft_skip)
        self.round_trace: list | None = None  # a list: each round appends its RoundRecord (scripts/round_trace.py)

    def submit(self, prompt: list, *, max_new_tokens: int = 128, params: SamplingParams | None = None,
               gamma: int | None = None, adaptive: bool | None = None, seed: int | None = None, stop: list | None = None,
               on_tokens: Callable | None = None) -> Request:
        """Queue a request (prompt: token ids). It joins at the next round with a free slot.

        gamma: its draft-length cap (the first one with ``adaptive``; default ``default_gamma``); adaptive: the
        heuristic schedule (default ``default_adaptive``); seed: its sampling RNG; stop: strings that
        end it; on_tokens(new_ids): called with every batch of committed tokens.
        Raises InputError for an empty prompt, max_new_tokens < 1 or gamma < 1."""
        if not prompt:
            raise InputError("the prompt has no tokens")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        gamma = self.default_gamma if gamma is None else gamma
        adaptive = self.default_adaptive if adaptive is None else adaptive
        if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
            raise InputError(f"gamma must be a positive integer, got {gamma!r}")
        params = params or SamplingParams()
        params.validate()
        req = Request(rid=self._next_id, prompt=list(prompt), max_new_tokens=max_new_tokens, params=params,
                      gamma=gamma, rng=np.random.default_rng(seed),
                      stopper=Stopper(self.eos_ids, max_new_tokens, stop or [], self.decode),
                      on_tokens=on_tokens, adaptive=bool(adaptive), t_submit=time.perf_counter())
        req.stats = GenerationStats(prompt_tokens=len(prompt), drafter=getattr(self.drafter, "name", "none"))
        self._next_id += 1
        self.waiting.append(req)
        return req

    def cancel(self, req: Request) -> None:
        """Stop a request (e.g. its client went away): it leaves at once, its slots are freed."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.active or req in self.prefilling:
            self._leave(req)
        if req.finish_reason is None:
            req.finish_reason = "cancelled"

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.active)

    def run(self) -> None:
        """Step until every submitted request is done."""
        while self.busy:
            self.step()

    def _admit(self, req: Request) -> None:
        """Give ``req`` its verifier cache row, filled with its prompt's longest cached prefix when there is a prefix
        cache (never the last prompt token: its logits give the first token); the rest of the prompt is fed from
        this round on (:meth:`step`)."""
        self.target.add(req.rid)
        req.fed = 0
        if self.prefix_cache is not None:
            blocks = self.prefix_cache.lookup(req.prompt[:-1], "target")
            if blocks:
                kv, feats = concat_blocks(blocks)
                self.target.import_kv(req.rid, kv, feats)
                req.fed = self.target.length(req.rid)
                self.stats.cached_prompt_tokens += req.fed
        req.stats.cached_tokens = req.fed
        self.prefilling.append(req)

    def _store_prefix(self, req: Request) -> None:
        """Store the full blocks of ``req``'s cached positions (prompt and committed tokens) in the prefix cache."""
        rid = req.rid

        def export(start: int, end: int) -> tuple:
            payload = self.target.export_kv(rid, start, end)
            return payload, payload_bytes(payload)

        n = self.target.length(rid)
        self.prefix_cache.insert((req.prompt + req.out)[:n], "target", export)

    def _first_token(self, req: Request, logits: np.ndarray) -> None:
        """``req``'s prompt is in the cache: pick its first token x0 from the last prompt position's ``logits``
        (float32 [vocab]); it decodes from the next round (or finishes at once: EOS, a stop string, one token)."""
        self.prefilling.remove(req)
        req.out = [int(logits) if np.ndim(logits) == 0 else select_token(logits, req.params, req.rng)]  # 0-d: argmax
        req.t_first = time.perf_counter()
        req.stats.ttft_ms = (req.t_first - req.t_submit) * 1e3
        st = self.stats
        st.first_tokens += 1
        st.ttft_s += req.stats.ttft_ms / 1e3
        if req.stats.cached_tokens:
            st.prefix_hit_requests += 1
            st.ttft_prefix_hit_s += req.stats.ttft_ms / 1e3
        req.keep, reason = req.stopper.check(req.out, 0)
        if req.on_tokens:
            req.on_tokens(req.out[: req.keep])
        self.active.append(req)
        if reason is not None:
            self._finish(req, reason)
        elif self.drafter is not None:
            self.drafter.begin(req)

    def _leave(self, req: Request) -> None:
        if self.prefix_cache is not None:
            self._store_prefix(req)
        if req in self.prefilling:  # cancelled mid-prompt: the drafter has not begun it
            self.prefilling.remove(req)
        else:
            self.active.remove(req)
            if self.drafter is not None:
                self.drafter.remove(req.rid)
        self.target.remove(req.rid)

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.out = req.out[: req.keep]
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
        if self._sources is not None:
            s.draft_sources = self._sources(req.rid)
        if s.decode_ms > 0:
            s.tokens_per_second = (len(req.out) - 1) / (s.decode_ms / 1e3)
        self._leave(req)

    def _lengths(self, reqs: list, props: list, caps: list, table: dict | None = None) -> list:
        """Each request's verify length this round: min(drafted, cap) in fixed mode, else Algorithm 1 over the
        proposals' survivals with ``table`` (the cost table at this round's context; default ``self.cost_table``),
        costed at the tokens the target's pass really computes (``pass_rows``: the scatter layout pads each request's
        row to the longest)."""
        if self.mode == "fixed":
            return [min(len(p.tokens), c) for p, c in zip(props, caps)]
        from dspark_runtime.scheduling.verify_length import schedule_greedy

        if any(p.survival is None or len(p.survival) != len(p.tokens) for p in props):
            raise DSparkError("scheduled verify lengths need calibrated prefix survivals from the drafter "
                              "(the DSpark confidence head)")
        from dspark_runtime.scheduling.verify_length import round_cost_table

        cost = round_cost_table(self.cost_table if table is None else table, len(reqs))
        return schedule_greedy([p.survival for p in props], cost, max_len=caps, pass_tokens=self.target.pass_rows)

    def _drafting_pays(self, reqs: list, caps: list, table: dict | None = None) -> bool:
        """Whether this round should run the drafting pass: :meth:`DraftSkipRule.pays` (the DSpark paper's
        asynchronous variant, section 4; :mod:`dspark_runtime.scheduling.draft_skip`) over each request's survivals of earlier
        rounds — calibrated (scheduled mode) or observed verdicts (fixed verify lengths, any drafter) — and the
        cost table at this round's context (``table``, default ``self.cost_table``); always True without the
        profiled split (``t_verify``)."""
        table = self.cost_table if table is None else table
        if self.drafter is None or not table or not self.draft_skip:
            return True
        return self.skip.pays([r.last_survival for r in reqs], caps, table, pass_tokens=self.target.pass_rows)

    def _verify(self, segs: list, psegs: list, merged: bool) -> tuple:
        """The round's verifier work: the decoding requests' verify ``segs`` and the prompt chunks ``psegs`` (lists
        of (rid, token ids)) in one ``target.step`` when ``merged``, else the chunks in a second call. Returns
        (logits per verify segment, logits per prompt chunk), float32 [q, vocab] each (a greedy request's: int64 [q]
        argmax ids where the runner takes the argmax on the device; a prompt chunk's: its last position's only, where
        the runner takes ``last_only``); counts the calls and the seconds spent on prompt tokens."""
        st = self.stats
        ptoks, dtoks = sum(len(t) for _, t in psegs), sum(len(t) for _, t in segs)
        kw = {}
        if getattr(self.target, "step_hints", False):  # compute / copy back only what this round reads
            kw = {"argmax_for": {r.rid for r in self.active + self.prefilling if r.params.greedy},
                  "last_only": {rid for rid, _ in psegs}}  # a prompt chunk: its last position's logits
        if merged or not segs or not psegs:
            t = time.perf_counter()
            out = self.target.step(segs + psegs, **kw)
            st.target_calls += 1
            st.prefill_s += (time.perf_counter() - t) * ptoks / (ptoks + dtoks)
            return out[: len(segs)], out[len(segs):]
        dec = self.target.step(segs, **kw)
        t = time.perf_counter()
        pre = self.target.step(psegs, **kw)
        st.prefill_s += time.perf_counter() - t
        st.target_calls += 2
        return dec, pre

    def step(self) -> list:
        """One round: admit waiting requests, draft, schedule, verify all decoding requests in one verifier pass
        with the next chunk of the prompts being prefilled, accept and commit. Returns the requests that finished
        in this round (a prompt fed to its end can finish at once: EOS, a stop string, one token)."""
        t0 = time.perf_counter()
        finished = []
        admitted = bool(self.waiting) and len(self.active) + len(self.prefilling) < self.max_batch
        while self.waiting and len(self.active) + len(self.prefilling) < self.max_batch:
            self._admit(self.waiting.pop(0))
        reqs = list(self.active)
        if not reqs and not self.prefilling:
            self.stats.wall_s += time.perf_counter() - t0
            return finished
        caps = [max(1, min(r.gamma, r.max_new_tokens - len(r.out))) for r in reqs]
        # the cost table at the cached positions this round's pass reads (the runner's: BatchRunner.attended_positions)
        table = cost_table_at(self.cost_table, self.target.attended_positions([r.rid for r in reqs])) if reqs else None
        if table and self._auto_budget and self.prefilling:
            self.prefill_budget = auto_prefill_budget(table, max_chunk=self.target.max_chunk)
        drafted, steady, probe, committed0, draft_s = False, True, False, self.stats.committed, 0.0
        self.skip.last_expected = None
        if not reqs:
            props, lengths = [], []
        elif self.drafter is not None and self._drafting_pays(reqs, caps, table):
            drafted = True
            probe = self.draft_skip and bool(table) and self.skip.probing
            steady = self.skip.undrafted == 0 and all(r.last_survival is not None for r in reqs)
            t_d = time.perf_counter()
            props = self.drafter.propose_batch(reqs, caps)
            draft_s = time.perf_counter() - t_d
            if steady:  # every request drafted last round too: no catch-up of skipped tokens in this timing
                self.skip.record_draft_time(len(reqs), draft_s)
            lengths = self._lengths(reqs, props, caps, table)
            self.skip.drafted()
            if not self.skip.observed:
                for r, p in zip(reqs, props):
                    if p.survival is not None and len(p.survival):
                        r.last_survival = np.asarray(p.survival, dtype=np.float64)
        else:
            props, lengths = [Proposal([])] * len(reqs), [0] * len(reqs)
            if self.drafter is not None:
                self.skip.skipped()
                self.stats.draft_skipped += 1
        segs, bases = [], []
        for r, p, ell in zip(reqs, props, lengths):
            bases.append(self.target.length(r.rid))
            segs.append((r.rid, [r.out[-1]] + p.tokens[:ell]))
        plan = plan_prefill([len(r.prompt) - r.fed for r in self.prefilling], [len(t) for _, t in segs],
                            budget=self.prefill_budget, max_chunk=self.target.max_chunk,
                            pass_rows=self.target.pass_rows)
        feeding = [(r, c) for r, c in zip(self.prefilling, plan.chunks) if c]
        psegs = [(r.rid, r.prompt[r.fed:r.fed + c]) for r, c in feeding]
        logits_all, prompt_logits = self._verify(segs, psegs, plan.merged)
        self.stats.prefill_tokens += plan.tokens
        self.stats.prefill_chunks += len(psegs)
        if reqs:
            self.stats.rounds += 1
            self._bhist[len(reqs)] += 1
            self.stats.mixed_rounds += bool(psegs)
        for (r, c), logits in zip(feeding, prompt_logits):
            r.fed += c
            if r.fed == len(r.prompt):
                self._first_token(r, logits[-1])
                if r.done:
                    finished.append(r)
        for r, p, ell, base, logits in zip(reqs, props, lengths, bases, logits_all):
            d = np.asarray(p.tokens[:ell], dtype=np.int64)
            if r.params.greedy:
                n, nxt = greedy_accept(d, logits)
            else:
                pr = process_logits(logits, r.params)
                if p.q is None:
                    q = np.zeros((ell, pr.shape[-1]), dtype=pr.dtype)
                    q[np.arange(ell), d] = 1.0
                else:
                    q = p.q[:ell]
                n, nxt = rejection_accept(d, q, pr, r.rng)
            self.target.rollback(r.rid, base + 1 + n)
            if self._observe is not None:
                self._observe(r.rid, ell, n)
            if self.skip.observed and ell:
                r.last_survival = self.skip.record_verdict(r.last_survival, ell, n)
            before = len(r.out)
            r.out += p.tokens[:n] + [nxt]
            s = r.stats
            s.num_rounds += 1
            s.proposed += ell
            s.accepted += n
            r.hist[ell] += 1
            if r.adaptive and ell:
                r.gamma = min(r.gamma + 2, MAX_DRAFT_LENGTH) if n == ell else max(1, r.gamma - 1)
            self._vlen[ell] += 1
            for k in range(ell):
                r.pos_tries[k] += 1
                r.pos_hits[k] += k < n
                self._pos_tries[k] += 1
                self._pos_hits[k] += k < n
            self.stats.verify_tokens += 1 + ell
            self.stats.proposed += ell
            self.stats.accepted += n
            self.stats.wasted += ell - n
            self.stats.committed += n + 1
            r.keep, reason = r.stopper.check(r.out, before)
            if r.on_tokens:
                r.on_tokens(r.out[before: r.keep])
            if reason is not None:
                self._finish(r, reason)
                finished.append(r)
        st = self.stats
        wall = time.perf_counter() - t0
        st.wall_s += wall
        if self.round_trace is not None:
            exp_d, exp_0 = self.skip.last_expected or (None, None)
            self.round_trace.append(RoundRecord(
                rows=len(reqs), prefilling=len(psegs), prompt_tokens=plan.tokens,
                verify_tokens=sum(len(t) for _, t in segs),
                pass_tokens=int(self.target.pass_rows([len(t) for _, t in segs])) if segs else 0,
                drafted=drafted, probe=probe, wall_s=wall, draft_s=draft_s, committed=st.committed - committed0,
                expected_drafted=exp_d, expected_undrafted=exp_0,
                ratio=None if exp_d is None else self.skip.ratio()))
        if reqs and table and self.drafter is not None and self.draft_skip and steady and not psegs and not admitted:
            self.skip.record_round(table, self.target.pass_rows([len(t) for _, t in segs]), wall, draft_s)
        st.batch_histogram = {str(k): v for k, v in sorted(self._bhist.items())}
        st.verify_length_histogram = {str(k): v for k, v in sorted(self._vlen.items())}
        st.accepted_by_position = [self._pos_hits[k] / self._pos_tries[k] for k in sorted(self._pos_tries)]
        st.tokens_per_second = st.committed / st.wall_s if st.wall_s > 0 else 0.0
        dec = st.wall_s - st.prefill_s
        st.decode_tokens_per_second = st.committed / dec if dec > 0 else 0.0
        st.accepted_length_mean = st.committed / sum(self._vlen.values()) if self._vlen else 0.0
        return finished
