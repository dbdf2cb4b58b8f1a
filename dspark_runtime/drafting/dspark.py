"""The DSpark drafter at run time: the ``dspark_draft`` graph plus numpy Markov and confidence heads, driven by the
target's own features (no second target pass). DSpark paper section 3; docs/design.md section 1 steps 1-3.

One round: the target features committed since the last round extend the drafter's context K/V (committed positions
only, never rolled back); one graph call over the block [anchor, mask, ...] gives hidden states h_k and base logits
U_k; left to right, logits_k = U_k + Markov bias(x_{k-1}, h_k) picks x_k (argmax, or a sample kept for rejection
sampling); the confidence head gives c_k, calibrated by the STS temperatures T_k, and the prefix survival
a_j = Π_{k≤j} σ(z_k / T_k). A static threshold cuts the block by one of :data:`THRESHOLD_RULES`
(:meth:`DSparkHeads.draft`); both read the draft's own quantities only, so sampling stays lossless.
A DFlash drafter (DeepSpec's: ``markov_rank`` 0, no confidence head) has neither head: logits_k = U_k, no
survivals, so it drafts whole blocks (``confident`` False: no threshold, no scheduled verify lengths of its own).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from dspark_runtime.backends.ort import OrtDecoder
from dspark_runtime.drafting.base import Drafter, Proposal
from dspark_runtime.drafting.context_kv import ContextKV, anchor_position
from dspark_runtime.drafting.embedding_rows import EmbeddingRows
from dspark_runtime.errors import DSparkError
from dspark_runtime.engine_dir.graphspec import GraphSpec
from dspark_runtime.decoding.sampling import SamplingParams, process_logits, sample

# Static-threshold rules: "survival" (ours) cuts before the first position whose calibrated running product a_j falls
# below P; "deepspec" (DeepSpec's, deepspec/eval/dspark/draft_ops.py _confident_prefix_length) before the first
# position whose own raw confidence σ(z_k) does (P <= 0 keeps the block). The product only falls, so "survival" cuts
# no later than "deepspec" when T_k = 1.
THRESHOLD_RULES = ("survival", "deepspec")
# A drafter graph call's fixed cost, in context positions (session dispatch, feeds, K/V copies): the price of
# splitting one padded call into several (:func:`context_groups`; docs/serving.md, "The drafter's catch-up").
DRAFT_CALL_OVERHEAD = 16


def context_groups(new_counts, block: int, overhead: int = DRAFT_CALL_OVERHEAD) -> list:
    """Split one round's drafting pass into graph calls so that rows of very different new-context lengths are not
    padded to the longest (pure function).

    A call over the rows G computes ``|G| x (max_{r in G} n_r + block)`` drafter positions (every row is padded to
    the longest new context in its call, the padding masked) plus a fixed ``overhead``. A request that has just
    joined brings its whole prompt's features (hundreds of positions), a request that decoded last round one to
    eight, so one call would pad every row to the prompt: R times the drafter work of the new row alone. The
    partition minimising the total is contiguous in the rows sorted by ``n_r`` (descending), found by dynamic
    programming over that order: O(R^2).

    Args:
        new_counts: per row its new context positions this round, ints >= 0 (R of them).
        block: γ, the block positions every row computes.
        overhead: a call's fixed cost in positions (>= 0).
    Returns:
        list of lists of row indices (into ``new_counts``), each list one call; every row in exactly one; the
        calls in order of their longest row, descending; one call holding every row when splitting does not pay.
    Raises ValueError for a negative count or overhead.
    """
    counts = [int(n) for n in new_counts]
    if any(n < 0 for n in counts) or overhead < 0:
        raise ValueError(f"new context counts and the call overhead must be >= 0, got {counts}, {overhead}")
    order = sorted(range(len(counts)), key=lambda i: -counts[i])
    R = len(order)
    if R <= 1:
        return [order] if order else []
    best = [0.0] + [float("inf")] * R  # best[k]: cheapest calls for the first k rows of ``order``
    cut = [0] * (R + 1)
    for k in range(1, R + 1):
        for j in range(k):  # the last call holds order[j:k], padded to order[j]'s count
            c = best[j] + (k - j) * (counts[order[j]] + block) + overhead
            if c < best[k]:
                best[k], cut[k] = c, j
    groups, k = [], R
    while k > 0:
        groups.append(order[cut[k]:k])
        k = cut[k]
    return groups[::-1]


def check_threshold_rule(rule: str) -> str:
    """``rule`` if it names a static-threshold rule; raises DSparkError naming the choices otherwise."""
    if rule not in THRESHOLD_RULES:
        raise DSparkError(f"unknown confidence threshold rule {rule!r}; choose one of {list(THRESHOLD_RULES)} "
                          "('survival': calibrated prefix survival, ours; 'deepspec': each position's own "
                          "confidence, DeepSpec's)")
    return rule


class OrtDSparkGraph(OrtDecoder):
    """Runs a ``dspark_draft`` graph with ONNX Runtime (constructs cheaply, loads on ``activate``; the
    session setup, providers check and ``empty_kv`` are :class:`OrtDecoder`'s).

    ``embedding``: the :class:`EmbeddingRows` the anchor's row is read from (graphs whose spec takes
    ``anchor_embeds``); graphs built before it (input ``anchor_ids``) embed the id themselves."""

    def __init__(self, path: str | Path, spec: GraphSpec, threads: int = 2, providers=None,
                 embedding: EmbeddingRows | None = None, **kw):
        if spec.kind != "dspark_draft":
            raise DSparkError(f"{path}: graph kind {spec.kind!r} is not a DSpark drafter (dspark_draft)")
        super().__init__(path, spec, threads=threads, providers=providers, **kw)
        self.block_size = next(t for t in spec.inputs if t.name == "block_positions").shape[1]
        self.embeds_anchor = any(t.name == "anchor_embeds" for t in spec.inputs)
        self.embedding = embedding

    def run(self, features, feature_positions, anchor_ids, block_positions, attention_mask, kv):
        """One call. features float32 [b, n, F]; feature_positions int64 [b, n]; anchor_ids int64 [b, 1];
        block_positions int64 [b, γ]; attention_mask bool [b, 1, γ, past + n + γ]; kv per layer
        (key, value) [b, kvh, past, hd]. Returns (hidden [b, γ, d], base_logits [b, γ, V_d], present kv).
        Raises DSparkError when the graph takes the anchor's embedding and no table was given."""
        if self.session is None:
            self.activate()
        feeds = {"features": features, "feature_positions": feature_positions,
                 "block_positions": block_positions, "attention_mask": attention_mask}
        if self.embeds_anchor:
            if self.embedding is None:
                raise DSparkError(f"{self.path}: the DSpark drafter graph takes the anchor's embedding row but the "
                                  "manifest names no table (speculation.dspark.embedding); re-run "
                                  "`dspark-export add-draft`")
            feeds["anchor_embeds"] = self.embedding.rows(anchor_ids)
        else:
            feeds["anchor_ids"] = anchor_ids
        outs, present = self.run_with_kv(feeds, kv, 2)
        return outs[0], outs[1], present


