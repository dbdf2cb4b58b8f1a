"""Train a DSpark drafter on this CPU: anchor sampling, the DeepSpec loss, AdamW, and the pipeline that runs
the stages (sequences and the feature cache are :mod:`dspark_export.draft_features`).

Pipeline (``dspark-export train-draft``):
1. ``build_sequences``: token sequences with a loss mask — the target's own answers to training prompts
   (``draft_data.generate_answers``; loss on the answer tokens), the Python standard library's source
   and ShareGPT chat turns teacher-forced through the target (loss on all / on the assistant tokens).
2. ``extract_features``: one teacher-forced target pass per sequence (bf16, no LM head) storing the
   concatenated ``target_layer_ids`` features and the final normed hidden state in fp16 shards
   (memory-mapped .npy, resumable per shard; 2·(m+1)·d bytes per token).
3. ``train``: sample anchors, build γ-blocks, loss 0.1·CE + 0.9·‖p_d − p_t‖₁ + 1.0·BCE(c, c*) with
   c* = 1 − ½‖p_d − p_t‖₁ and position weights exp(−k/loss_decay_gamma) (DeepSpec
   ``deepspec/modeling/dspark/loss.py``; DSpark paper §3.3). Target distributions p_t come from the
   cached final hidden states through the target's LM head (restricted to the draft vocabulary when
   one is used, renormalised there).
"""
from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark_runtime.errors import DSparkError

from .draft_features import (FeatureStore, answer_sequences, choose_draft_vocab, extract_features,
                             extract_features_ort, pick_mask_token, sharegpt_sequences, stdlib_sequences)



# ---------------------------------------------------------------------------------------------
# 3. training
# ---------------------------------------------------------------------------------------------

@dataclass
class TrainSettings:
    """Training hyper-parameters (DeepSpec defaults where they exist)."""

    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_steps: int = 50
    anchors_per_seq: int = 32
    max_seq_len: int = 1024
    seqs_per_step: int = 2
    loss_decay_gamma: float = 4.0
    ce_alpha: float = 0.1
    l1_alpha: float = 0.9
    conf_alpha: float = 1.0
    time_budget_s: float = 3600.0
    max_steps: int = 100000
    eval_every: int = 100
    eval_seqs: int = 24
    save_every_s: float = 600.0
    seed: int = 0


