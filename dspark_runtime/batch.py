"""Batched speculative decoding: several requests per round, one verifier pass for all of them.

One round (docs/design.md section 1 steps 1-5; DSpark paper section 4 and Algorithm 1)::

    admit waiting requests (prefill each, pick its first token x0)       # requests join between rounds
    proposals = drafter.propose_batch(active)                            # one drafter pass for all rows
    l_r       = verify lengths: fixed γ | static threshold | scheduler   # scheduler: Algorithm 1 over all
    logits    = target.step([(r, [anchor_r] + drafts_r[:l_r]) for r])   # ONE packed verifier pass
    per request: accept (greedy / rejection sampling with its own RNG), roll back, commit, stop checks
    finished requests leave (their KV slots are freed)

The verifier runs the requests packed end to end (:mod:`dspark_runtime.packed`), so a round costs
``B = sum_r (1 + l_r)`` token positions — the quantity the cost table and the scheduler reason about.
Each request owns its RNG (``seed``), so a sampled request gives the same tokens whatever else shares
its batch; greedy output of each request equals decoding it alone, target-only.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from dspark_runtime.acceptance import greedy_accept, rejection_accept
from dspark_runtime.errors import DSparkError, InputError
from dspark_runtime.generate import GenerationStats, Stopper, ngram_lookup, select_token
from dspark_runtime.packed import PackedRunner
from dspark_runtime.sampling import SamplingParams, process_logits, sample


@dataclass
class Proposal:
    """One request's draft for a round: tokens (list[int], l <= γ), q (float [l, vocab] processed draft
    distributions, or None for greedy / point-mass proposals), survival (float64 [l'] calibrated prefix
    survivals a_1..a_l' of the drafted positions, or None when the drafter has no confidence head)."""

    tokens: list
    q: np.ndarray | None = None
    survival: np.ndarray | None = None


@dataclass
class BatchRequest:
    """A request in the batched runtime. ``out`` holds its committed tokens; when ``finish_reason`` is set
    it is done. ``stats`` is filled as it decodes (times in ms from its submission; ``tokens_per_second`` is
    its own decode rate: new tokens after the first / its decode wall time, while sharing the batch)."""

    rid: int
    prompt: list
    max_new_tokens: int
    params: SamplingParams
    gamma: int
    rng: np.random.Generator
    stopper: Stopper
    on_tokens: Callable | None = None
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
class BatchStats:
    """Aggregate metrics of a batched run.

    rounds: verifier passes; prefill_s: seconds spent prefilling joining requests (inside wall_s);
    decode_tokens_per_second: committed tokens / (wall_s - prefill_s); verify_tokens: tokens verified in all rounds (anchors + drafts), i.e. sum of B;
    proposed/accepted: draft tokens verified / accepted; wasted: verified draft tokens the target rejected;
    committed: tokens committed by rounds (bonus included); batch_histogram: rounds by number of requests;
    verify_length_histogram: request-rounds by verify length l_r; accepted_by_position[k]: fraction of
    request-rounds verifying position k+1 that accepted it; wall_s: seconds inside ``step``;
    tokens_per_second: committed tokens / wall_s (aggregate, prefill time included).
    """

    rounds: int = 0
    verify_tokens: int = 0
    proposed: int = 0
    accepted: int = 0
    wasted: int = 0
    committed: int = 0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    wall_s: float = 0.0
    batch_histogram: dict = field(default_factory=dict)
    verify_length_histogram: dict = field(default_factory=dict)
    accepted_by_position: list = field(default_factory=list)
    tokens_per_second: float = 0.0
    decode_tokens_per_second: float = 0.0
    accepted_length_mean: float = 0.0

    def to_json(self) -> dict:
        return dict(self.__dict__)


# ---------------------------------------------------------------------------------------- drafters


class BatchedNgram:
    """Prompt lookup for every request (no weights); point-mass proposals."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def begin(self, req: BatchRequest) -> None:
        pass

    def remove(self, rid) -> None:
        pass

    def propose_batch(self, reqs: list, gammas: list) -> list:
        return [Proposal(ngram_lookup(np.asarray(r.prompt + r.out, dtype=np.int64), g, self.max_ngram,
                                      self.min_ngram)) for r, g in zip(reqs, gammas)]


class BatchedLM:
    """A standalone draft LM for every request, packed like the verifier: each of the γ draft steps is one
    graph call over all requests still drafting (``confidence_threshold`` ends a request's block after its
    first draft token below it, as :class:`dspark_runtime.generate.LMDrafter`)."""

    name = "lm"

    def __init__(self, runner: PackedRunner, confidence_threshold: float | None = None):
        self.runner = runner
        self.confidence_threshold = confidence_threshold
        self._cached: dict = {}
        self._known: dict = {}

    def begin(self, req: BatchRequest) -> None:
        self.runner.add(req.rid)
        self._cached[req.rid], self._known[req.rid] = [], 0
        if len(req.prompt) > 1:
            self.runner.prefill(req.rid, req.prompt[:-1])
            self._cached[req.rid] = list(req.prompt[:-1])

    def remove(self, rid) -> None:
        self.runner.remove(rid)
        self._cached.pop(rid, None)
        self._known.pop(rid, None)

    def _sync(self, rid, context: list) -> list:
        cached = self._cached[rid]
        m = min(len(cached), len(context))
        n = min(self._known[rid], m)
        while n < m and cached[n] == context[n]:
            n += 1
        self.runner.rollback(rid, n)
        self._cached[rid] = cached[:n]
        self._known[rid] = len(context)
        return context[n:]

    def propose_batch(self, reqs: list, gammas: list) -> list:
        pending = {r.rid: self._sync(r.rid, r.prompt + r.out) for r in reqs}
        toks = {r.rid: [] for r in reqs}
        qs = {r.rid: [] for r in reqs}
        live = [r for r, g in zip(reqs, gammas) if g > 0]
        gam = {r.rid: g for r, g in zip(reqs, gammas)}
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
                k = len(toks[r.rid])
                stop = k >= gam[r.rid]
                if not stop and self.confidence_threshold is not None:
                    z = logits - logits.max()
                    stop = 1.0 / np.exp(z, dtype=np.float64).sum() < self.confidence_threshold
                if not stop:
                    nxt.append(r)
            live = nxt
        return [Proposal(toks[r.rid], np.stack(qs[r.rid]) if qs[r.rid] else None) for r in reqs]


class BatchedDSpark:
    """The DSpark drafter for every request: one ``dspark_draft`` graph call per round with one row per
    request (block = anchor + γ-1 mask tokens; rows padded to the longest new context, padding masked), then
    the numpy Markov/confidence heads per row.

    The context K/V is a [R, kv_heads, S, head_dim] array per drafter layer with a validity mask [R, S]:
    rows join (zero row, nothing valid) and leave (row deleted) between rounds; each call appends the
    newly committed positions' target features; invalid (padding) slots are gathered away when they
    exceed a quarter of the array. The context only holds committed positions, so it never rolls back.
    """

    name = "dspark"

    def __init__(self, graph, heads, target: PackedRunner, confidence_threshold: float | None = None):
        self.graph, self.heads, self.target = graph, heads, target
        self.block_size = graph.block_size
        self.confidence_threshold = confidence_threshold
        self.rows: list = []
        self._kv = graph.empty_kv(0)
        self._valid = np.zeros((0, 0), dtype=bool)
        self._ctx: dict = {}

    def begin(self, req: BatchRequest) -> None:
        if self.target.features(req.rid) is None:
            raise DSparkError("the target graph outputs no features; rebuild the engine with the drafter's "
                              "target_layer_ids as target feature layers")
        self.rows.append(req.rid)
        self._ctx[req.rid] = 0
        self._kv = [(np.concatenate([k, self._zero_row(k)]), np.concatenate([v, self._zero_row(v)]))
                    for k, v in self._kv]
        self._valid = np.concatenate([self._valid, np.zeros((1, self._valid.shape[1]), dtype=bool)])

    @staticmethod
    def _zero_row(a: np.ndarray) -> np.ndarray:
        return np.zeros((1,) + a.shape[1:], dtype=a.dtype)

    def remove(self, rid) -> None:
        if rid not in self._ctx:
            return
        i = self.rows.index(rid)
        self.rows.pop(i)
        self._ctx.pop(rid)
        self._kv = [(np.delete(k, i, axis=0), np.delete(v, i, axis=0)) for k, v in self._kv]
        self._valid = np.delete(self._valid, i, axis=0)

    def _compact(self) -> None:
        S = self._valid.shape[1]
        counts = self._valid.sum(axis=1)
        keep = int(counts.max()) if counts.size else 0
        if S - keep < max(64, S // 4):
            return
        R = len(self.rows)
        new_kv = []
        for k, v in self._kv:
            nk = np.zeros(k.shape[:2] + (keep,) + k.shape[3:], dtype=k.dtype)
            nv = np.zeros_like(nk)
            for r in range(R):
                idx = np.flatnonzero(self._valid[r])
                nk[r, :, : idx.size] = k[r][:, idx]
                nv[r, :, : idx.size] = v[r][:, idx]
            new_kv.append((nk, nv))
        self._kv = new_kv
        self._valid = np.arange(keep)[None, :] < counts[:, None]

    def propose_batch(self, reqs: list, gammas: list, only=None) -> list:
        """One drafting pass for every active request (``reqs``, all of them, with their γ caps); the
        Markov/confidence heads run only for the requests in ``only`` (a set of rids; None = all), the others
        get an empty Proposal and their random generators are not touched (the router decides some rows'
        proposals without DSpark). Returns list[Proposal] in the order of ``reqs``."""
        if sorted(r.rid for r in reqs) != sorted(self.rows):
            raise DSparkError("batched DSpark drafter: every active request must propose each round")
        order = {rid: i for i, rid in enumerate(self.rows)}
        reqs_rows = sorted(zip(reqs, gammas), key=lambda rg: order[rg[0].rid])
        g = self.block_size
        R = len(reqs_rows)
        news = []
        for r, _ in reqs_rows:
            anchor_pos = len(r.prompt) + len(r.out) - 1
            if self.target.length(r.rid) != anchor_pos:
                raise DSparkError(f"DSpark drafter out of sync for request {r.rid}: target holds "
                                  f"{self.target.length(r.rid)} positions, anchor at {anchor_pos}")
            news.append((self._ctx[r.rid], anchor_pos))
        n_new = max(b - a for a, b in news)
        fdim = self.graph.spec.inputs[0].shape[-1]
        feats = np.zeros((R, n_new, fdim), dtype=np.float32)
        fpos = np.zeros((R, n_new), dtype=np.int64)
        new_valid = np.zeros((R, n_new), dtype=bool)
        bpos = np.zeros((R, g), dtype=np.int64)
        anchors = np.zeros((R, 1), dtype=np.int64)
        for i, ((r, _), (a, b)) in enumerate(zip(reqs_rows, news)):
            feats[i, : b - a] = self.target.features(r.rid)[a:b]
            fpos[i, : b - a] = np.arange(a, b)
            new_valid[i, : b - a] = True
            bpos[i] = np.arange(b, b + g)
            anchors[i, 0] = r.out[-1]
        ctx_valid = np.concatenate([self._valid, new_valid], axis=1)
        mask = np.concatenate([ctx_valid, np.ones((R, g), dtype=bool)], axis=1)
        mask = np.broadcast_to(mask[:, None, None, :], (R, 1, g, mask.shape[1]))
        hidden, base, self._kv = self.graph.run(feats, fpos, anchors, bpos, np.ascontiguousarray(mask), self._kv)
        self._valid = ctx_valid
        for (r, _), (a, b) in zip(reqs_rows, news):
            self._ctx[r.rid] = b
        self._compact()
        props = {}
        for i, (r, gam) in enumerate(reqs_rows):
            if only is not None and r.rid not in only:
                props[r.rid] = Proposal([])
                continue
            toks, qs, surv, _ = self.heads.draft(base[i], hidden[i], int(anchors[i, 0]), max(0, min(gam, g)),
                                                     r.params, r.rng, self.confidence_threshold)
            props[r.rid] = Proposal(toks, np.stack(qs) if qs else None,
                                    np.asarray(surv[: len(toks)]) if self.heads.conf_w is not None else None)
        return [props[r.rid] for r in reqs]


class BatchedRouter:
    """The context-aware router (:mod:`dspark_runtime.router`, issue 9) for every request of a batch: per
    request and round, the n-gram prompt-lookup continuation or the DSpark block, whichever has the larger
    expected accepted length (sum of prefix survivals). Survivals: n-gram from per-request
    :class:`~dspark_runtime.router.NgramConfidence` (the manifest's fitted priors, updated by the request's
    own verdicts), DSpark from its calibrated confidence head times the request's recalibration factor
    rho = (accepted + k) / (predicted + k). The batch's verify lengths are then set by the generator (fixed γ,
    or the scheduler over every request's chosen survivals: Algorithm 1), so a chosen n-gram proposal may run
    up to ``ngram_max_length`` tokens when scheduled.

    One DSpark pass serves all rows that need it and is skipped when none does: greedy, a row whose n-gram
    proposal expects >= ``skip_ratio`` x DSpark's fitted expected length is decided without drafting; when
    sampling, every row decides before drafting (from its context and past rounds only), and DSpark's heads
    -- and random draws -- run only for the rows that chose it, so each request's tokens are those it would
    get alone (lossless; the same rule as :class:`~dspark_runtime.router.RouterDrafter`).

    Args:
        inner: a :class:`BatchedDSpark` with a confidence head.
        priors: ``router.router_priors`` output ({"confidence", "inner_stats"}, either may be missing); every
            request starts from a copy.
        skip_ratio, ngram_max_length, max_ngram, recalibration_strength: as RouterDrafter.
    """

    name = "router"

    def __init__(self, inner: "BatchedDSpark", priors: dict | None = None, *, skip_ratio: float | None = 2.0,
                 ngram_max_length: int = 16, max_ngram: int = 3, recalibration_strength: float = 2.0):
        if getattr(inner.heads, "conf_w", None) is None:
            raise InputError("the batched router needs a DSpark drafter with a confidence head")
        self.inner, self.block_size = inner, inner.block_size
        self.priors = dict(priors or {})
        self.skip_ratio, self.ngram_max_length = skip_ratio, int(ngram_max_length)
        self.max_ngram, self.k = max_ngram, float(recalibration_strength)
        self._rows: dict = {}

    def begin(self, req: BatchRequest) -> None:
        import copy

        from dspark_runtime.router import AcceptanceStats, NgramConfidence

        self.inner.begin(req)
        conf = copy.deepcopy(self.priors.get("confidence")) or NgramConfidence()
        inner_stats = copy.deepcopy(self.priors.get("inner_stats")) or AcceptanceStats((0.5,))
        conf.reset()
        inner_stats.reset()
        self._rows[req.rid] = {"conf": conf, "inner": inner_stats, "pred": 0.0, "real": 0, "last": None,
                               "sources": {s: {"rounds": 0, "proposed": 0, "accepted": 0}
                                           for s in ("ngram", "dspark")}}

    def remove(self, rid) -> None:
        self.inner.remove(rid)
        self._rows.pop(rid, None)

    def source_stats(self, rid) -> dict:
        """{source: {rounds, proposed, accepted}} of request ``rid`` ({} once it has left)."""
        return self._rows[rid]["sources"] if rid in self._rows else {}

    def propose_batch(self, reqs: list, gammas: list) -> list:
        from dspark_runtime.router import ngram_match

        out, plan, need = {}, {}, set()
        for r, g in zip(reqs, gammas):
            st = self._rows[r.rid]
            m = ngram_match(np.asarray(r.prompt + r.out, dtype=np.int64), g, self.max_ngram)
            surv_ng = st["conf"].estimate(m) if m.length else np.zeros(0)
            prior = st["inner"].survival(0, min(g, self.block_size))
            e_ng, e_prior = float(np.sum(surv_ng)), float(np.sum(prior))
            if m.length and r.params.greedy:
                decided = self.skip_ratio is not None and e_ng >= self.skip_ratio * e_prior
                choice = "ngram" if decided else None  # None: draft, then compare
            elif m.length:  # sampling: decide before drafting
                choice = "ngram" if e_ng >= e_prior else "dspark"
            else:
                choice = "dspark"
            plan[r.rid] = (choice, m, surv_ng, e_ng)
            if choice != "ngram":
                need.add(r.rid)
        drafted = {}
        if need:
            for r, p in zip(reqs, self.inner.propose_batch(reqs, [min(g, self.block_size) for g in gammas],
                                                           only=need)):
                drafted[r.rid] = p
        for r in reqs:
            choice, m, surv_ng, e_ng = plan[r.rid]
            st = self._rows[r.rid]
            if choice is None:  # greedy: compare with this round's calibrated, recalibrated DSpark survival
                rho = (st["real"] + self.k) / (st["pred"] + self.k)
                e_ds = float(np.sum(np.minimum(1.0, rho * drafted[r.rid].survival)))
                choice = "ngram" if e_ng >= e_ds else "dspark"
            if choice == "ngram":
                prop = Proposal(list(m.tokens), None, np.asarray(surv_ng, dtype=np.float64))
            else:
                prop = drafted[r.rid]
            st["last"] = (choice, m, prop.survival)
            st["sources"][choice]["rounds"] += 1
            out[r.rid] = prop
        return [out[r.rid] for r in reqs]

    def observe(self, rid, sent: int, accepted: int) -> None:
        """The target accepted ``accepted`` of the ``sent`` tokens verified for request ``rid`` this round."""
        st = self._rows.get(rid)
        if st is None or st["last"] is None:
            return
        choice, m, surv = st["last"]
        st["last"] = None
        src = st["sources"][choice]
        src["proposed"] += sent
        src["accepted"] += accepted
        if choice == "ngram":
            st["conf"].record(m, sent, accepted)
        else:
            st["inner"].update(0, sent, accepted)
            st["pred"] += float(np.sum(surv[:sent])) if surv is not None else 0.0
            st["real"] += accepted


# ---------------------------------------------------------------------------------------- the loop


def round_cost_table(table: dict, rows: int):
    """The per-round :class:`CostTable` for ``rows`` requests from a manifest ``cost_table``: t_draft at that
    many rows (``draft_rows``/``t_draft_rows`` when profiled, else the single-row ``t_draft``) plus the
    verifier's t_verify(B). Falls back to the stored ``seconds`` for tables without the split."""
    from dspark_runtime.scheduler import CostTable

    if "t_verify" not in table:
        return CostTable.from_dict(table)
    t_draft = float(table.get("t_draft", 0.0))
    if table.get("draft_rows") and table.get("t_draft_rows"):
        t_draft = float(np.interp(rows, table["draft_rows"], table["t_draft_rows"]))
    return CostTable(tuple(table["tokens"]), tuple(t_draft + t for t in table["t_verify"]))


class BatchedGenerator:
    """Continuous batching over one engine: ``submit`` requests, call ``step`` (one round) until done.

    Args:
        target: a :class:`PackedRunner` over the verifier graph.
        drafter: a batched drafter (:class:`BatchedDSpark`, :class:`BatchedRouter`, :class:`BatchedLM`,
            :class:`BatchedNgram`) or
            None for target-only decoding (every round verifies each request's anchor alone).
        eos_ids: end-of-sequence ids; decode: ids -> text (stop strings).
        mode: "fixed" (verify min(γ, drafted) tokens), "scheduled" (paper Algorithm 1 over all requests'
            calibrated prefix survivals and ``cost_table``; needs a drafter with a confidence head).
            A static threshold is the drafter's ``confidence_threshold``.
        cost_table: the manifest's ``speculation.cost_table`` dict (for "scheduled").
        max_batch: most requests decoding at once; more wait in the queue and join between rounds.
    Raises InputError for an unknown mode or a missing cost table.
    """

    def __init__(self, target: PackedRunner, drafter=None, *, eos_ids=(), decode: Callable | None = None,
                 mode: str = "fixed", cost_table: dict | None = None, max_batch: int = 8):
        if mode not in ("fixed", "scheduled"):
            raise InputError(f"unknown verify-length mode {mode!r}: use 'fixed' or 'scheduled'")
        if mode == "scheduled" and not cost_table:
            raise InputError("scheduled verify lengths need the engine's cost table; run `dspark-export profile`")
        if not isinstance(max_batch, int) or max_batch < 1:
            raise InputError(f"max_batch must be a positive integer, got {max_batch!r}")
        self.target, self.drafter = target, drafter
        self._observe = getattr(drafter, "observe", None)  # the router learns from each round's verdicts
        self.eos_ids, self.decode = list(eos_ids), decode
        self.mode, self.cost_table, self.max_batch = mode, cost_table, max_batch
        self.waiting: list = []
        self.active: list = []
        self.stats = BatchStats()
        self._pos_hits: Counter = Counter()
        self._pos_tries: Counter = Counter()
        self._vlen: Counter = Counter()
        self._bhist: Counter = Counter()
        self._next_id = 0

    def submit(self, prompt: list, *, max_new_tokens: int = 128, params: SamplingParams | None = None,
               gamma: int = 5, seed: int | None = None, stop: list | None = None,
               on_tokens: Callable | None = None) -> BatchRequest:
        """Queue a request (prompt: token ids). It joins at the next round with a free slot.

        Raises InputError for an empty prompt, max_new_tokens < 1 or gamma < 1."""
        if not prompt:
            raise InputError("the prompt has no tokens")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if not isinstance(gamma, int) or gamma < 1:
            raise InputError(f"gamma must be a positive integer, got {gamma!r}")
        params = params or SamplingParams()
        params.validate()
        req = BatchRequest(rid=self._next_id, prompt=list(prompt), max_new_tokens=max_new_tokens, params=params,
                           gamma=gamma, rng=np.random.default_rng(seed),
                           stopper=Stopper(self.eos_ids, max_new_tokens, stop or [], self.decode),
                           on_tokens=on_tokens, t_submit=time.perf_counter())
        req.stats = GenerationStats(prompt_tokens=len(prompt), drafter=getattr(self.drafter, "name", "none"))
        self._next_id += 1
        self.waiting.append(req)
        return req

    def cancel(self, req: BatchRequest) -> None:
        """Stop a request (e.g. its client went away): it leaves at once, its slots are freed."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.active:
            self._leave(req)
        if req.finish_reason is None:
            req.finish_reason = "cancelled"

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active)

    def run(self) -> None:
        """Step until every submitted request is done."""
        while self.busy:
            self.step()

    def _admit(self, req: BatchRequest) -> None:
        t0 = time.perf_counter()
        self.target.add(req.rid)
        logits = self.target.prefill(req.rid, req.prompt)
        self.stats.prefill_tokens += len(req.prompt)
        req.out = [select_token(logits, req.params, req.rng)]
        req.t_first = time.perf_counter()
        req.stats.ttft_ms = (req.t_first - req.t_submit) * 1e3
        req.keep, reason = req.stopper.check(req.out, 0)
        if req.on_tokens:
            req.on_tokens(req.out[: req.keep])
        self.active.append(req)
        if reason is not None:
            self._finish(req, reason)
        elif self.drafter is not None:
            self.drafter.begin(req)
        self.stats.prefill_s += time.perf_counter() - t0

    def _leave(self, req: BatchRequest) -> None:
        self.active.remove(req)
        self.target.remove(req.rid)
        if self.drafter is not None:
            self.drafter.remove(req.rid)

    def _finish(self, req: BatchRequest, reason: str) -> None:
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
        if isinstance(self.drafter, BatchedRouter):
            s.draft_sources = {k: dict(v) for k, v in self.drafter.source_stats(req.rid).items()}
        if s.decode_ms > 0:
            s.tokens_per_second = (len(req.out) - 1) / (s.decode_ms / 1e3)
        self._leave(req)

    def _lengths(self, reqs: list, props: list, caps: list) -> list:
        if self.drafter is None:
            return [0] * len(reqs)
        if self.mode == "fixed":
            return [min(len(p.tokens), c) for p, c in zip(props, caps)]
        from dspark_runtime.scheduler import schedule_greedy

        if any(p.survival is None or len(p.survival) != len(p.tokens) for p in props):
            raise DSparkError("scheduled verify lengths need calibrated prefix survivals from the drafter "
                              "(the DSpark confidence head)")
        cost = round_cost_table(self.cost_table, len(reqs))
        return schedule_greedy([p.survival for p in props], cost, max_len=caps)

    def step(self) -> list:
        """One round: admit waiting requests, draft, schedule, verify all requests in one packed pass,
        accept and commit. Returns the requests that finished in this round."""
        t0 = time.perf_counter()
        finished = []
        while self.waiting and len(self.active) < self.max_batch:
            req = self.waiting.pop(0)
            self._admit(req)
            if req.done:
                finished.append(req)
        reqs = list(self.active)
        if not reqs:
            self.stats.wall_s += time.perf_counter() - t0
            return finished
        caps = [max(1, min(r.gamma, r.max_new_tokens - len(r.out))) for r in reqs]
        props = self.drafter.propose_batch(reqs, caps) if self.drafter is not None else [Proposal([])] * len(reqs)
        lengths = self._lengths(reqs, props, caps)
        segs, bases = [], []
        for r, p, ell in zip(reqs, props, lengths):
            bases.append(self.target.length(r.rid))
            segs.append((r.rid, [r.out[-1]] + p.tokens[:ell]))
        logits_all = self.target.step(segs)
        self.stats.rounds += 1
        self._bhist[len(reqs)] += 1
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
            before = len(r.out)
            r.out += p.tokens[:n] + [nxt]
            s = r.stats
            s.num_rounds += 1
            s.proposed += ell
            s.accepted += n
            r.hist[ell] += 1
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
        st.wall_s += time.perf_counter() - t0
        st.batch_histogram = {str(k): v for k, v in sorted(self._bhist.items())}
        st.verify_length_histogram = {str(k): v for k, v in sorted(self._vlen.items())}
        st.accepted_by_position = [self._pos_hits[k] / self._pos_tries[k] for k in sorted(self._pos_tries)]
        st.tokens_per_second = st.committed / st.wall_s if st.wall_s > 0 else 0.0
        dec = st.wall_s - st.prefill_s
        st.decode_tokens_per_second = st.committed / dec if dec > 0 else 0.0
        st.accepted_length_mean = st.committed / sum(self._vlen.values()) if self._vlen else 0.0
        return finished
