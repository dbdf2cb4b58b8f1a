"""The DSpark drafter at run time: the ``dspark_draft`` graph (ONNX Runtime) plus numpy Markov and
confidence heads, driven by the target's own features (no second target pass).

One round (docs/design.md section 1 steps 1-3; DSpark paper section 3):
1. Append the target features of the positions committed since the last round (the verify pass
   produced them; :attr:`DecoderRunner.features`) to the drafter's context K/V cache, and run the block
   [anchor, mask, ..., mask] at positions anchor_pos..anchor_pos+γ-1: one graph call gives the normed
   hidden states h_1..h_γ and base logits U_k. The context cache only ever holds committed positions,
   so it is never rolled back.
2. Left to right, logits_k = U_k + W2·latent(W1[x_{k-1}], h_k) (x_0 = anchor) and x_k is the argmax
   (greedy) or a sample from the processed distribution (its probabilities are kept for rejection
   sampling).
3. Confidence c_k = σ((wᵀ[h_k; W1[x_{k-1}]] + b) / T_k) with the STS temperatures T_k from the manifest;
   prefix survival a_j = Π_{k≤j} c_k. A static threshold P cuts the block by one of two named rules
   (:data:`THRESHOLD_RULES`); both decide on the draft's own quantities only, so sampling stays lossless:

   - ``"survival"`` (ours, the default): cut before the first position j whose *calibrated running
     product* a_j = Π_{k≤j} σ(z_k / T_k) falls below P (a_j estimates the probability that drafts 1..j
     are all accepted, so P is a floor on that estimate).
   - ``"deepspec"`` (DeepSpec's rule, ``deepspec/eval/dspark/draft_ops.py`` ``_confident_prefix_length``):
     cut before the first position k whose *own* raw confidence σ(z_k) (no STS temperature, no product)
     falls below P; P <= 0 keeps the whole block.

   The same P gives different block lengths under the two rules (the product only falls, so ``survival``
   cuts no later than ``deepspec`` when T_k = 1).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from dspark_runtime.backend import OrtDecoder
from dspark_runtime.errors import DSparkError
from dspark_runtime.graphspec import GraphSpec
from dspark_runtime.sampling import SamplingParams, process_logits, sample

# Static-threshold rules (module docstring, step 3): "survival" = ours, on the calibrated running product a_j;
# "deepspec" = DeepSpec's, on each position's own raw confidence σ(z_k).
THRESHOLD_RULES = ("survival", "deepspec")


def check_threshold_rule(rule: str) -> str:
    """``rule`` if it names a static-threshold rule; raises DSparkError naming the choices otherwise."""
    if rule not in THRESHOLD_RULES:
        raise DSparkError(f"unknown confidence threshold rule {rule!r}; choose one of {list(THRESHOLD_RULES)} "
                          "('survival': calibrated prefix survival, ours; 'deepspec': each position's own "
                          "confidence, DeepSpec's)")
    return rule


class OrtDSparkGraph(OrtDecoder):
    """Runs a ``dspark_draft`` graph with ONNX Runtime (constructs cheaply, loads on ``activate``; the
    session setup, providers check and ``empty_kv`` are :class:`OrtDecoder`'s)."""

    def __init__(self, path: str | Path, spec: GraphSpec, threads: int = 2, providers=None, **kw):
        if spec.kind != "dspark_draft":
            raise DSparkError(f"{path}: graph kind {spec.kind!r} is not a DSpark drafter (dspark_draft)")
        super().__init__(path, spec, threads=threads, providers=providers, **kw)
        self.block_size = next(t for t in spec.inputs if t.name == "block_positions").shape[1]

    def run(self, features, feature_positions, anchor_ids, block_positions, attention_mask, kv):
        """One call. features float32 [b, n, F]; feature_positions int64 [b, n]; anchor_ids int64 [b, 1];
        block_positions int64 [b, γ]; attention_mask bool [b, 1, γ, past + n + γ]; kv per layer
        (key, value) [b, kvh, past, hd]. Returns (hidden [b, γ, d], base_logits [b, γ, V_d], present kv)."""
        if self.session is None:
            self.activate()
        feeds = {"features": features, "feature_positions": feature_positions, "anchor_ids": anchor_ids,
                 "block_positions": block_positions, "attention_mask": attention_mask}
        for (kn, vn), (k, v) in zip(self._past, kv):
            feeds[kn] = np.ascontiguousarray(k)
            feeds[vn] = np.ascontiguousarray(v)
        outs = self.session.run(self._out_names, feeds)
        n = self.spec.dims.num_layers
        return outs[0], outs[1], [(outs[2 + 2 * i], outs[3 + 2 * i]) for i in range(n)]


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
    def load(cls, path: Path, info: dict, vocab_size: int, temperatures=None) -> "DSparkHeads":
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files}
        return cls(arrays, info.get("markov_head_type") if info.get("markov_rank") else None,
                   bool(info.get("confidence_head_with_markov")), vocab_size, temperatures)

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
                own raw confidence σ(z_k) falls below P (P <= 0: no cut). See the module docstring.
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


