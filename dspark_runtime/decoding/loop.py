"""The decoding core: one round loop over a set of requests (one request is a set of one), run by ``Engine.generate``,
``Engine.generate_batch``, ``Engine.batch()`` and the server. A round (docs/architecture.md, "One round of
DecodingLoop.step()"; DSpark paper Algorithm 1; Leviathan et al. 2023, Algorithm 1): admit waiting requests; one
drafting pass for the decoding ones; verify lengths, fixed or scheduled; the next chunk of each joining prompt; ONE
verifier pass; per request accept, roll back, observe, commit and stop checks; finished requests leave. Greedy output
equals target-only decoding; each request owns its RNG, so a sampled one gives the same tokens in any batch.
Collaborators: the drafter (:class:`~dspark_runtime.drafting.base.Drafter`), the target runner
(:class:`~dspark_runtime.runners.base.BatchRunner`), the settings
(:class:`~dspark_runtime.decoding.settings.LoopSettings`), the counters (:mod:`dspark_runtime.decoding.stats`).
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from dspark_runtime.decoding.logprobs import MAX_TOP_LOGPROBS, token_logprob
from dspark_runtime.decoding.prefix_cache import concat_blocks, payload_bytes
from dspark_runtime.decoding.request import GenerationStats, PromptShare, Request, Stopper
from dspark_runtime.decoding.sampling import SamplingParams, select_token
from dspark_runtime.decoding.settings import LoopSettings
from dspark_runtime.decoding.stats import BatchStats, RoundMeter, count_verdict, finish_request_stats
from dspark_runtime.decoding.verify_block import Block, accept_block, advance_grammar, build_block, processed_rows
from dspark_runtime.drafting.base import Drafter, Proposal
from dspark_runtime.errors import DSparkError, InputError
from dspark_runtime.runners.base import BatchRunner
from dspark_runtime.scheduling.cost_table import cost_table_at
from dspark_runtime.scheduling.round_cost import round_cost_table
from dspark_runtime.scheduling.draft_skip import DraftSkipRule
from dspark_runtime.scheduling.prefill import plan_prefill
from dspark_runtime.scheduling.prefill import prefill_budget as auto_prefill_budget
from dspark_runtime.scheduling.verify_length import schedule_greedy


class DecodingLoop:
    """The round loop (continuous batching): ``submit`` requests, call ``step`` (one round) until done, or ``run``.

    Args:
        target: the verifier's runner (:func:`dspark_runtime.runners.factory.batch_runner`).
        drafter: a :class:`~dspark_runtime.drafting.base.Drafter`, or None for target-only decoding (every round
            verifies each request's anchor alone).
        settings: the loop's :class:`~dspark_runtime.decoding.settings.LoopSettings` (default: its defaults).
        eos_ids: end-of-sequence ids; decode: ids -> text (stop strings).
        prefix_cache: a :class:`~dspark_runtime.decoding.prefix_cache.PrefixCache` shared across loops, or None: a
            joining request starts from the cached positions of its prompt's longest cached prefix, and a leaving
            one stores its own (the target runner must ``can_import_kv``).
    ``prefill_budget`` is the last round's prompt tokens per round; ``round_trace``: a list to collect each round's
    :class:`~dspark_runtime.decoding.stats.RoundRecord` (None: off).
    """

    def __init__(self, target: BatchRunner, drafter: Drafter | None = None, settings: LoopSettings | None = None, *,
                 eos_ids=(), decode: Callable | None = None, prefix_cache=None):
        self.settings = settings = settings or LoopSettings()
        self.target, self.drafter = target, drafter
        self.eos_ids, self.decode, self.prefix_cache = list(eos_ids), decode, prefix_cache
        self._auto_budget = settings.prefill_budget == "auto" and not target.fixed_call_shapes
        if settings.prefill_budget != "auto":
            self.prefill_budget = settings.prefill_budget
        elif target.fixed_call_shapes:  # a call costs its fixed shape: whole chunks, the same in any batch
            self.prefill_budget = target.max_chunk
        else:  # the reference context's until a round with decoding requests says otherwise
            self.prefill_budget = auto_prefill_budget(settings.cost_table, max_chunk=target.max_chunk)
        self.waiting: list = []
        self.prefilling: list = []  # admitted, prompt being fed (oldest first)
        self.active: list = []  # decoding
        self.stats = BatchStats()
        self.skip = DraftSkipRule(observed=settings.mode == "fixed", prior=settings.skip_prior)
        self.round_trace: list | None = None
        self._next_id = 0

    # the settings, read-only
    mode = property(lambda self: self.settings.mode)
    cost_table = property(lambda self: self.settings.cost_table)
    max_batch = property(lambda self: self.settings.max_batch)
    draft_skip = property(lambda self: self.settings.draft_skip)
    default_gamma = property(lambda self: self.settings.default_gamma)
    default_adaptive = property(lambda self: self.settings.default_adaptive)

    def submit(self, prompt: list, *, max_new_tokens: int = 128, params: SamplingParams | None = None,
               gamma: int | None = None, adaptive: bool | None = None, seed: int | None = None,
               stop: list | None = None, on_tokens: Callable | None = None, logprobs: int | None = None,
               grammar=None, share: PromptShare | None = None) -> Request:
        """Queue a request (prompt: token ids). It joins at the next round with a free slot.

        gamma: its draft-length cap (the first one with ``adaptive``; default ``default_gamma``); adaptive: the
        heuristic schedule (default ``default_adaptive``); seed: its sampling RNG; stop: strings that
        end it; on_tokens(new_ids): called with every batch of committed tokens; logprobs: None, or how many
        alternatives (0..20) each committed token's log-probability lists (``Request.token_logprobs``); grammar: a
        :class:`~dspark_runtime.decoding.grammar.Grammar` at its start state (masks the target's distribution;
        forced tokens are verified as free drafts); share: see :meth:`submit_choices`.
        Raises InputError for an empty prompt, max_new_tokens < 1, gamma < 1 or logprobs outside 0..20."""
        if not prompt:
            raise InputError("the prompt has no tokens")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        gamma = self.default_gamma if gamma is None else gamma
        adaptive = self.default_adaptive if adaptive is None else adaptive
        if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
            raise InputError(f"gamma must be a positive integer, got {gamma!r}")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise InputError(f"logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}] (the alternatives "
                             f"listed per token), got {logprobs!r}")
        params = params or SamplingParams()
        params.validate()
        req = Request(rid=self._next_id, prompt=list(prompt), max_new_tokens=max_new_tokens, params=params,
                      gamma=gamma, rng=np.random.default_rng(seed),
                      stopper=Stopper(self.eos_ids, max_new_tokens, stop or [], self.decode),
                      on_tokens=on_tokens, adaptive=bool(adaptive), t_submit=time.perf_counter(),
                      logprobs=logprobs, grammar=grammar, share=share, seeded=seed is not None)
        req.stats = GenerationStats(prompt_tokens=len(prompt),
                                    drafter=self.drafter.name if self.drafter is not None else "none")
        if grammar is not None:
            self.stats.constrained_requests += 1
        self._next_id += 1
        self.waiting.append(req)
        return req

    def submit_choices(self, prompt: list, n: int, *, seed: int | None = None, grammars: list | None = None,
                       on_choice_tokens: Callable | None = None, **kw) -> list:
        """Queue ``n`` choices of one request (the OpenAI ``n``): the prompt is prefilled once, by the first choice,
        and the others import its cached positions (:class:`~dspark_runtime.decoding.request.PromptShare`; on a
        runner that cannot import positions each prefills its own). Choice i samples with seed
        ``(seed + i) mod 2**64`` (random without a seed) and ``grammars[i]`` (each its own state);
        ``on_choice_tokens(i, new_ids)`` streams choice i. Other arguments as :meth:`submit`. Returns the n requests in order; choices beyond the free batch slots wait in the queue.
        Raises InputError for n < 1 and what :meth:`submit` raises."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InputError(f"n must be a positive integer, got {n!r}")
        grammars = grammars if grammars is not None else [None] * n
        seeds = [None if seed is None else (seed + i) % 2 ** 64 for i in range(n)]
        share = None
        if n > 1 and self.target.can_import_kv:
            share = PromptShare(leader=None)
        def stream(i):
            return None if on_choice_tokens is None else (lambda ids: on_choice_tokens(i, ids))

        reqs = [self.submit(prompt, seed=seeds[i], grammar=grammars[i], share=share, on_tokens=stream(i), **kw)
                for i in range(n)]
        if share is not None:
            share.leader, share.followers = reqs[0], list(reqs[1:])
        return reqs

    def cancel(self, req: Request) -> None:
        """Stop a request (e.g. its client went away): it leaves at once, its slots are freed."""
        if req in self.waiting:
            self.waiting.remove(req)
            self._release_share(req)
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

    def step(self) -> list:
        """One round (see the module docstring). Returns the requests that finished in it (a prompt fed to its end
        can finish at once: EOS, a stop string, one token)."""
        meter = RoundMeter(self.stats)
        admitted = self._admit_waiting()
        reqs = list(self.active)
        if not reqs and not self.prefilling:
            meter.idle()
            return []
        caps = [max(1, min(r.gamma, r.max_new_tokens - len(r.out))) for r in reqs]
        table = cost_table_at(self.cost_table, self.target.attended_positions([r.rid for r in reqs])) if reqs else None
        props, lengths = self._draft(reqs, caps, table, meter)
        blocks = [build_block(r, p, ell, cap, self.eos_ids) for r, p, ell, cap in zip(reqs, props, lengths, caps)]
        self.stats.masked_drafts += sum(b.masked for b in blocks)
        bases = [self.target.length(r.rid) for r in reqs]
        segs = [(r.rid, [r.out[-1]] + b.tokens) for r, b in zip(reqs, blocks)]
        feeding, merged = self._plan_prompt_chunks(segs, table)
        logits, prompt_logits = self._verify(segs, [(r.rid, r.prompt[r.fed:r.fed + c]) for r, c in feeding], merged)
        self.stats.count_round(len(reqs), [c for _, c in feeding])
        finished = []
        for (r, c), lg in zip(feeding, prompt_logits):  # a prompt fed to its end gets its first token
            if self._feed_prompt(r, c, lg):
                finished.append(r)
        for r, b, base, lg in zip(reqs, blocks, bases, logits):
            n, nxt = accept_block(r, b, lg)
            self.target.rollback(r.rid, base + 1 + n)
            self._observe(r, b.drafted, min(n, b.drafted))
            if self._commit(r, b, n, nxt, lg):
                finished.append(r)
        verify_lengths = [len(t) for _, t in segs]
        learn = bool(reqs) and bool(table) and self.drafter is not None and self.draft_skip and not feeding \
            and not admitted
        recorded = segs and (learn or self.round_trace is not None)  # the pass size only where it is read
        meter.end(rows=len(reqs), prompt_chunks=[c for _, c in feeding], verify_lengths=verify_lengths,
                  pass_tokens=int(self.target.pass_rows(verify_lengths)) if recorded else 0, skip=self.skip,
                  trace=self.round_trace, table=table, learn=learn)
        return finished

    # -- joining and leaving

    def _admit_waiting(self) -> bool:
        """Admit waiting requests while there is room (``max_batch``), oldest first; a choice that shares its
        prompt's prefill waits until that prompt is cached (:meth:`submit_choices`). Whether any joined."""
        admitted, i = False, 0
        while i < len(self.waiting) and len(self.active) + len(self.prefilling) < self.max_batch:
            req = self.waiting[i]
            share = req.share
            if share is not None and req is not share.leader:
                if share.payload is None:
                    i += 1  # its prompt is not cached yet
                    continue
                self.waiting.pop(i)
                self._admit_follower(req)
            else:
                self.waiting.pop(i)
                self._admit(req)
            admitted = True
        return admitted

    def _admit_follower(self, req: Request) -> None:
        """Give a choice its verifier row filled with the shared prompt's positions and draw its first token from the
        prompt's last logits (its own RNG and grammar); it decodes from this round on."""
        share = req.share
        self.target.add(req.rid)
        kv, feats = share.payload
        self.target.import_kv(req.rid, kv, feats)
        req.fed = len(req.prompt)
        share.followers.remove(req)
        logits = share.logits
        if not share.followers:
            share.payload = share.logits = None
        req.share = None
        self.prefilling.append(req)
        self._first_token(req, logits)

    def _share_prompt(self, req: Request, logits: np.ndarray) -> None:
        """``req`` leads choices that wait for its prompt: keep its cached prompt positions and last logits for them."""
        share = req.share
        req.share = None
        if share is not None and share.followers:
            share.payload = self.target.export_kv(req.rid, 0, len(req.prompt))
            share.logits = np.array(logits, dtype=np.float32)

    def _release_share(self, req: Request) -> None:
        """A leader leaves before its prompt was cached: the choices waiting on it prefill their own prompts."""
        share = req.share
        if share is not None and share.leader is req and share.payload is None:
            for f in share.followers:
                f.share = None
            share.followers = []
        req.share = None

    def _admit(self, req: Request) -> None:
        """Give ``req`` its verifier cache row, filled with its prompt's longest cached prefix when there is a prefix
        cache (never the last prompt token: its logits give the first token); the rest of the prompt is fed from
        this round on."""
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
        """Store the full blocks of ``req``'s cached positions (prompt and committed tokens; the prompt's only where
        prompts run on their own graph, whose entries a later prompt computes alike) in the prefix cache."""
        rid = req.rid

        def export(start: int, end: int) -> tuple:
            payload = self.target.export_kv(rid, start, end)
            return payload, payload_bytes(payload)

        n = self.target.length(rid)
        if self.target.prompts_apart:
            n = min(n, len(req.prompt))
        self.prefix_cache.insert((req.prompt + req.out)[:n], "target", export)

    def _leave(self, req: Request) -> None:
        if self.prefix_cache is not None:
            self._store_prefix(req)
        self._release_share(req)
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
        if req.grammar is not None:
            req.stats.grammar_masks = req.grammar.masks_computed
            req.stats.grammar_mask_ms = req.grammar.mask_seconds * 1e3
        finish_request_stats(req, self.drafter.source_stats(req.rid) if self.drafter is not None else None)
        self._leave(req)

    # -- the round's parts

    def _draft(self, reqs: list, caps: list, table: dict | None, meter: RoundMeter) -> tuple:
        """The drafting pass and the verify lengths: (proposals, l_r) per decoding request; empty proposals when
        there is no drafter or the skip rule says the pass does not pay. A request whose grammar forces its next
        tokens is not drafted for (they are verified instead,
        :func:`~dspark_runtime.decoding.verify_block.build_block`); a round of only such requests runs
        no drafting pass."""
        self.skip.last_expected = None
        if not reqs:
            return [], []
        forced = {r.rid for r in reqs if r.grammar is not None and r.grammar.forced(1)}
        if self.drafter is None or len(forced) == len(reqs) or not self._drafting_pays(reqs, caps, table):
            if self.drafter is not None:
                self.skip.skipped()
                self.stats.draft_skipped += len(forced) < len(reqs)
            return [Proposal([])] * len(reqs), [0] * len(reqs)
        only = {r.rid for r in reqs} - forced if forced else None
        steady = not forced and self.skip.undrafted == 0 and all(r.last_survival is not None for r in reqs)
        props = meter.draft(lambda: self.drafter.propose_batch(reqs, caps, only=only),
                            probe=self.draft_skip and bool(table) and self.skip.probing, steady=steady)
        for r in reqs:
            r.stats.draft_ms += 1e3 * meter.draft_s
        if steady:  # every request drafted last round too: no catch-up of skipped tokens in this timing
            self.skip.record_draft_time(len(reqs), meter.draft_s)
        lengths = self._lengths(reqs, props, caps, table)
        self.skip.drafted()
        if not self.skip.observed:
            for r, p in zip(reqs, props):
                if p.survival is not None and len(p.survival):
                    r.last_survival = np.asarray(p.survival, dtype=np.float64)
        return props, lengths

    def _drafting_pays(self, reqs: list, caps: list, table: dict | None) -> bool:
        """Whether this round runs the drafting pass: :meth:`DraftSkipRule.pays` over each request's survivals of
        earlier rounds and the cost table at this round's context; always True with the skip rule off, without a
        table, or for a round with a seeded sampled request (the rule reads measured times, and a sampled request's
        tokens depend on its drafts: its seed must give the same tokens on every run)."""
        if not table or not self.draft_skip or any(r.seeded and not r.params.greedy for r in reqs):
            return True
        return self.skip.pays([r.last_survival for r in reqs], caps, table, pass_tokens=self.target.pass_rows)

    def _lengths(self, reqs: list, props: list, caps: list, table: dict | None) -> list:
        """Each request's verify length: min(drafted, cap) in fixed mode, else Algorithm 1 over the proposals'
        survivals with the cost table at this round's context, costed at the tokens the target's pass really
        computes (``pass_rows``). Raises DSparkError in scheduled mode for a proposal without survivals."""
        if self.mode == "fixed":
            return [min(len(p.tokens), c) for p, c in zip(props, caps)]
        if any(p.tokens and (p.survival is None or len(p.survival) != len(p.tokens)) for p in props):
            raise DSparkError("scheduled verify lengths need calibrated prefix survivals from the drafter "
                              "(the DSpark confidence head)")
        cost = round_cost_table(self.cost_table if table is None else table, len(reqs))
        surv = [p.survival if p.tokens else np.zeros(0) for p in props]  # an undrafted request verifies its anchor
        return schedule_greedy(surv, cost, max_len=caps, pass_tokens=self.target.pass_rows)

    def _plan_prompt_chunks(self, segs: list, table: dict | None) -> tuple:
        """This round's prompt chunks: ([(prefilling request, tokens fed)] for those fed, whether they ride in the
        verify pass). An auto budget is re-read from the cost table at this round's context first."""
        if table and self._auto_budget and self.prefilling:
            self.prefill_budget = auto_prefill_budget(table, max_chunk=self.target.max_chunk)
        plan = plan_prefill([len(r.prompt) - r.fed for r in self.prefilling], [len(t) for _, t in segs],
                            budget=self.prefill_budget, max_chunk=self.target.max_chunk,
                            pass_rows=self.target.pass_rows)
        return [(r, c) for r, c in zip(self.prefilling, plan.chunks) if c], plan.merged

    def _verify(self, segs: list, psegs: list, merged: bool) -> tuple:
        """The round's verifier work: the verify ``segs`` and the prompt chunks ``psegs`` ((rid, token ids) each) in
        one ``target.step`` when ``merged``, else the chunks in a second call. Returns (logits per verify segment,
        logits per prompt chunk): float32 [q, vocab] each, or int64 [q] argmax ids for a greedy request where the
        runner takes the argmax on the device, and a prompt chunk's last position's only where it takes
        ``last_only``; counts the calls and the seconds spent on prompt tokens."""
        st = self.stats
        ptoks, dtoks = sum(len(t) for _, t in psegs), sum(len(t) for _, t in segs)
        kw = {}
        if self.target.step_hints:  # compute / copy back only what this round reads
            kw = {"argmax_for": {r.rid for r in self.active + self.prefilling if r.argmax_only},
                  "last_only": {rid for rid, _ in psegs}}
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

    def _feed_prompt(self, req: Request, chunk: int, logits: np.ndarray) -> bool:
        """``chunk`` more prompt tokens of ``req`` are cached; at the prompt's end its first token x0 comes from the
        last position's ``logits``. Returns whether it finished at once."""
        req.fed += chunk
        if req.fed < len(req.prompt):
            return False
        if req.share is not None:
            self._share_prompt(req, logits[-1])
        self._first_token(req, logits[-1])
        return req.done

    def _first_token(self, req: Request, logits: np.ndarray) -> None:
        """``req``'s prompt is in the cache: pick its first token x0 from the last prompt position's ``logits``
        (float32 [vocab]); it decodes from the next round (or finishes at once: EOS, a stop string, one token)."""
        self.prefilling.remove(req)
        if np.ndim(logits) == 0:  # the argmax, taken on the device (argmax_only)
            req.out = [int(logits)]
        else:
            masks = None if req.grammar is None else [req.grammar.allowed()]
            row = processed_rows(req, logits[None], [], masks)[0]
            req.out = [select_token(row, req.params, req.rng)]
            if req.logprobs is not None:
                req.token_logprobs.append(token_logprob(logits, req.out[0], req.logprobs))
            advance_grammar(req, req.out, self.eos_ids)
        req.t_first = time.perf_counter()
        req.stats.ttft_ms = (req.t_first - req.t_submit) * 1e3
        self.stats.count_first_token(req)
        req.keep, reason = req.stopper.check(req.out, 0)
        if req.on_tokens:
            req.on_tokens(req.out[: req.keep])
        self.active.append(req)
        if reason is not None:
            self._finish(req, reason)
        elif self.drafter is not None:
            self.drafter.begin(req)

    def _observe(self, req: Request, ell: int, n: int) -> None:
        """The drafter and, with observed survivals, the skip rule learn from the verdict (``n`` of ``ell``)."""
        if self.drafter is not None:
            self.drafter.observe(req.rid, ell, n)
        if self.skip.observed and ell:
            req.last_survival = self.skip.record_verdict(req.last_survival, ell, n)

    def _commit(self, req: Request, blk: Block, n: int, nxt: int, logits: np.ndarray) -> bool:
        """Append the round's committed tokens (the block's ``n`` accepted ones and ``nxt``, the correction or bonus),
        with their logprobs from the raw ``logits`` rows when asked for; count the drafter's verdict and the forced
        tokens, move an adaptive γ and the grammar, check the stop rule and stream. Returns whether ``req``
        finished."""
        tokens = blk.tokens[:n] + [nxt]
        if req.logprobs is not None:
            req.token_logprobs += [token_logprob(logits[j], t, req.logprobs) for j, t in enumerate(tokens)]
        advance_grammar(req, tokens, self.eos_ids, len(blk.tokens), n)
        forced = max(0, min(n, len(blk.tokens)) - blk.drafted)
        req.stats.forced_tokens += forced
        self.stats.forced_tokens += forced
        before = len(req.out)
        req.out += tokens
        ell, n = blk.drafted, min(n, blk.drafted)
        count_verdict(self.stats, req, ell, n)
        req.adapt_gamma(ell, n)
        req.keep, reason = req.stopper.check(req.out, before)
        if req.on_tokens:
            req.on_tokens(req.out[before: req.keep])
        if reason is None:
            return False
        self._finish(req, reason)
        return True
