"""Train a DSpark drafter on this CPU: anchor sampling, the DeepSpec loss, AdamW, and the resumable pipeline that
runs the stages (sequences and the feature cache are :mod:`dspark_export.draft_features`, answers
:mod:`dspark_export.draft_data`).

Pipeline (``dspark-export train-draft``, :func:`train_draft_pipeline`; the run's state in ``WORK/state.json``,
:class:`RunState`): 1. answers — the target's own greedy answers to training prompts; 2. sequences — those plus
the Python standard library's source and ShareGPT chat turns teacher-forced through the target (loss on the
answer / all / the assistant tokens); 3. features — one teacher-forced target pass per sequence storing the
``target_layer_ids`` features and the target's logits over the draft vocabulary (or its final hidden state) in
fp16 shards; 4. train (:func:`train`) — sample anchors, build γ-blocks, loss 0.1·CE + 0.9·‖p_d − p_t‖₁ +
1.0·BCE(c, c*) with c* = 1 − ½‖p_d − p_t‖₁ and position weights exp(−k/loss_decay_gamma) (DeepSpec
``deepspec/modeling/dspark/loss.py``; DSpark paper §3.3), plus the MoE balancing loss for an MoE drafter;
5. calibrate — compile into the engine, STS temperatures and router priors on the calibration split.
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
    time_budget_s: float = 3600.0  # this call's wall-clock cap; a run stopped by it resumes (``train(resume=...)``)
    max_steps: int = 100000
    epochs: float | None = None  # run length in passes over the training sequences (None: ``max_steps``)
    eval_every: int = 100
    eval_seqs: int = 24
    save_every_s: float = 600.0
    seed: int = 0
    moe_aux_alpha: float = 0.01  # weight of the MoE load-balancing loss (MoE drafters only)

    def total_steps(self, n_train: int) -> int:
        """Optimizer steps of the whole run over ``n_train`` training sequences (the cosine schedule's length)."""
        if self.epochs is None:
            return self.max_steps
        return max(1, min(self.max_steps, math.ceil(self.epochs * n_train / self.seqs_per_step)))


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
    """The DeepSpec DSpark loss on one batch (+ ``s.moe_aux_alpha`` × the MoE load-balancing loss for an MoE
    drafter, :meth:`DSparkDraftModel.moe_aux_loss`); returns (loss, metrics dict).

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
    aux = None
    if model.config.draft_moe_experts and s.moe_aux_alpha:  # the router probabilities of this forward
        aux = model.moe_aux_loss(batch["keep"][:, :, None].expand(-1, -1, gamma))
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
    if aux is not None:
        loss = loss + s.moe_aux_alpha * aux
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


def _step_sequences(step: int, n_train: int, per_step: int, seed: int) -> np.ndarray:
    """Indices (into the training ids) of the sequences of optimizer step ``step``: epoch e = step·per_step //
    n_train walks a permutation drawn from (seed, e), so the order depends only on the step (resumable)."""
    out, k = [], step * per_step
    for j in range(k, k + per_step):
        e, i = divmod(j, n_train)
        out.append(np.random.default_rng([seed, e]).permutation(n_train)[i])
    return np.asarray(out)


TRAIN_STATE = "train_state.pt"  # the resumable training state (model, optimizer, step), in the work directory


def train(store: FeatureStore, model, target_head, out_dir: Path, s: TrainSettings, *, gamma: int,
          mask_token: int, log=print, resume: Path | None = None) -> dict:
    """AdamW over the drafter's trainable parameters with held-out evaluation; checkpoints to ``out_dir``.

    The last ``s.eval_seqs`` sequences of the store are held out (never trained on). The run is
    ``s.total_steps(n_train)`` optimizer steps (warmup, then cosine to 0 by step); step k's sequences, crops and
    anchors are drawn from (seed, k) only, so a run stopped by ``s.time_budget_s`` (or killed) and resumed from
    ``resume`` (a :data:`TRAIN_STATE` file: model, optimizer, step, metrics; written every ``s.save_every_s``
    and when the budget ends) continues exactly where it stopped. A progress bar shows context tokens/s, loss,
    training and held-out position-1 acceptance.

    Returns the metrics of this call: {"steps" (done in total), "total_steps", "finished" (bool), "seconds",
    "train_tokens_per_s", held-out "heldout_acc_pos" [γ] and "heldout_tau_greedy", "train_loss_last100"}; the
    checkpoint in ``out_dir`` is written when the run finishes (and at every save, so an interrupted run leaves
    a usable one). Raises DSparkError when the store has no training sequences.
    """
    import torch
    from tqdm import tqdm

    from .dspark_model import save_checkpoint

    n = len(store)
    held = list(range(max(0, n - s.eval_seqs), n))
    train_ids = list(range(0, max(0, n - s.eval_seqs)))
    if not train_ids:
        raise DSparkError("not enough sequences to train: extract more features")
    total = s.total_steps(len(train_ids))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay, betas=(0.9, 0.95))
    t2d = model.target_to_draft()
    step, hist, spent = 0, [], 0.0
    if resume is not None and Path(resume).is_file():
        st = torch.load(resume, weights_only=False)
        model.load_state_dict(st["model"], strict=False)
        opt.load_state_dict(st["optimizer"])
        step, hist, spent = int(st["step"]), list(st["hist"]), float(st["seconds"])
        log(f"[train] resumed at step {step}/{total} ({spent:.0f} s trained so far)")

    def save_state():
        if resume is None:
            return
        trainable = {k for k, p in model.named_parameters() if p.requires_grad}
        st = {"model": {k: v for k, v in model.state_dict().items() if k in trainable},
              "optimizer": opt.state_dict(), "step": step, "hist": hist[-200:],
              "seconds": spent + time.perf_counter() - t0}
        tmp = Path(resume).with_suffix(".tmp")
        torch.save(st, tmp)
        tmp.replace(resume)

    def get(i, rng):
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
                seq = get(i, erng)
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
    tokens = 0
    ev = evaluate()
    log(f"[train] {n - len(held)} train / {len(held)} held-out sequences, {store.num_tokens} tokens; "
        f"{total} steps ({s.seqs_per_step} sequences each); held-out at step {step}: {ev}")
    bar = tqdm(total=total, initial=step, desc="train-draft", file=sys.stderr, mininterval=10)
    model.train()
    while step < total and time.perf_counter() - t0 < s.time_budget_s:
        lr = s.lr * min(1.0, (step + 1) / s.warmup_steps)
        lr *= 0.5 * (1 + math.cos(math.pi * min(1.0, step / total)))  # cosine to 0 over the run
        for g in opt.param_groups:
            g["lr"] = lr
        rng = np.random.default_rng([s.seed, 1 << 20, step])
        seqs, ans = [], []
        for i in _step_sequences(step, len(train_ids), s.seqs_per_step, s.seed):
            seq = get(train_ids[int(i)], rng)
            an = sample_anchors(seq[1], s.anchors_per_seq, rng)
            if len(an):
                seqs.append(seq)
                ans.append(an)
        step += 1
        if not seqs:
            continue
        batch = block_batch(seqs, ans, gamma, mask_token, t2d)
        loss, m = dspark_loss(model, batch, target_head, s, gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        hist.append(m)
        tokens += sum(len(q[0]) for q in seqs)
        bar.update(1)
        if step % 10 == 0:
            r = hist[-10:]
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - t0):.0f}",
                            loss=f"{np.mean([x['loss'] for x in r]):.3f}",
                            acc1=f"{np.mean([x['acc_pos'][0] for x in r]):.2f}",
                            heldout_acc1=f"{ev['heldout_acc_pos'][0]:.2f}")
        if step % s.eval_every == 0:
            ev = evaluate()
            log(f"[train] step {step}/{total} ({time.perf_counter() - t0:.0f} s, "
                f"{tokens / (time.perf_counter() - t0):.0f} tok/s) loss "
                f"{np.mean([x['loss'] for x in hist[-s.eval_every:]]):.3f} held-out {ev}")
        if time.perf_counter() - last_save > s.save_every_s:
            save_checkpoint(model, out_dir)
            save_state()
            last_save = time.perf_counter()
    bar.close()
    ev = evaluate()
    save_checkpoint(model, out_dir)
    save_state()
    dt = time.perf_counter() - t0
    res = {"steps": step, "total_steps": total, "finished": step >= total, "seconds": spent + dt,
           "train_tokens_per_s": tokens / dt if dt > 0 else 0.0, **ev,
           "train_loss_last100": float(np.mean([x["loss"] for x in hist[-100:]])) if hist else None}
    (Path(out_dir) / "train_report.json").write_text(json.dumps(res, indent=2) + "\n")
    log(f"[train] {'done' if res['finished'] else f'stopped at step {step}/{total} (resume to continue)'}: {res}")
    return res


# ---------------------------------------------------------------------------------------------
# the whole pipeline (``dspark-export train-draft``)
# ---------------------------------------------------------------------------------------------

@dataclass
class PipelineSettings:
    """Sizes of ``train_draft_pipeline``'s stages (what the run is; :class:`TrainSettings` is how it trains)."""

    answer_prompts: int | None = None  # training prompts the target answers (None: all of them)
    answer_tokens: int = 256
    answer_batch: int = 8
    sharegpt_prompts: int = 500  # ShareGPT first turns among the prompts the target answers
    stdlib_tokens: int = 40000
    sharegpt_tokens: int = 40000
    max_seq_len: int = 1024
    feature_layers: tuple = (1, 13, 25)
    draft_vocab_size: int = 16384
    num_layers: int = 1
    intermediate_size: int = 3072
    block_size: int = 7
    markov_rank: int = 64
    markov_head_type: str = "vanilla"
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_intermediate_size: int | None = None
    mask_token_id: int | None = None  # the block's mask token (None: an unused special token of the tokenizer)


STATE_FILE = "state.json"  # the run's settings and each stage's progress, in the work directory
STAGES = ("answers", "sequences", "features", "train", "calibrate")


class RunState:
    """The resumable run in a work directory (``state.json``): target, engine, checkpoint folder, the settings it
    was started with, and per stage {"done", "seconds", figures}. Written atomically after every stage step."""

    def __init__(self, work_dir: Path, data: dict):
        self.path = Path(work_dir) / STATE_FILE
        self.data = data

    @classmethod
    def open(cls, work_dir: Path, fresh: dict | None) -> "RunState":
        """The run in ``work_dir``: resumed (``fresh`` None) or started from ``fresh`` (target, engine, out,
        pipeline, train). Raises DSparkError when resuming a directory with no run, or starting one over a run
        with other settings (naming them and the fix)."""
        path = Path(work_dir) / STATE_FILE
        old = json.loads(path.read_text()) if path.is_file() else None
        if fresh is None:
            if old is None:
                raise DSparkError(f"{work_dir} holds no train-draft run ({STATE_FILE} missing); start one with "
                                  "`dspark-export train-draft --out CKPT --work DIR`")
            return cls(work_dir, old)
        if old is not None:
            diff = [f"{sec}.{k}" for sec in ("pipeline", "train") for k in fresh[sec]
                    if k != "time_budget_s" and old[sec].get(k) != fresh[sec][k]]
            diff += [k for k in ("target", "engine", "out") if old.get(k) != fresh[k]]
            if diff:
                raise DSparkError(f"{work_dir} holds a train-draft run started with other settings "
                                  f"({', '.join(diff)}); continue it with `dspark-export train-draft --resume "
                                  f"{work_dir}`, or pick another --work directory")
            return cls(work_dir, old)
        st = cls(work_dir, {"version": 1, **fresh, "stages": {}})
        st.save()
        return st

    def stage(self, name: str) -> dict:
        return self.data["stages"].setdefault(name, {"done": False, "seconds": 0.0})

    def progress(self, st: dict, seconds: float, new_tokens: int, complete: bool) -> bool:
        """Add one call's ``seconds`` and ``new_tokens`` to the stage record ``st`` (its tokens/s over all calls),
        mark it done when ``complete``, save; returns whether the stage is done."""
        st["seconds"] += seconds
        st["new_tokens"] = st.get("new_tokens", 0) + int(new_tokens)
        st["tokens_per_s"] = st["new_tokens"] / max(st["seconds"], 1e-9)
        st["done"] = bool(complete)
        self.save()
        return st["done"]

    def save(self) -> None:
        from dspark_runtime.manifest import atomic_write_text

        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps(self.data, indent=2) + "\n")