def sample_anchors(mask: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Up to ``n`` sorted anchor positions p with mask[p] and mask[p+1] set (DeepSpec's anchor rule)."""
    ok = np.flatnonzero((mask[:-1] > 0) & (mask[1:] > 0))
    if len(ok) == 0:
        return ok
    return np.sort(rng.choice(ok, size=min(n, len(ok)), replace=False))


def block_batch(seqs, anchors_list, gamma: int, mask_token: int, t2d):
    """Tensors for one training step over several sequences, padded to the longest.

    seqs: [(ids, mask, feats, last)]; anchors_list: per sequence int array [A_i].
    Returns dict of torch tensors: ids [b, L], feats [b, L, F], anchors [b, A], keep [b, A],
    block_ids [b, A·γ], block_pos [b, A·γ], labels [b, A, γ] (target ids), eval_mask [b, A, γ],
    last_idx [b, A, γ] (index of the hidden state predicting each label), prev_in [b, A, γ] (W1 rows).
    """
    import torch

    b = len(seqs)
    L = max(len(s[0]) for s in seqs)
    A = max(1, max(len(a) for a in anchors_list))
    F_ = seqs[0][2].shape[1]
    ids = np.zeros((b, L), np.int64)
    msk = np.zeros((b, L), np.uint8)
    feats = np.zeros((b, L, F_), np.float32)
    anchors = np.zeros((b, A), np.int64)
    keep = np.zeros((b, A), bool)
    lens = np.zeros(b, np.int64)
    for i, ((si, sm, sf, _), an) in enumerate(zip(seqs, anchors_list)):
        n = len(si)
        lens[i] = n
        ids[i, :n], msk[i, :n], feats[i, :n] = si, sm, sf
        anchors[i, :len(an)], keep[i, :len(an)] = an, True
    offs = np.arange(gamma)
    label_idx = anchors[:, :, None] + 1 + offs  # [b, A, γ]
    valid = (label_idx < lens[:, None, None]) & keep[:, :, None]
    safe = np.where(valid, label_idx, 0)
    # aux row predicting each label: the target state at label - 1 (gathered per sequence, no padding copy)
    last = np.stack([np.asarray(seqs[i][3][(safe[i] - 1).clip(0)], np.float32) for i in range(b)])
    labels = np.take_along_axis(ids[:, None, :].repeat(A, 1), safe, axis=2)
    lm = np.take_along_axis(msk[:, None, :].repeat(A, 1), safe, axis=2) > 0
    eval_mask = np.cumprod(valid & lm, axis=-1).astype(bool)
    anchor_tok = np.take_along_axis(ids, anchors, axis=1)
    prev = np.concatenate([anchor_tok[:, :, None], labels[:, :, :-1]], axis=-1)
    block_ids = np.full((b, A, gamma), mask_token, np.int64)
    block_ids[:, :, 0] = anchor_tok
    T = torch.as_tensor
    t2d_np = t2d.numpy()
    return {"ids": T(ids), "feats": T(feats), "anchors": T(anchors), "keep": T(keep),
            "block_ids": T(block_ids.reshape(b, -1)), "block_pos": T((anchors[:, :, None] + offs).reshape(b, -1)),
            "labels": T(labels), "labels_d": T(t2d_np[labels]), "eval_mask": T(eval_mask),
            "last": T(last),
            "prev_in": T(t2d_np[prev])}


def dspark_loss(model, batch, target_head, s: TrainSettings, gamma: int):
    """The DeepSpec DSpark loss on one batch; returns (loss, metrics dict).

    target_head: frozen target LM head rows of the draft vocabulary [V_out, d] (torch).
    """
    import torch
    from torch.nn import functional as F

    from .dspark_model import block_mask

    b, L = batch["ids"].shape
    A = batch["anchors"].shape[1]
    pos_ctx = torch.arange(L).expand(b, L)
    ctx_kv = model.context_kv(batch["feats"], pos_ctx)
    mask = block_mask(batch["anchors"], batch["keep"], L, gamma)
    h = model.block_hidden(batch["block_ids"], batch["block_pos"], ctx_kv, mask).view(b, A, gamma, -1)
    logits = model.lm_head(h)
    if model.markov_head is not None:
        logits = logits + model.markov_bias(batch["prev_in"], h)
    with torch.no_grad():
        # target_head None: batch["last"] already holds the target logits over the draft vocabulary
        t_logits = batch["last"] if target_head is None else batch["last"] @ target_head.T
        p_t = torch.softmax(t_logits.float(), dim=-1)
    logp_d = torch.log_softmax(logits.float(), dim=-1)
    p_d = logp_d.exp()
    w = batch["eval_mask"].float() * torch.exp(-torch.arange(gamma).float() / s.loss_decay_gamma)
    den = w.sum().clamp_min(1e-6)
    V = logits.shape[-1]
    lab = batch["labels_d"]
    in_vocab = lab < V
    ce = -(logp_d.gather(-1, lab.clamp(max=V - 1).unsqueeze(-1)).squeeze(-1)) * in_vocab
    l1 = (p_d - p_t).abs().sum(-1)
    acc = (1 - 0.5 * l1).clamp(0, 1).detach()
    loss = s.ce_alpha * (ce * w).sum() / den + s.l1_alpha * (l1 * w).sum() / den
    conf = model.confidence_logits(batch["prev_in"], h)
    if conf is not None:
        bce = F.binary_cross_entropy_with_logits(conf.float(), acc, reduction="none")
        loss = loss + s.conf_alpha * (bce * w).sum() / den
    with torch.no_grad():
        em = batch["eval_mask"]
        match = (logits.argmax(-1) == p_t.argmax(-1)) & em
        metrics = {"loss": float(loss), "l1": float((l1 * w).sum() / den),
                   "acc_pos": [float(match[..., k].sum() / em[..., k].sum().clamp_min(1)) for k in range(gamma)],
                   "n_blocks": int(em[..., 0].sum())}
        # greedy teacher-forced accepted length over full blocks (bonus included)
        full = em.all(-1)
        if full.any():
            metrics["tau_greedy"] = float((1 + match.int().cumprod(-1).sum(-1)[full].float()).mean())
    return loss, metrics


def train(store: FeatureStore, model, target_head, out_dir: Path, s: TrainSettings, *, gamma: int,
          mask_token: int, log=print) -> dict:
    """AdamW over the drafter's trainable parameters with held-out evaluation; checkpoints to ``out_dir``.

    The last ``s.eval_seqs`` sequences of the store are held out (never trained on). Returns the
    final metrics, including held-out per-position greedy acceptance and τ.
    """
    import torch
    from tqdm import tqdm

    from .dspark_model import save_checkpoint

    rng = np.random.default_rng(s.seed)
    torch.manual_seed(s.seed)
    n = len(store)
    held = list(range(max(0, n - s.eval_seqs), n))
    train_ids = list(range(0, max(0, n - s.eval_seqs)))
    if not train_ids:
        raise DSparkError("not enough sequences to train: extract more features")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay, betas=(0.9, 0.95))
    t2d = model.target_to_draft()

    def get(i):
        ids, m, f, l = store.get(i)
        if len(ids) > s.max_seq_len:
            a = int(rng.integers(0, len(ids) - s.max_seq_len + 1))
            ids, m, f, l = ids[a:a + s.max_seq_len], m[a:a + s.max_seq_len], f[a:a + s.max_seq_len], l[a:a + s.max_seq_len]
        return np.asarray(ids), np.asarray(m), np.asarray(f, np.float32), l

    def evaluate():
        model.eval()
        agg, tau, nb = np.zeros(gamma), [], 0
        erng = np.random.default_rng(1234)
        with torch.no_grad():
            for i in held:
                seq = get(i)
                an = sample_anchors(seq[1], s.anchors_per_seq, erng)
                if len(an) == 0:
                    continue
                batch = block_batch([seq], [an], gamma, mask_token, t2d)
                _, m = dspark_loss(model, batch, target_head, s, gamma)
                agg += np.asarray(m["acc_pos"]) * m["n_blocks"]
                nb += m["n_blocks"]
                if "tau_greedy" in m:
                    tau.append(m["tau_greedy"])
        model.train()
        return {"heldout_acc_pos": (agg / max(nb, 1)).round(3).tolist(),
                "heldout_tau_greedy": float(np.mean(tau)) if tau else float("nan")}

    t0 = last_save = time.perf_counter()
    step, hist = 0, []
    ev = evaluate()
    log(f"[train] {n - len(held)} train / {len(held)} held-out sequences, {store.num_tokens} tokens; "
        f"initial held-out {ev}")
    bar = tqdm(total=s.max_steps, desc="train-draft", file=sys.stderr, mininterval=10)
    model.train()
    while step < s.max_steps and time.perf_counter() - t0 < s.time_budget_s:
        lr = s.lr * min(1.0, (step + 1) / s.warmup_steps)
        frac = (time.perf_counter() - t0) / s.time_budget_s
        lr *= 0.5 * (1 + math.cos(math.pi * min(1.0, max(frac, step / s.max_steps))))  # cosine to 0
        for g in opt.param_groups:
            g["lr"] = lr
        seqs, ans = [], []
        for i in rng.choice(train_ids, size=s.seqs_per_step, replace=False):
            seq = get(int(i))
            an = sample_anchors(seq[1], s.anchors_per_seq, rng)
            if len(an):
                seqs.append(seq)
                ans.append(an)
        if not seqs:
            continue
        batch = block_batch(seqs, ans, gamma, mask_token, t2d)
        loss, m = dspark_loss(model, batch, target_head, s, gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        hist.append(m)
        bar.update(1)
        if step % 10 == 0:
            r = hist[-10:]
            bar.set_postfix(loss=f"{np.mean([x['loss'] for x in r]):.3f}",
                            acc1=f"{np.mean([x['acc_pos'][0] for x in r]):.2f}",
                            tau=f"{np.nanmean([x.get('tau_greedy', np.nan) for x in r]):.2f}")
        if step % s.eval_every == 0:
            ev = evaluate()
            log(f"[train] step {step} ({time.perf_counter() - t0:.0f} s) loss "
                f"{np.mean([x['loss'] for x in hist[-s.eval_every:]]):.3f} held-out {ev}")
        if time.perf_counter() - last_save > s.save_every_s:
            save_checkpoint(model, out_dir)
            last_save = time.perf_counter()
    bar.close()
    ev = evaluate()
    save_checkpoint(model, out_dir)
    res = {"steps": step, "seconds": time.perf_counter() - t0, **ev,
           "train_loss_last100": float(np.mean([x["loss"] for x in hist[-100:]])) if hist else None}
    (Path(out_dir) / "train_report.json").write_text(json.dumps(res, indent=2) + "\n")
    log(f"[train] done: {res}")
    return res


# ---------------------------------------------------------------------------------------------
# the whole pipeline (``dspark-export train-draft``)
# ---------------------------------------------------------------------------------------------

@dataclass
class PipelineSettings:
    """Budgets and sizes of ``train_draft_pipeline`` (defaults: ~2 h on a 2-core CPU for a 1.5B target)."""

    answers_budget_s: float = 2700.0  # target answers to training prompts (the bulk of useful data)
    answer_tokens: int = 256
    answer_batch: int = 24
    stdlib_tokens: int = 40000
    sharegpt_tokens: int = 40000
    max_seq_len: int = 1024
    features_budget_s: float = 2400.0
    feature_layers: tuple = (1, 13, 25)
    draft_vocab_size: int = 16384
    num_layers: int = 1
    intermediate_size: int = 3072
    block_size: int = 7
    markov_rank: int = 64
    markov_head_type: str = "vanilla"


def train_draft_pipeline(target_dir: Path, work_dir: Path, out_dir: Path, p: PipelineSettings,
                         s: TrainSettings, *, engine_dir: Path | None = None, skip_answers: bool = False,
                         log=print) -> dict:
    """Answers -> sequences -> feature cache -> draft vocabulary -> model -> training -> checkpoint.

    Every stage is resumable: answers and feature shards already on disk under ``work_dir`` are reused.
    ``engine_dir``: a built engine of the same target whose graph outputs ``p.feature_layers``; features
    and target logits then come from its ONNX Runtime graph (:func:`extract_features_ort`).
    Returns the training report (also written to ``out_dir/train_report.json``).
    """
    import torch
    from transformers import AutoTokenizer

    from .draft_data import generate_answers, generate_answers_engine
    from .draft_graph import target_frozen_weights
    from .dspark_model import DSparkDraftModel, qwen2_draft_config

    work_dir, out_dir = Path(work_dir), Path(out_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    answers = work_dir / "answers.jsonl"
    if not skip_answers and p.answers_budget_s > 0:
        log(f"[1/4] target answers to training prompts -> {answers} (budget {p.answers_budget_s:.0f} s"
            f"{', batched through the engine' if engine_dir is not None else ', transformers generate'})")
        if engine_dir is not None:  # ~3x faster on a CPU: the engine's batched target-only decoding
            generate_answers_engine(engine_dir, answers, max_new_tokens=p.answer_tokens, max_batch=p.answer_batch,
                                    time_budget_s=p.answers_budget_s, log=log)
        else:
            generate_answers(target_dir, answers, max_new_tokens=p.answer_tokens, batch_size=p.answer_batch,
                             time_budget_s=p.answers_budget_s)
    tok = AutoTokenizer.from_pretrained(target_dir)
    feat_dir = work_dir / "features"
    seq_file = work_dir / "sequences.npz"
    if seq_file.exists():
        z = np.load(seq_file, allow_pickle=False)
        cuts = z["starts"]
        seqs = [(z["ids"][a:b], z["mask"][a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    else:
        seqs = answer_sequences(answers, p.max_seq_len) if answers.exists() else []
        n_ans = sum(int(m.sum()) for _, m in seqs)
        other = stdlib_sequences(tok, p.stdlib_tokens, 512) + sharegpt_sequences(tok, p.sharegpt_tokens, p.max_seq_len)
        # interleave so a partial feature cache holds a mix of every source
        rng = random.Random(0)
        rng.shuffle(other)
        mixed, k = [], 0
        step = max(1, len(seqs) // max(1, len(other)))
        for i, s_ in enumerate(seqs):
            mixed.append(s_)
            if i % step == step - 1 and k < len(other):
                mixed.append(other[k])
                k += 1
        mixed += other[k:]
        seqs = mixed
        np.savez(seq_file, ids=np.concatenate([a for a, _ in seqs]), mask=np.concatenate([m for _, m in seqs]),
                 starts=np.cumsum([0] + [len(a) for a, _ in seqs]))
        log(f"[2/4] {len(seqs)} sequences, {sum(len(a) for a, _ in seqs)} tokens "
            f"({n_ans} answer tokens from the target)")
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    eos = [i for i in np.atleast_1d(cfg.get("eos_token_id") or []).tolist()]
    eos += [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>") if t in tok.get_vocab()]
    counts = np.bincount(np.concatenate([a for a, _ in seqs]), minlength=cfg["vocab_size"])
    vocab = choose_draft_vocab(counts, p.draft_vocab_size, always=eos) if p.draft_vocab_size else None
    log(f"[3/4] target features -> {feat_dir} (budget {p.features_budget_s:.0f} s)")
    if engine_dir is not None:
        if vocab is None:
            raise DSparkError("feature extraction through the engine stores logits over a reduced draft "
                              "vocabulary; give --draft-vocab > 0 or extract with torch (no --engine)")
        old_vocab = feat_dir / "draft_vocab.npy"
        if old_vocab.exists():
            vocab = np.load(old_vocab)  # resume with the vocabulary the cached logits were stored over
        extract_features_ort(engine_dir, seqs, feat_dir, vocab, time_budget_s=p.features_budget_s)
    else:
        extract_features(target_dir, seqs, feat_dir, list(p.feature_layers), time_budget_s=p.features_budget_s,
                         dtype="float32")
    store = FeatureStore(feat_dir)
    counts = store.token_counts(cfg["vocab_size"])
    mask_id = pick_mask_token(tok, counts)
    c = qwen2_draft_config(cfg, mask_token_id=mask_id, num_layers=p.num_layers, intermediate_size=p.intermediate_size,
                           block_size=p.block_size, target_layer_ids=p.feature_layers, markov_rank=p.markov_rank,
                           markov_head_type=p.markov_head_type, draft_vocab_size=None if vocab is None else len(vocab))
    torch.manual_seed(s.seed)
    model = DSparkDraftModel(c)
    emb, head = target_frozen_weights(target_dir)
    if vocab is not None:
        model.draft_vocab_ids.copy_(torch.as_tensor(vocab))
        target_head = None if store.aux == "tlogits" else head[model.draft_vocab_ids].clone()
        cover = float(counts[vocab].sum() / max(1, counts.sum()))
    else:
        target_head, cover = head, 1.0
    model.init_from_target(emb, head)
    del emb
    log(f"[4/4] training: {sum(p_.numel() for p_ in model.parameters() if p_.requires_grad) / 1e6:.1f} M trainable "
        f"parameters, draft vocabulary {c.out_vocab} ids covering {cover:.2%} of training tokens, "
        f"mask token {mask_id}, budget {s.time_budget_s:.0f} s")
    rep = train(store, model, target_head, out_dir, s, gamma=c.block_size, mask_token=mask_id, log=log)
    rep.update(data_tokens=store.num_tokens, data_sequences=len(store), vocab_coverage=cover,
               wall_seconds_total=time.perf_counter() - t0,
               checkpoint_bytes=sum(f.stat().st_size for f in out_dir.glob("*.safetensors")))
    (out_dir / "train_report.json").write_text(json.dumps(rep, indent=2) + "\n")
    return rep
