"""Train an EAGLE-3 drafter on the DSpark drafter's feature cache (the same sequences, target features and target
distributions, so the two compare at equal training): :class:`Eagle3Objective` for the shared loop
:func:`dspark_export.drafter.train.optimize`.

Training-time test (EAGLE-3, Li et al. 2025; DeepSpec ``deepspec/modeling/eagle3/`` and its SpecForge-derived
mask): step 0 runs the drafter on the fused target features of every position i with token i + 1; step k feeds
step k - 1's output state at i with token i + k + 1 at RoPE position i + k, its query attending to the step-0
keys of positions <= i and to position i's own keys of steps 1..k — what decoding sees k steps into a round. Step k
at position i is trained towards the target's distribution at position i + k + 1 (soft cross-entropy on the answer
tokens, weighted ``decay``^k): the full distribution from the target's final states, or — from a cache extracted
through an engine, which keeps the target's logits over a reduced vocabulary V_d — that distribution over V_d (the
drafter's full-vocabulary head then learns to put no mass outside V_d).
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from dspark_runtime.drafting.eagle3 import feature_columns
from dspark_runtime.errors import DSparkError

from dspark_export.drafter.train import Objective, TrainSettings, _to, _window, optimize

STEP_LOSS_DECAY = 0.8  # DeepSpec's config/eagle3 step_loss_decay


def ttt_batch(seqs: list, columns=None) -> dict:
    """Tensors for one step over windows ``seqs`` [(ids, mask, feats, aux)] padded to the longest: ids int64 [b, T],
    feats float32 [b, T, F'] (``columns`` of the store's features: the drafter's layers), last float32 [b, T, A]
    (the store's aux: the target's final normed states [.., d], or its logits over the draft vocabulary [.., V_d]),
    loss_mask bool [b, T] (trained tokens, padding excluded)."""
    import torch

    b, T = len(seqs), max(len(q[0]) for q in seqs)
    cols = slice(None) if columns is None else np.asarray(columns)
    F_ = np.asarray(seqs[0][2][:1])[:, cols].shape[1]
    ids = np.zeros((b, T), np.int64)
    feats = np.zeros((b, T, F_), np.float32)
    last = np.zeros((b, T, np.asarray(seqs[0][3]).shape[1]), np.float32)
    mask = np.zeros((b, T), bool)
    for i, (si, sm, sf, sl) in enumerate(seqs):
        n = len(si)
        ids[i, :n], feats[i, :n], last[i, :n], mask[i, :n] = si, np.asarray(sf)[:, cols], sl, np.asarray(sm) > 0
    T_ = torch.as_tensor
    return {"ids": T_(ids), "feats": T_(feats), "last": T_(last), "loss_mask": T_(mask)}


def ttt_steps(model, ids, feats, ttt_length: int):
    """The training-time-test forward (module docstring) of ids int64 [b, T] with the drafter's target features
    [b, T, F]: yields, for k = 0..ttt_length-1, (k, nxt, states) — ``nxt`` int64 [N] (N = T - 1) the index of the
    token fed at each position i (i + k + 1, clamped to T - 1), ``states`` [b, N, d] the draft states (step k at
    position i: what a round whose last committed position is i computes k steps in, fed the true tokens)."""
    import torch

    b, T = ids.shape
    N = T - 1
    dev = ids.device
    layer = model.layers[0]
    i = torch.arange(N, device=dev)
    causal = i[None, :] <= i[:, None]  # step-0 keys of positions <= i
    diag = torch.eye(N, dtype=torch.bool, device=dev)  # position i's own keys of steps 1..k
    state = model.fuse(feats[:, :N])
    keys, values = [], []
    for k in range(ttt_length):
        nxt = (i + k + 1).clamp(max=T - 1)
        x = torch.cat([layer.input_layernorm(model.embed_tokens(ids[:, nxt])), layer.hidden_norm(state)], dim=-1)
        q, kk, vv = layer.self_attn.project(x, (i + k).expand(b, N))
        keys.append(kk)
        values.append(vv)
        mask = torch.cat([causal] + [diag] * k, dim=1)[None, None]
        h = state + layer.self_attn.attend(q, torch.cat(keys, 2), torch.cat(values, 2), mask)
        state = h + layer.mlp(layer.post_attention_layernorm(h))
        yield k, nxt, state


def ttt_loss(model, batch, target_head, ttt_length: int, decay: float = STEP_LOSS_DECAY, vocab=None) -> tuple:
    """The training-time-test loss of one batch (:func:`ttt_batch`; module docstring); ``target_head`` [V, d] turns
    the target's final states into its distributions, or is None when ``batch["last"]`` holds the target's logits
    over the vocabulary ``vocab`` (int64 tensor [V_d] of target ids). Returns (loss, metrics {"loss", "acc_pos"
    [ttt_length] (draft argmax == target argmax per step), "n" [ttt_length] (scored positions), "tau_greedy"
    (teacher-forced greedy accepted length + 1 over positions where every step is scored; nan if none)})."""
    import torch

    ids, lm = batch["ids"], batch["loss_mask"]
    T = ids.shape[1]
    i = torch.arange(T - 1, device=ids.device)
    total, acc, counts, matches, scored = 0.0, [], [], [], []
    for k, nxt, states in ttt_steps(model, ids, batch["feats"], ttt_length):
        w = lm[:, nxt] & (i + k + 1 <= T - 1)[None]  # [b, N]: the predicted position is a trained token
        logp = torch.log_softmax(model.logits(states).float(), dim=-1)
        with torch.no_grad():
            t_logits = batch["last"][:, nxt] if target_head is None else batch["last"][:, nxt] @ target_head.T
            p_t = torch.softmax(t_logits.float(), dim=-1)
        ce = -(p_t * (logp if vocab is None else logp[..., vocab])).sum(-1)
        wf = w.float()
        total = total + decay ** k * (ce * wf).sum() / wf.sum().clamp_min(1.0)
        with torch.no_grad():
            want = p_t.argmax(-1) if vocab is None else vocab[p_t.argmax(-1)]
            m = (logp.argmax(-1) == want) & w
            matches.append(m)
            scored.append(w)
            counts.append(int(w.sum()))
            acc.append(float(m.sum()) / max(1, counts[-1]))
    with torch.no_grad():
        full = torch.stack(scored, -1).all(-1)
        chain = torch.stack(matches, -1).int().cumprod(-1).sum(-1)
        tau = float((1 + chain[full].float()).mean()) if bool(full.any()) else float("nan")
    return total, {"loss": float(total.detach()), "acc_pos": acc, "n": counts, "tau_greedy": tau}


class Eagle3Objective(Objective):
    """The EAGLE-3 drafter's objective over a :class:`~dspark_export.drafter.features.FeatureStore`:
    :func:`ttt_batch` / :func:`ttt_loss`, checkpoints in DeepSpec's layout.

    Args:
        model: an :class:`~dspark_export.drafter.eagle3.Eagle3DraftModel` (with ``draft_vocab_ids``: a head over
            those target ids, trained towards the target's distribution over them); target_head: the target's LM
            head [V, d] (on the training device; unused for a store of target logits); s: the run's settings; store: the
            feature cache; columns: the store's feature columns holding the drafter's layers
            (:func:`dspark_runtime.drafting.eagle3.feature_columns`; None: all).
    Raises DSparkError for a store of target logits without its ``draft_vocab.npy``, or over another vocabulary than
    a reduced drafter's.
    """

    name = "train-draft eagle3"

    def __init__(self, model, target_head, s: TrainSettings, store, columns=None):
        import torch

        self.s, self.columns, self.ttt = s, columns, model.config.ttt_length
        dev = torch.device(s.device)
        own = model.draft_vocab_ids  # a reduced head: its logits are over these target ids
        self.target_head, self.vocab = (target_head if own is None else target_head[own.to(target_head.device)]), None
        if store.aux == "tlogits":  # extracted through an engine: logits over the draft vocabulary
            f = Path(store.root) / "draft_vocab.npy"
            if not f.is_file():
                raise DSparkError(f"{store.root}: a cache of target logits without its draft_vocab.npy; extract the "
                                  "features again")
            cached = np.load(f).astype(np.int64)
            self.target_head = None
            if own is None:
                self.vocab = torch.as_tensor(cached, device=dev)
            elif not np.array_equal(cached, own.cpu().numpy()):
                raise DSparkError(f"{store.root}: the cached target logits are over another draft vocabulary than "
                                  "the drafter's; train with the cache's draft_vocab.npy as the drafter's vocabulary")

    def batch(self, seqs, rng):
        seqs = [q for q in seqs if len(q[0]) > 1]
        return ttt_batch(seqs, self.columns) if seqs else None

    def loss(self, model, batch):
        return ttt_loss(model, batch, self.target_head, self.ttt, vocab=self.vocab)

    def heldout(self, model, store, indices) -> dict:
        """Teacher-forced acceptance by step on a fixed window of each held-out sequence."""
        import torch

        dev = torch.device(self.s.device)
        erng = np.random.default_rng(1234)
        hits, tries, taus = np.zeros(self.ttt), np.zeros(self.ttt), []
        model.eval()
        with torch.no_grad():
            for i in indices:
                seq = _window(store, i, erng, self.s.eval_seq_len)
                if len(seq[0]) < 2:
                    continue
                _, m = ttt_loss(model, _to(ttt_batch([seq], self.columns), dev), self.target_head, self.ttt,
                                vocab=self.vocab)
                hits += np.asarray(m["acc_pos"]) * np.asarray(m["n"])
                tries += np.asarray(m["n"])
                if not np.isnan(m["tau_greedy"]):
                    taus.append(m["tau_greedy"])
        model.train()
        return {"heldout_acc_pos": (hits / np.maximum(tries, 1)).round(3).tolist(),
                "heldout_tau_greedy": float(np.mean(taus)) if taus else float("nan")}

    def save(self, model, out_dir: Path) -> None:
        """DeepSpec's layout, or SpecForge's for a drafter with a reduced vocabulary; fp16 like the DSpark drafter's
        checkpoints (the training state keeps fp32)."""
        import torch

        from dspark_export.drafter.eagle3 import save_eagle3_checkpoint
        from dspark_export.drafter.eagle3_specforge import save_specforge_checkpoint

        save = save_eagle3_checkpoint if model.draft_vocab_ids is None else save_specforge_checkpoint
        save(model, out_dir, dtype=torch.float16)


def new_eagle3_drafter(target_config: dict, target_layer_ids, ttt_length: int, intermediate_size: int | None = None,
                       vocab=None):
    """A fresh EAGLE-3 drafter for the target ``target_config`` (its ``config.json`` dict) fusing decoder layers
    ``target_layer_ids``, ``ttt_length`` draft steps, MLP width ``intermediate_size`` (None: the target's): with a
    draft vocabulary ``vocab`` (int64 target ids) in the SpecForge / vLLM layout (a head over those tokens only),
    without one in DeepSpec's (full vocabulary). Its embedding and LM head still need the target's weights
    (``init_from_target``). Raises DraftConfigError for a target config the layer cannot follow."""
    import dataclasses

    import torch

    from dspark_export.drafter.eagle3 import Eagle3Config, Eagle3DraftModel, eagle3_config_for
    from dspark_export.drafter.eagle3_specforge import specforge_config_for

    if vocab is None:
        return Eagle3DraftModel(eagle3_config_for(target_config, target_layer_ids, ttt_length, intermediate_size))
    c = Eagle3Config.from_dict(specforge_config_for(target_config, target_layer_ids, len(vocab), intermediate_size),
                               source="SpecForge-layout EAGLE-3 config",
                               target_num_layers=target_config["num_hidden_layers"])
    model = Eagle3DraftModel(dataclasses.replace(c, ttt_length=ttt_length))
    model.draft_vocab_ids = torch.as_tensor(np.asarray(vocab, dtype=np.int64))
    return model


def train_eagle3(store, model, target_head, out_dir: Path, s: TrainSettings, *, columns=None, log=print,
                 resume: Path | None = None) -> dict:
    """Train ``model`` (an EAGLE-3 drafter, its embedding and LM head frozen copies of the target's) on ``store``:
    :func:`~dspark_export.drafter.train.optimize` with :class:`Eagle3Objective`; returns its metrics and leaves a
    DeepSpec-layout checkpoint in ``out_dir``."""
    import torch

    head = target_head.to(torch.device(s.device))
    return optimize(store, model, Eagle3Objective(model, head, s, store, columns), out_dir, s, log=log,
                    resume=resume)


def train_eagle3_stage(store, cfg: dict, feature_layers, ttt_length: int, intermediate_size: int | None,
                       s: TrainSettings, vocab, target_dir: Path, out_dir: Path, resume: Path,
                       budget: float | None, log=print) -> dict:
    """``train-draft``'s stage 4 for an EAGLE-3 drafter (``--method eagle3``): a new drafter for the target config
    ``cfg`` (one layer, MLP width ``intermediate_size``, ``ttt_length`` steps; embedding and LM head frozen copies of
    the target's in ``target_dir``) fusing the decoder layers of ``feature_layers`` (EAGLE-3 fuses decoder layers
    only: the embedding output, -1, is left out), trained on ``store`` by :func:`train_eagle3` for at most ``budget``
    seconds (None: ``s.time_budget_s``), resumable from ``resume``. With the run's draft vocabulary ``vocab`` (int64
    target ids) its head covers those tokens only and it is written in the SpecForge / vLLM layout (``d2t`` /
    ``t2d``: a head ~10x smaller to read at every draft step); without one (``--draft-vocab 0``), DeepSpec's layout
    with the full vocabulary. Returns its report plus "seconds_this_call". Raises DSparkError when the features hold
    no decoder layer."""
    import torch

    from dspark_export.drafter.graph import target_frozen_weights

    layers = [x for x in feature_layers if x >= 0]
    if not layers:
        raise DSparkError(f"the features hold layers {list(feature_layers)}; an EAGLE-3 drafter fuses decoder "
                          "layers (>= 0): extract features of some (--reuse-data from a run that has them)")
    torch.manual_seed(s.seed)
    model = new_eagle3_drafter(cfg, layers, ttt_length, intermediate_size, vocab)
    emb, head = target_frozen_weights(target_dir)
    model.init_from_target(emb, head)
    del emb
    log(f"[4/5] training an EAGLE-3 drafter: {sum(q.numel() for q in model.parameters() if q.requires_grad) / 1e6:.1f}"
        f" M trainable parameters, target layers {layers}, {ttt_length} steps, "
        + (f"draft vocabulary {len(vocab)} (SpecForge layout)" if vocab is not None else "full vocabulary"))
    s.time_budget_s = min(s.time_budget_s, budget) if budget is not None else s.time_budget_s
    t = time.perf_counter()
    cols = feature_columns(feature_layers, layers, cfg["hidden_size"])
    rep = train_eagle3(store, model, head, out_dir, s, columns=cols, log=log, resume=resume)
    return {**rep, "seconds_this_call": time.perf_counter() - t}