def train_draft_pipeline(target_dir: Path, work_dir: Path, out_dir: Path | None, p: PipelineSettings | None,
                         s: TrainSettings | None, *, engine_dir: Path | None = None, time_limit_s: float | None = None,
                         compile_into_engine: bool = True, seed_answers: Path | None = None, log=print) -> dict:
    """Answers -> sequences -> feature cache -> training -> calibration, resumable in stages.

    The run lives in ``work_dir`` (:class:`RunState`): with ``p``/``s`` None it is resumed as it was started
    (``dspark-export train-draft --resume WORK``). Stages, in order, each skipped once done:

    1. answers: the target's greedy answers to the training prompts (never a calibration or evaluation prompt)
       through ``engine_dir``'s batched runtime (target-only, continuous batching; transformers ``generate``
       without an engine), appended per group to ``answers.jsonl``;
    2. sequences: those answers plus standard-library source and ShareGPT assistant turns, mixed
       (``sequences.npz``); the draft vocabulary is chosen from their counts;
    3. features: one teacher-forced target pass per sequence (the engine's own graph: the deployed int4 target's
       features and logits over the draft vocabulary), fp16 shards under ``features/``;
    4. train: :func:`train` to ``s.epochs`` (or ``s.max_steps``), state in ``train_state.pt``;
    5. calibrate (``engine_dir`` and ``compile_into_engine``): the checkpoint compiled into ``engine_dir``
       (:func:`dspark_export.add_draft.add_dspark_draft`) and its STS temperatures and router priors fitted on the
       calibration split (:func:`dspark_export.calibrate.calibrate_engine`, also written to the checkpoint's
       ``sts.json``).

    ``time_limit_s``: this call stops (state saved) when it has run that long; calling again resumes.
    ``seed_answers``: a JSONL (or .jsonl.gz) file of answers from an earlier run (:func:`import_answers`) added to
    the work directory before stage 1, which then answers only the prompts it lacks.
    Returns {"finished", "stages" (per stage: seconds and figures), "train" (the last training report, or None),
    "checkpoint_bytes"}; a finished run also writes ``out_dir/train_report.json`` with the data sizes by source,
    wall time per stage and the machine.
    """
    import torch
    from transformers import AutoTokenizer

    from .draft_data import generate_answers, generate_answers_engine
    from .draft_graph import target_frozen_weights
    from .dspark_model import DSparkDraftModel, qwen2_draft_config

    work_dir = Path(work_dir)
    fresh = None
    if p is not None:
        from dataclasses import asdict

        fresh = {"target": str(target_dir), "engine": None if engine_dir is None else str(engine_dir),
                 "out": str(out_dir), "pipeline": asdict(p), "train": asdict(s)}
        fresh["pipeline"]["feature_layers"] = list(p.feature_layers)
    state = RunState.open(work_dir, fresh)
    d = state.data
    p = PipelineSettings(**{**d["pipeline"], "feature_layers": tuple(d["pipeline"]["feature_layers"])})
    s = TrainSettings(**d["train"])
    target_dir, out_dir = Path(d["target"]), Path(d["out"])
    engine_dir = None if d["engine"] is None else Path(d["engine"])
    t_call = time.perf_counter()

    def left() -> float | None:
        return None if time_limit_s is None else time_limit_s - (time.perf_counter() - t_call)

    def stopped(stage: str) -> dict:
        state.save()
        log(f"[{stage}] time limit reached; continue with `dspark-export train-draft --resume {work_dir}`")
        return {"finished": False, "stages": d["stages"], "train": d["stages"].get("train", {}).get("report"),
                "checkpoint_bytes": None}

    # 1. answers
    answers = work_dir / "answers.jsonl"
    st = state.stage("answers")
    if seed_answers is not None and not st["done"]:
        n_seed = import_answers(Path(seed_answers), answers)
        st["seeded"] = st.get("seeded", 0) + n_seed
        state.save()
        log(f"[1/5] {n_seed} answers imported from {seed_answers}")
    if not st["done"]:
        log(f"[1/5] target answers to training prompts -> {answers}"
            f"{' (batched through the engine)' if engine_dir is not None else ' (transformers generate)'}")
        t = time.perf_counter()
        if engine_dir is not None:
            r = generate_answers_engine(engine_dir, answers, max_new_tokens=p.answer_tokens, max_batch=p.answer_batch,
                                        limit=p.answer_prompts, time_budget_s=left(),
                                        n_sharegpt=p.sharegpt_prompts, log=log)
        else:
            r = generate_answers(target_dir, answers, max_new_tokens=p.answer_tokens, batch_size=p.answer_batch,
                                 limit=p.answer_prompts, time_budget_s=left(), n_sharegpt=p.sharegpt_prompts)
        st["prompts"] = r["prompts"]
        if not state.progress(st, time.perf_counter() - t, r["new_tokens"], r.get("complete", True)):
            return stopped("answers")
    tok = AutoTokenizer.from_pretrained(target_dir)
    cfg = json.loads((Path(target_dir) / "config.json").read_text())

    # 2. sequences (+ the draft vocabulary)
    seq_file = work_dir / "sequences.npz"
    st = state.stage("sequences")
    if not seq_file.exists():
        t = time.perf_counter()
        ans = answer_sequences(answers, p.max_seq_len) if answers.exists() else []
        src_tokens = {"answers": sum(int(m.sum()) for _, m in ans)}
        lib = stdlib_sequences(tok, p.stdlib_tokens, 512)
        chat = sharegpt_sequences(tok, p.sharegpt_tokens, p.max_seq_len)
        src_tokens["stdlib"] = sum(int(m.sum()) for _, m in lib)
        src_tokens["sharegpt_teacher_forced"] = sum(int(m.sum()) for _, m in chat)
        seqs = _mix(ans, lib + chat)
        np.savez(seq_file, ids=np.concatenate([a for a, _ in seqs]), mask=np.concatenate([m for _, m in seqs]),
                 starts=np.cumsum([0] + [len(a) for a, _ in seqs]))
        st.update(done=True, seconds=time.perf_counter() - t, sequences=len(seqs),
                  tokens=int(sum(len(a) for a, _ in seqs)), loss_tokens_by_source=src_tokens)
        state.save()
        log(f"[2/5] {len(seqs)} sequences, {st['tokens']} tokens; loss tokens by source {src_tokens}")
    z = np.load(seq_file, allow_pickle=False)
    cuts = z["starts"]
    seqs = [(z["ids"][a:b], z["mask"][a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    eos = [i for i in np.atleast_1d(cfg.get("eos_token_id") or []).tolist()]
    eos += [tok.convert_tokens_to_ids(t_) for t_ in ("<|im_end|>", "<|endoftext|>") if t_ in tok.get_vocab()]
    counts = np.bincount(np.concatenate([a for a, _ in seqs]), minlength=cfg["vocab_size"])
    vocab = choose_draft_vocab(counts, p.draft_vocab_size, always=eos) if p.draft_vocab_size else None

    # 3. features
    feat_dir = work_dir / "features"
    st = state.stage("features")
    if not st["done"]:
        log(f"[3/5] target features -> {feat_dir}")
        t = time.perf_counter()
        if engine_dir is not None:
            if vocab is None:
                raise DSparkError("feature extraction through the engine stores logits over a reduced draft "
                                  "vocabulary; give --draft-vocab > 0 or extract with torch (no --engine)")
            if (feat_dir / "draft_vocab.npy").exists():
                vocab = np.load(feat_dir / "draft_vocab.npy")  # the vocabulary the cached logits were stored over
            r = extract_features_ort(engine_dir, seqs, feat_dir, vocab, time_budget_s=left())
        else:
            r = extract_features(target_dir, seqs, feat_dir, list(p.feature_layers), time_budget_s=left(),
                                 dtype="float32")
        if not state.progress(st, time.perf_counter() - t, r["tokens"], r.get("complete", True)):
            return stopped("features")
    elif engine_dir is not None and (feat_dir / "draft_vocab.npy").exists():
        vocab = np.load(feat_dir / "draft_vocab.npy")

    # 4. train
    store = FeatureStore(feat_dir)
    st = state.stage("train")
    if not st["done"]:
        counts = store.token_counts(cfg["vocab_size"])
        mask_id = pick_mask_token(tok, counts) if p.mask_token_id is None else int(p.mask_token_id)
        c = qwen2_draft_config(cfg, mask_token_id=mask_id, num_layers=p.num_layers,
                               intermediate_size=p.intermediate_size, block_size=p.block_size,
                               target_layer_ids=p.feature_layers, markov_rank=p.markov_rank,
                               markov_head_type=p.markov_head_type,
                               draft_vocab_size=None if vocab is None else len(vocab),
                               **_moe_kwargs(p))
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
        log(f"[4/5] training: {sum(q.numel() for q in model.parameters() if q.requires_grad) / 1e6:.1f} M trainable "
            f"parameters, draft vocabulary {c.out_vocab} ids covering {cover:.2%} of training tokens, "
            f"mask token {mask_id}")
        budget = left()
        s.time_budget_s = min(s.time_budget_s, budget) if budget is not None else s.time_budget_s
        t = time.perf_counter()
        rep = train(store, model, target_head, out_dir, s, gamma=c.block_size, mask_token=mask_id, log=log,
                    resume=work_dir / TRAIN_STATE)
        st["seconds"] += time.perf_counter() - t
        st.update(done=rep["finished"], report=rep, vocab_coverage=cover, tokens=store.num_tokens)
        state.save()
        if not st["done"]:
            return stopped("train")

    # 5. calibrate (compile into the engine, fit STS and the router priors on the calibration split)
    st = state.stage("calibrate")
    if not st["done"] and engine_dir is not None and compile_into_engine:
        from .add_draft import add_dspark_draft
        from .calibrate import calibrate_engine

        t = time.perf_counter()
        log(f"[5/5] compiling {out_dir} into {engine_dir} and calibrating it")
        add_dspark_draft(engine_dir, out_dir, str(target_dir), log=log)
        cal = calibrate_engine(engine_dir, log=log)
        st.update(done=True, seconds=time.perf_counter() - t, rounds=cal["rounds"],
                  temperatures=cal["temperatures"])
        state.save()
    from dspark_runtime.sysinfo import cpu_features

    report = {"stages": d["stages"], "settings": {"pipeline": d["pipeline"], "train": d["train"]},
              "machine": cpu_features(),
              "checkpoint_bytes": sum(f.stat().st_size for f in out_dir.glob("*.safetensors"))}
    (out_dir / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return {"finished": True, "stages": d["stages"], "train": d["stages"]["train"].get("report"),
            "checkpoint_bytes": report["checkpoint_bytes"]}


def import_answers(src: Path, answers: Path) -> int:
    """Append to ``answers`` the records of ``src`` (JSONL, gzip when it ends in .gz; the format of
    :func:`dspark_export.draft_data.generate_answers_engine`) whose key it lacks; returns how many. Records whose
    key is not a training prompt are refused, so a file can never bring a calibration or evaluation prompt in.
    Raises DSparkError naming the file and line of a malformed record."""
    import gzip

    from .draft_data import TRAIN_SPLIT, done_keys, split_prompts

    split = {k for group in split_prompts(TRAIN_SPLIT).values() for k, _ in group}
    allowed = lambda k: k in split or str(k).startswith("sharegpt:")  # noqa: E731
    have = done_keys(answers)
    opener = gzip.open if str(src).endswith(".gz") else open
    new = []
    with opener(src, "rt") as f:
        for i, line in enumerate(f, 1):
            try:
                r = json.loads(line)
                key, ids, n = r["key"], r["ids"], int(r["prompt_len"])
                ok = isinstance(ids, list) and 0 < n <= len(ids)
            except (ValueError, KeyError, TypeError):
                ok = False
            if not ok:
                raise DSparkError(f"{src} line {i}: not an answer record (key, source, ids, prompt_len)")
            if not allowed(key):
                raise DSparkError(f"{src} line {i}: {key!r} is not a training prompt; answers files may only hold "
                                  "the training split and ShareGPT prompts")
            if key not in have:
                have.add(key)
                new.append(line if line.endswith("\n") else line + "\n")
    answers.parent.mkdir(parents=True, exist_ok=True)
    with answers.open("a") as f:
        f.writelines(new)
    return len(new)


def _mix(answers: list, other: list) -> list:
    """``answers`` with ``other`` spread evenly among them (shuffled with a fixed seed), so a partial feature cache
    holds a mix of every source."""
    other = list(other)
    random.Random(0).shuffle(other)
    mixed, k = [], 0
    step = max(1, len(answers) // max(1, len(other)))
    for i, a in enumerate(answers):
        mixed.append(a)
        if i % step == step - 1 and k < len(other):
            mixed.append(other[k])
            k += 1
    return mixed + other[k:]


def _moe_kwargs(p: PipelineSettings) -> dict:
    """``qwen2_draft_config``'s MoE arguments for ``p`` (none for a dense drafter)."""
    if not p.moe_experts:
        return {}
    return {"moe_experts": p.moe_experts, "moe_top_k": p.moe_top_k, "moe_intermediate_size": p.moe_intermediate_size}
