"""The EAGLE-3 drafter at run time: the ``eagle3_draft`` graph (one draft step of a single-layer EAGLE-3 drafter,
DeepSpec's or SpecForge's, over its own KV cache) driven by the target's own features. Sources: EAGLE-3 (Li et al.
2025); DeepSpec's ``deepspec/eval/eagle3/evaluator.py`` (parity: tests/runtime/drafting/test_eagle3_drafter.py);
vLLM's ``llama_eagle3.py`` for a reduced draft vocabulary (:class:`DraftVocab`); docs/drafter.md.

One round for a request whose anchor sits at position P: the fused target features of the positions committed since
its last round (position i paired with token i + 1, RoPE position i) extend the drafter's cache in one call, whose
output state at P - 1 gives the logits of draft token 1; draft token k + 1 comes from a one-position call on the
state of step k and the embedding of token k, at RoPE position P + k - 1. Only committed positions stay in the
cache; a round's draft steps are dropped after it, so nothing is rolled back. Greedy requests draft the argmax;
sampled ones draw from the processed draft distribution q, kept for rejection sampling (lossless). With a reduced
draft vocabulary the argmax is mapped to its target id, and q is the processed full-vocabulary row whose logits are
-inf outside the draft vocabulary (so q is zero there).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from dspark_runtime.backends.ort import OrtDecoder
from dspark_runtime.decoding.sampling import process_logits, sample
from dspark_runtime.drafting.base import Drafter, Proposal
from dspark_runtime.drafting.context_kv import ContextKV, anchor_position
from dspark_runtime.drafting.dspark import context_groups
from dspark_runtime.drafting.embedding_rows import EmbeddingRows
from dspark_runtime.engine_dir.graphspec import GraphSpec
from dspark_runtime.errors import DSparkError, ManifestError


def feature_columns(target_layers, drafter_layers, hidden_size: int) -> np.ndarray | None:
    """Columns of the target's features (its ``feature_layers``, ``hidden_size`` wide each, concatenated) holding
    ``drafter_layers`` in the drafter's order, int64 [len(drafter_layers) · hidden_size]; None when they are the
    same layers in the same order (the features are used as they are). Raises DSparkError naming the missing
    layers and the fix."""
    target_layers, drafter_layers = [int(x) for x in target_layers], [int(x) for x in drafter_layers]
    if target_layers == drafter_layers:
        return None
    missing = [x for x in drafter_layers if x not in target_layers]
    if missing:
        raise DSparkError(f"the drafter reads target layers {drafter_layers} but the target graph outputs features of "
                          f"layers {target_layers} only (missing {missing}); rebuild the target with feature layers "
                          f"that include {drafter_layers} (recipe field target_feature_layers)")
    return np.concatenate([np.arange(hidden_size) + target_layers.index(x) * hidden_size for x in drafter_layers])


class DraftVocab:
    """A reduced draft vocabulary (SpecForge / vLLM layout): ``ids`` int64 [V_d], the target id of each column of the
    drafter's logits (strictly increasing, inside the target's ``vocab_size``). Raises ManifestError otherwise."""

    def __init__(self, ids, vocab_size: int, where: str = "draft vocabulary"):
        ids = np.asarray(ids)
        if (ids.ndim != 1 or not ids.size or not np.issubdtype(ids.dtype, np.integer) or int(ids.min()) < 0
                or int(ids.max()) >= vocab_size or bool((np.diff(ids) <= 0).any())):
            raise ManifestError(f"{where}: expected strictly increasing int64 target ids in 0..{vocab_size - 1}, got "
                                f"{ids.dtype} {ids.shape}; re-run `dspark-export add-draft`")
        self.ids, self.vocab_size = ids.astype(np.int64), int(vocab_size)

    def to_target(self, index: int) -> int:
        """The target id of draft logits column ``index``."""
        return int(self.ids[index])

    def full(self, logits: np.ndarray) -> np.ndarray:
        """Draft logits float32 [V_d] -> target-vocabulary logits [V], -inf outside the draft vocabulary."""
        out = np.full(self.vocab_size, -np.inf, dtype=np.float32)
        out[self.ids] = logits
        return out


def eagle3_vocab(engine_dir: Path, section, spec: GraphSpec, vocab_size: int) -> DraftVocab | None:
    """The EAGLE-3 drafter's :class:`DraftVocab` from its manifest section (``speculation.eagle3``:
    ``draft_vocab_file``), or None when its logits cover the target's ``vocab_size``. Raises ManifestError when the
    file is missing or unreadable, or its length or the graph's logits width disagree with the target."""
    f, width = section.draft_vocab_file, spec.dims.vocab_size
    if f is None:
        if width != vocab_size:
            raise ManifestError(f"{engine_dir}: the EAGLE-3 drafter's logits cover {width} tokens, the target's "
                                f"vocabulary {vocab_size}, and speculation.eagle3 names no draft_vocab_file mapping "
                                "them; re-run `dspark-export add-draft`")
        return None
    try:
        ids = np.load(Path(engine_dir) / f, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ManifestError(f"{Path(engine_dir) / f}: the EAGLE-3 draft vocabulary (speculation.eagle3."
                            f"draft_vocab_file) cannot be read ({e}); re-run `dspark-export add-draft`") from None
    vocab = DraftVocab(ids, vocab_size, where=str(Path(engine_dir) / f))
    if len(vocab.ids) != width:
        raise ManifestError(f"{Path(engine_dir) / f}: {len(vocab.ids)} draft token ids for the {width} logits of the "
                            "EAGLE-3 drafter graph; re-run `dspark-export add-draft`")
    return vocab


class OrtEagle3Graph(OrtDecoder):
    """Runs an ``eagle3_draft`` graph with ONNX Runtime (constructs cheaply, loads on ``activate``; session setup and
    ``empty_kv`` are :class:`OrtDecoder`'s). ``embedding``: the :class:`EmbeddingRows` the tokens' rows are read
    from (set by the engine from ``speculation.eagle3.embedding``); ``draft_vocab``: the :class:`DraftVocab` of its
    logits, None for the target's vocabulary (set by the engine, :func:`eagle3_vocab`)."""

    def __init__(self, path: str | Path, spec: GraphSpec, threads: int = 2, providers=None,
                 embedding: EmbeddingRows | None = None, draft_vocab: DraftVocab | None = None, **kw):
        if spec.kind != "eagle3_draft":
            raise DSparkError(f"{path}: graph kind {spec.kind!r} is not an EAGLE-3 drafter (eagle3_draft)")
        super().__init__(path, spec, threads=threads, providers=providers, **kw)
        self.embedding, self.draft_vocab = embedding, draft_vocab

    def run(self, features, states, token_ids, position_ids, attention_mask, logits_at, kv):
        """One call over q query positions. features float32 [b, q, F]; states float32 [b, q, d]; token_ids int64
        [b, q] (the token after each position); position_ids int64 [b, q]; attention_mask bool [b, 1, q, past + q];
        logits_at int64 [b]; kv per layer (key, value) [b, kvh, past, hd]. Returns (states_out [b, q, d],
        logits [b, V_d] (V_d = V without a draft vocabulary), present kv [b, kvh, past + q, hd]). Raises
        DSparkError when no embedding table was given."""
        if self.session is None:
            self.activate()
        if self.embedding is None:
            raise DSparkError(f"{self.path}: the EAGLE-3 drafter graph takes token embedding rows but the manifest "
                              "names no table (speculation.eagle3.embedding); re-run `dspark-export add-draft`")
        feeds = {"features": features, "states": states, "embeds": self.embedding.rows(token_ids),
                 "position_ids": position_ids, "attention_mask": attention_mask, "logits_at": logits_at}
        outs, present = self.run_with_kv(feeds, kv, 2)
        return outs[0], outs[1], present


class Eagle3Drafter(Drafter):
    """The EAGLE-3 drafter (a :class:`~dspark_runtime.drafting.base.Drafter`) for one request or many: per round one
    graph call over the requests' newly committed positions (split by :func:`context_groups` when one request
    brings a whole prompt), then one call per further draft token over the requests that want it.

    Args:
        graph: the drafter graph backend (:class:`OrtEagle3Graph`).
        target: the verifier's runner (a :class:`~dspark_runtime.runners.base.BatchRunner`; its ``features(rid)``
            feed the drafter).
        columns: :func:`feature_columns` of the target's features the drafter reads, or None for all of them.
    Requests outside a round's ``only`` (or asked for no token) are left alone; their committed positions enter the
    cache at their next drafted round. Draft tokens are target ids (mapped through ``graph.draft_vocab``).
    """

    name = "eagle3"
    reads_target_features = True

    def __init__(self, graph: OrtEagle3Graph, target, columns: np.ndarray | None = None):
        self.graph, self.target, self.columns = graph, target, columns
        self.ctx = ContextKV(graph.empty_kv(0))
        self._done: dict = {}  # rid -> committed positions already in its cache row

    def begin(self, req) -> None:
        if self.target.features(req.rid) is None:
            raise DSparkError("the target graph outputs no features; rebuild the engine with the EAGLE-3 drafter's "
                              "target_layer_ids as target feature layers")
        self.ctx.add(req.rid)
        self._done[req.rid] = 0

    def remove(self, rid) -> None:
        self.ctx.remove(rid)
        self._done.pop(rid, None)

    def propose_batch(self, reqs: list, gammas: list, only=None) -> list:
        """Draft up to ``gammas[i]`` tokens for ``reqs[i]`` (in ``only``, None = all). Returns list[Proposal] in the
        order of ``reqs`` (q [l, V] for sampled requests, None for greedy; no survivals). Raises DSparkError when a
        request is unknown or out of sync with the target."""
        props = {r.rid: Proposal([]) for r in reqs}
        work = [(r, int(g)) for r, g in zip(reqs, gammas) if g > 0 and (only is None or r.rid in only)]
        if work:
            order = {rid: i for i, rid in enumerate(self.ctx.rows)}
            if any(r.rid not in order for r, _ in work):
                raise DSparkError("EAGLE-3 drafter: a request proposed for before it began")
            work.sort(key=lambda rg: order[rg[0].rid])
            anchors = [anchor_position(r, self.target, self._done[r.rid], "EAGLE-3 drafter") for r, _ in work]
            rows = [order[r.rid] for r, _ in work]
            state, logits = self._extend(work, rows, anchors)
            for (r, _), p in zip(work, anchors):
                self._done[r.rid] = p
            self.ctx.compact()
            rows = [self.ctx.rows.index(r.rid) for r, _ in work]
            for (r, _), prop in zip(work, self._draft(work, rows, anchors, state, logits)):
                props[r.rid] = prop
        return [props[r.rid] for r in reqs]

    def _features(self, rid, a: int, b: int) -> np.ndarray:
        f = self.target.features(rid)[a:b]
        return f if self.columns is None else f[:, self.columns]

    @staticmethod
    def _next_tokens(r, a: int, b: int) -> list:
        """The tokens after positions a..b-1 of request ``r`` (positions a+1..b of prompt + out)."""
        n = len(r.prompt)
        return [r.prompt[j] if j < n else r.out[j - n] for j in range(a + 1, b + 1)]

    def _extend(self, work: list, rows: list, anchors: list) -> tuple:
        """Add each request's committed positions since its last round to its cache row. Returns (the output state
        at each request's last new position float32 [W, d], the logits there [W, V]: draft token 1's)."""
        news = [(self._done[r.rid], p) for (r, _), p in zip(work, anchors)]
        kv, valid = self.ctx.gather(rows)
        S, W = valid.shape[1], len(work)
        d, fdim = self.graph.spec.dims.hidden_size, self.graph.spec.inputs[0].shape[-1]
        groups = context_groups([b - a for a, b in news], 1)
        one = len(groups) == 1  # the steady round: one call, its K/V kept as the graph returns it
        if one:
            groups = [list(range(W))]
        else:  # the merged K/V the calls write their rows into
            n_all = max(b - a for a, b in news)
            out_kv = [(np.zeros(k.shape[:2] + (S + n_all,) + k.shape[3:], dtype=k.dtype),
                       np.zeros(v.shape[:2] + (S + n_all,) + v.shape[3:], dtype=v.dtype)) for k, v in kv]
            out_valid = np.zeros((W, S + n_all), dtype=bool)
        state = np.zeros((W, d), dtype=np.float32)
        logits = None
        for g in groups:
            idx = np.asarray(g, dtype=np.int64)
            n = max(news[i][1] - news[i][0] for i in g)
            feats = np.zeros((len(g), n, fdim), dtype=np.float32)
            toks = np.zeros((len(g), n), dtype=np.int64)
            pos = np.zeros((len(g), n), dtype=np.int64)
            new_valid = np.zeros((len(g), n), dtype=bool)
            at = np.zeros(len(g), dtype=np.int64)
            for j, i in enumerate(g):
                (r, _), (a, b) = work[i], news[i]
                feats[j, : b - a] = self._features(r.rid, a, b)
                toks[j, : b - a] = self._next_tokens(r, a, b)
                pos[j, : b - a] = np.arange(a, b)
                new_valid[j, : b - a] = True
                at[j] = b - a - 1
            past_valid = valid[idx]
            causal = np.tril(np.ones((n, n), dtype=bool))
            mask = np.concatenate([np.broadcast_to(past_valid[:, None, :], (len(g), n, S)),
                                   new_valid[:, None, :] & causal[None]], axis=2)[:, None]
            past = kv if one else [(k[idx], v[idx]) for k, v in kv]
            st, lg, present = self.graph.run(feats, np.zeros((len(g), n, d), dtype=np.float32), toks, pos,
                                             np.ascontiguousarray(mask), at, past)
            if logits is None:
                logits = np.zeros((W, lg.shape[-1]), dtype=lg.dtype)
            state[idx], logits[idx] = st[np.arange(len(g)), at], lg
            if one:
                self.ctx.write(rows, present, np.concatenate([past_valid, new_valid], axis=1))
                return state, logits
            for (ok, ov), (pk, pv) in zip(out_kv, present):
                ok[idx, :, : S + n], ov[idx, :, : S + n] = pk, pv
            out_valid[idx, :S] = past_valid
            out_valid[idx, S: S + n] = new_valid
        self.ctx.write(rows, out_kv, out_valid)
        return state, logits

    def _draft(self, work: list, rows: list, anchors: list, state: np.ndarray, logits: np.ndarray) -> list:
        """The round's draft tokens, one graph call per token after the first, on a copy of the committed cache
        (dropped after the round). Returns list[Proposal] in the order of ``work``."""
        kv, valid = self.ctx.gather(rows)
        fdim, vocab = self.graph.spec.inputs[0].shape[-1], self.graph.draft_vocab
        tokens, qs = [[] for _ in work], [[] for _ in work]
        alive = list(range(len(work)))
        for k in range(max(g for _, g in work)):
            for j, i in enumerate(alive):
                r = work[i][0]
                if r.params.greedy:
                    best = int(np.argmax(logits[j]))
                    tokens[i].append(best if vocab is None else vocab.to_target(best))
                else:
                    q = process_logits(logits[j] if vocab is None else vocab.full(logits[j]), r.params)
                    tokens[i].append(int(sample(q, r.rng)))
                    qs[i].append(q)
            keep = [j for j, i in enumerate(alive) if len(tokens[i]) < work[i][1]]
            if not keep:
                break
            if len(keep) < len(alive):
                sel = np.asarray(keep, dtype=np.int64)
                kv, valid, state = [(kk[sel], vv[sel]) for kk, vv in kv], valid[sel], state[sel]
                alive = [alive[j] for j in keep]
            b = len(alive)
            toks = np.asarray([[tokens[i][-1]] for i in alive], dtype=np.int64)
            pos = np.asarray([[anchors[i] + k] for i in alive], dtype=np.int64)
            mask = np.concatenate([valid, np.ones((b, 1), dtype=bool)], axis=1)[:, None, None, :]
            st, logits, kv = self.graph.run(np.zeros((b, 1, fdim), dtype=np.float32), state[:, None, :], toks, pos,
                                            np.ascontiguousarray(mask), np.zeros(b, dtype=np.int64), kv)
            state, valid = st[:, 0], mask[:, 0, 0]
        return [Proposal(t, np.stack(q) if q else None) for t, q in zip(tokens, qs)]