class DSparkHeads:
    """Markov head, confidence head and draft-vocabulary map, as numpy arrays (``dspark_heads.npz``).

    Arrays: markov_w1 [V_in, r], markov_w2 [V_out, r] (+ gate_w [r, d+r], gate_b [r] | joint_w [3r, 2r+d],
    joint_b [3r]), conf_w [d (+r)], conf_b [1], draft_vocab_ids int64 [V_d] (reduced vocabulary only).
    """

    def __init__(self, arrays: dict, kind: str | None, with_markov: bool, vocab_size: int,
                 temperatures=None):
        self.kind = kind
        self.w1 = arrays.get("markov_w1")
        self.w2 = arrays.get("markov_w2")
        self.gate_w, self.gate_b = arrays.get("gate_w"), arrays.get("gate_b")
        self.joint_w, self.joint_b = arrays.get("joint_w"), arrays.get("joint_b")
        self.conf_w, self.conf_b = arrays.get("conf_w"), arrays.get("conf_b")
        self.with_markov = with_markov
        self.vocab_size = vocab_size
        self.d2t = arrays.get("draft_vocab_ids")
        if self.d2t is not None:
            self.t2d = np.full(vocab_size, len(self.d2t), dtype=np.int64)
            self.t2d[self.d2t] = np.arange(len(self.d2t))
        else:
            self.t2d = None
        self.temperatures = None if temperatures is None else np.asarray(temperatures, dtype=np.float64)

    @classmethod
    def load(cls, path: Path, info, vocab_size: int, temperatures=None) -> "DSparkHeads":
        """The heads in the ``.npz`` file ``path``, shaped by ``info``: the manifest's
        :class:`~dspark_runtime.engine_dir.manifest.DSparkSection` or a dict of its heads keys (``markov_rank``,
        ``markov_head_type``, ``confidence_head_with_markov``; what ``dspark_export.drafter.graph.write_heads``
        returns). No Markov head when ``markov_rank`` is 0 or absent."""
        get = info.get if isinstance(info, dict) else (lambda k: getattr(info, k, None))
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files}
        return cls(arrays, get("markov_head_type") if get("markov_rank") else None,
                   bool(get("confidence_head_with_markov")), vocab_size, temperatures)

    def w1_row(self, target_id: int) -> int:
        return int(target_id) if self.t2d is None else int(self.t2d[target_id])

    def to_target(self, draft_idx: int) -> int:
        return int(draft_idx) if self.d2t is None else int(self.d2t[draft_idx])

    def step(self, base: np.ndarray, h: np.ndarray, prev_target: int, state):
        """Position logits [V_out] = base + Markov bias, and the confidence pre-sigmoid score.

        Returns (logits float32 [V_out], conf_logit float | None, new_state).
        """
        if self.w1 is None:
            lat, e = None, None
        else:
            e = self.w1[self.w1_row(prev_target)]
            if self.kind == "vanilla":
                lat = e
            elif self.kind == "gated":
                lat = _sigmoid(self.gate_w @ np.concatenate([h, e]) + self.gate_b) * e
            else:
                s = np.zeros_like(e) if state is None else state
                z = self.joint_w @ np.concatenate([s, e, h]) + self.joint_b
                g, cand, o = np.split(z, 3)
                g = _sigmoid(g)
                state = g * s + (1 - g) * np.tanh(cand)
                lat = np.tanh(o)
        logits = base if lat is None else base + self.w2 @ lat
        conf = None
        if self.conf_w is not None:
            x = np.concatenate([h, e]) if self.with_markov else h
            conf = float(self.conf_w @ x + self.conf_b[0])
        return logits, conf, state

    def full_vocab(self, logits: np.ndarray) -> np.ndarray:
        """Draft logits [V_out] -> target-vocabulary logits [V] (-inf outside a reduced draft vocabulary)."""
        if self.d2t is None:
            return logits
        full = np.full(self.vocab_size, -np.inf, dtype=np.float32)
        full[self.d2t] = logits
        return full

    def draft(self, base: np.ndarray, hidden: np.ndarray, anchor: int, n: int, params: SamplingParams, rng,
              threshold: float | None = None, threshold_rule: str = "survival") -> tuple:
        """Draft ``n`` tokens of one block, left to right (docs/design.md section 1 steps 2-3).

        Args:
            base: float32 [γ, V_out] base logits U_k of the block; hidden: float32 [γ, d] normed h_k.
            anchor: the anchor token (x_0); n: tokens to draft (<= γ).
            params, rng: sampling (greedy = argmax; else a sample from the processed distribution).
            threshold: static threshold P; None = no cut.
            threshold_rule: ``"survival"`` (ours): cut before the first position whose calibrated prefix
                survival a_j falls below P; ``"deepspec"`` (DeepSpec's): cut before the first position whose
                own raw confidence σ(z_k) falls below P (P <= 0: no cut). See :data:`THRESHOLD_RULES`.
        Returns:
            (tokens list[int] target ids, qs list of float [V] processed draft distributions (sampling only),
            survival list[float] a_1.. (one per position scored, possibly one past the last token when the
            threshold cut), confidence logits list[float]).
        """
        deepspec = check_threshold_rule(threshold_rule) == "deepspec"
        tokens, qs, surv, confs = [], [], [], []
        prev, state, a = anchor, None, 1.0
        temps = self.temperatures
        for k in range(n):
            logits, conf, state = self.step(base[k], hidden[k], prev, state)
            own = None
            if conf is not None:
                confs.append(conf)
                t = 1.0 if temps is None or k >= len(temps) else float(temps[k])
                a *= float(_sigmoid(conf / t))
                own = float(_sigmoid(conf))
            surv.append(a)
            if threshold is not None:
                if deepspec:
                    if own is not None and threshold > 0.0 and own < threshold:
                        break
                elif a < threshold:
                    break
            if params.greedy:
                tok = self.to_target(int(np.argmax(logits)))
            else:
                q = process_logits(self.full_vocab(logits), params)
                tok = int(sample(q, rng))
                qs.append(q)
            tokens.append(tok)
            prev = tok
        return tokens, qs, surv, confs


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