class DSparkDrafter:
    """Drafter (``generate.Drafter`` protocol) for a DSpark checkpoint compiled to ``dspark_draft``.

    Args:
        graph: the drafter graph backend.
        heads: Markov/confidence heads.
        target: the target's ``DecoderRunner`` (its ``features`` feed the context).
        confidence_threshold: static threshold P; None = always the full length asked for.
        threshold_rule: how P cuts a block (:data:`THRESHOLD_RULES`): ``"survival"`` (ours: before the first
            position whose calibrated prefix survival a_j < P) or ``"deepspec"`` (DeepSpec's: before the first
            position whose own raw confidence σ(z_k) < P).

    After each ``propose``, ``last_survival`` holds a_1..a_γ (float64 [γ]) for schedulers and metrics.
    """

    name = "dspark"

    def __init__(self, graph: OrtDSparkGraph, heads: DSparkHeads, target, confidence_threshold: float | None = None,
                 threshold_rule: str = "survival"):
        self.graph = graph
        self.heads = heads
        self.target = target
        self.block_size = graph.block_size
        self.confidence_threshold = confidence_threshold
        self.threshold_rule = check_threshold_rule(threshold_rule)
        self._kv = graph.empty_kv(1)
        self._ctx = 0  # committed positions already in the context cache
        self.last_survival = np.zeros(0)
        self.last_conf_logits = np.zeros(0)
        self.record: list | None = None  # set to [] to record (confidence logits [l], accepted n) per round
        self.cost = None  # a scheduler.CostTable: pick the verify length by the paper's Algorithm 1

    def begin(self, prompt: list) -> None:
        self._kv = self.graph.empty_kv(1)
        self._ctx = 0

    def propose(self, context: list, gamma: int, params: SamplingParams, rng) -> tuple:
        """Draft up to min(gamma, block size) tokens after ``context`` (its last token is the anchor).

        Returns (tokens list[int], q float64 [l, vocab] processed draft distributions or None if greedy).
        Raises DSparkError if the target holds no features for the committed positions (a target graph
        built without the drafter's ``target_layer_ids``).
        """
        feats = self.target.features
        anchor_pos = len(context) - 1
        if feats is None:
            raise DSparkError("the target graph outputs no features; rebuild the engine with the drafter's "
                              "target_layer_ids as target feature layers")
        if self.target.length != anchor_pos or self._ctx > anchor_pos:
            raise DSparkError(f"DSpark drafter out of sync: target holds {self.target.length} positions, "
                              f"anchor at {anchor_pos}, drafter context {self._ctx}")
        g = self.block_size
        new = feats[self._ctx:anchor_pos][None]
        fpos = np.arange(self._ctx, anchor_pos, dtype=np.int64)[None]
        bpos = np.arange(anchor_pos, anchor_pos + g, dtype=np.int64)[None]
        mask = np.ones((1, 1, g, anchor_pos + g), dtype=bool)
        hidden, base, self._kv = self.graph.run(new, fpos, np.asarray([[context[-1]]], dtype=np.int64), bpos,
                                                mask, self._kv)
        self._ctx = anchor_pos
        tokens, qs, surv, confs = self.heads.draft(base[0], hidden[0], context[-1], max(0, min(gamma, g)),
                                                   params, rng, self.confidence_threshold,
                                                   self.threshold_rule)
        self.last_survival = np.asarray(surv)
        self.last_conf_logits = np.asarray(confs[:len(tokens)])
        if self.cost is not None and len(surv) == len(tokens) and tokens:
            from dspark_runtime.scheduler import schedule_greedy

            ell = schedule_greedy([self.last_survival], self.cost)[0]
            tokens, qs = tokens[:ell], qs[:ell]
            self.last_conf_logits = self.last_conf_logits[:ell]
        return tokens, (np.stack(qs) if qs else None) if not params.greedy else None

    def observe(self, n_accepted: int) -> None:
        """Called after verification with the number of this round's drafts the target accepted."""
        if self.record is not None and len(self.last_conf_logits):
            self.record.append((self.last_conf_logits.copy(), int(n_accepted)))