class DSparkDrafter(Drafter):
    """The DSpark drafter (a :class:`~dspark_runtime.drafting.base.Drafter`) for one request or many: one ``dspark_draft``
    graph call per round with one row per request (block = anchor + γ-1 mask tokens; rows padded to the longest
    new context, padding masked), split into several calls when one row's new context is much longer than the
    others' (a request that has just joined brings its whole prompt; :func:`context_groups`), then the numpy
    Markov/confidence heads per row.

    The context K/V (:class:`~dspark_runtime.drafting.context_kv.ContextKV`, one row per request, padding masked):
    each call appends the target features of the positions committed since the row's last call (all of them after
    rounds the router sent elsewhere). The context only holds committed positions, so it never rolls back.

    Args:
        graph: the drafter graph backend (:class:`OrtDSparkGraph`).
        heads: the Markov/confidence heads (:class:`DSparkHeads`).
        target: the verifier's runner (a :class:`~dspark_runtime.runners.sequence.BatchRunner`: its ``features(rid)`` feed
            the context).
        confidence_threshold: static threshold P; None = always the full length asked for.
        threshold_rule: how P cuts a block (:data:`THRESHOLD_RULES`).

    ``confident``: the heads have a confidence head (proposals carry calibrated survivals). ``record``: set to a
    list to collect (confidence logits float [l], accepted n) per verified round (``dspark-export calibrate``).
    Raises DSparkError (``begin``) when the target graph outputs no features.
    """

    name = "dspark"
    reads_target_features = True

    def __init__(self, graph, heads: DSparkHeads, target, confidence_threshold: float | None = None,
                 threshold_rule: str = "survival"):
        self.graph, self.heads, self.target = graph, heads, target
        self.block_size = graph.block_size
        self.confidence_threshold = confidence_threshold
        self.threshold_rule = check_threshold_rule(threshold_rule)
        self.confident = heads.conf_w is not None
        self.record: list | None = None
        self.context = ContextKV(graph.empty_kv(0))
        self._ctx: dict = {}  # rid -> committed positions already in its context row
        self._conf: dict = {}  # rid -> the last proposal's confidence logits

    def begin(self, req) -> None:
        if self.target.features(req.rid) is None:
            raise DSparkError("the target graph outputs no features; rebuild the engine with the drafter's "
                              "target_layer_ids as target feature layers")
        self.context.add(req.rid)
        self._ctx[req.rid] = 0

    @property
    def rows(self) -> list:
        """The request ids of the context rows, in row order."""
        return self.context.rows

    def remove(self, rid) -> None:
        self.context.remove(rid)
        self._ctx.pop(rid, None)
        self._conf.pop(rid, None)

    def _run_groups(self, reqs_rows: list, news: list) -> tuple:
        """The round's drafter graph calls: the rows (in ``self.rows`` order) split by :func:`context_groups` so no
        row is padded to a much longer new context than its own, each call appending its rows' new context
        positions ``news`` [(first, end)] to their K/V. Returns (hidden [R, γ, d], base [R, γ, V_d], the merged K/V
        per layer [R, kvh, S + max new, hd], validity [R, S + max new])."""
        g = self.block_size
        R = len(reqs_rows)
        fdim = self.graph.spec.inputs[0].shape[-1]
        ctx_kv, ctx_valid_all = self.context.kv, self.context.valid
        S = ctx_valid_all.shape[1]
        n_all = max((b - a for a, b in news), default=0)
        groups = context_groups([b - a for a, b in news], g)
        one = len(groups) == 1  # the steady round: every row in one call, the K/V passed and kept as they are
        if one:
            groups = [list(range(R))]
        else:  # the merged K/V the calls write their rows into
            kv = [(np.zeros(k.shape[:2] + (S + n_all,) + k.shape[3:], dtype=k.dtype),
                   np.zeros(v.shape[:2] + (S + n_all,) + v.shape[3:], dtype=v.dtype)) for k, v in ctx_kv]
            valid = np.zeros((R, S + n_all), dtype=bool)
        hidden = base = None
        for rows in groups:
            idx = np.asarray(rows, dtype=np.int64)
            n_new = max(news[i][1] - news[i][0] for i in rows)
            feats = np.zeros((len(rows), n_new, fdim), dtype=np.float32)
            fpos = np.zeros((len(rows), n_new), dtype=np.int64)
            new_valid = np.zeros((len(rows), n_new), dtype=bool)
            bpos = np.zeros((len(rows), g), dtype=np.int64)
            anchors = np.zeros((len(rows), 1), dtype=np.int64)
            for j, i in enumerate(rows):
                (r, _), (a, b) = reqs_rows[i], news[i]
                feats[j, : b - a] = self.target.features(r.rid)[a:b]
                fpos[j, : b - a] = np.arange(a, b)
                new_valid[j, : b - a] = True
                bpos[j] = np.arange(b, b + g)
                anchors[j, 0] = r.out[-1]
            ctx_valid = np.concatenate([ctx_valid_all if one else ctx_valid_all[idx], new_valid], axis=1)
            mask = np.concatenate([ctx_valid, np.ones((len(rows), g), dtype=bool)], axis=1)
            mask = np.broadcast_to(mask[:, None, None, :], (len(rows), 1, g, mask.shape[1]))
            past = ctx_kv if one else [(k[idx], v[idx]) for k, v in ctx_kv]
            h, u, present = self.graph.run(feats, fpos, anchors, bpos, np.ascontiguousarray(mask), past)
            if one:
                return h, u, present, ctx_valid
            if hidden is None:
                hidden = np.zeros((R,) + h.shape[1:], dtype=h.dtype)
                base = np.zeros((R,) + u.shape[1:], dtype=u.dtype)
            hidden[idx], base[idx] = h, u
            width = S + n_new
            for (k, v), (pk, pv) in zip(kv, present):
                k[idx, :, :width] = pk
                v[idx, :, :width] = pv
            valid[idx, :width] = ctx_valid
        return hidden, base, kv, valid

    def propose_batch(self, reqs: list, gammas: list, only=None) -> list:
        """One drafting pass for every active request (``reqs``: all of them, with their γ caps); the heads run
        only for the requests in ``only`` (None = all). Returns list[Proposal] in the order of ``reqs`` (q None
        when greedy; survival float64 [l] when ``confident``). Raises DSparkError when a request is missing or
        out of sync with the target."""
        if sorted(r.rid for r in reqs) != sorted(self.rows):
            raise DSparkError("DSpark drafter: every active request must propose each round")
        order = {rid: i for i, rid in enumerate(self.rows)}
        reqs_rows = sorted(zip(reqs, gammas), key=lambda rg: order[rg[0].rid])
        g = self.block_size
        if not reqs_rows:
            return []
        news = []
        for r, _ in reqs_rows:
            news.append((self._ctx[r.rid], anchor_position(r, self.target, self._ctx[r.rid], "DSpark drafter")))
        hidden, base, kv, valid = self._run_groups(reqs_rows, news)
        self.context.write(range(len(self.rows)), kv, valid)
        for (r, _), (a, b) in zip(reqs_rows, news):
            self._ctx[r.rid] = b
        self.context.compact()
        props = {}
        for i, (r, gam) in enumerate(reqs_rows):
            if only is not None and r.rid not in only:
                props[r.rid] = Proposal([])
                continue
            toks, qs, surv, confs = self.heads.draft(base[i], hidden[i], int(r.out[-1]), max(0, min(gam, g)),
                                                     r.params, r.rng, self.confidence_threshold, self.threshold_rule)
            self._conf[r.rid] = np.asarray(confs[: len(toks)])
            props[r.rid] = Proposal(toks, np.stack(qs) if qs and not r.params.greedy else None,
                                    np.asarray(surv[: len(toks)], dtype=np.float64) if self.confident else None)
        return [props[r.rid] for r in reqs]

    def observe(self, rid, sent: int, accepted: int) -> None:
        """After verification: with ``record`` set, keep (the sent positions' confidence logits — empty without a
        confidence head —, sent, accepted)."""
        conf = self._conf.pop(rid, None)
        if self.record is not None and conf is not None and sent:
            self.record.append((conf[:sent].copy(), int(sent), int(accepted)))
