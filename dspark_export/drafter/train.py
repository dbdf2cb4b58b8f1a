"""Train a DSpark drafter on the CPU or an NVIDIA GPU (``TrainSettings.device``): anchor sampling, γ-blocks, the
DeepSpec loss and AdamW with resumable state (stage 4 of ``dspark-export train-draft``; the stages around it are
:mod:`dspark_export.drafter.pipeline`).

Loss (DeepSpec ``deepspec/modeling/dspark/loss.py``; DSpark paper §3.3): 0.1·CE + 0.9·‖p_d − p_t‖₁ + 1.0·BCE(c, c*)
with c* = 1 − ½‖p_d − p_t‖₁, position weights exp(−k/loss_decay_gamma), plus the MoE balancing loss for an MoE
drafter. Training reads the feature cache (:class:`dspark_export.drafter.features.FeatureStore`) and the target's
frozen LM head rows, never the target model itself.
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark_runtime.errors import DSparkError
from dspark_runtime.machine.sysinfo import cpu_features

from dspark_export.drafter.features import FeatureStore



# ---------------------------------------------------------------------------------------------
# 3. training
# ---------------------------------------------------------------------------------------------

@dataclass
class TrainSettings:
    """Training hyper-parameters (DeepSpec defaults where they exist)."""

    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_steps: int = 50  # at most a tenth of the run (:meth:`warmup`)
    anchors_per_seq: int = 32
    max_seq_len: int = 1024  # training crop (a random window of a longer sequence)
    eval_seq_len: int = 1024  # held-out crop (fixed, so runs with another training crop compare)
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
    # the training step's forward under torch.autocast(<device>, bfloat16) (fp32 master weights, optimizer and loss
    # reductions; held-out evaluation stays fp32, so figures compare across runs); see :func:`bf16_native`
    bf16: bool = False
    # the torch device of the training step and evaluation ("cpu", "cuda", "cuda:1"): the model and the frozen target
    # head move there, each batch is built on the CPU and copied; checkpoints are written from CPU copies (the
    # resumable train_state.pt keeps the device's tensors; resuming maps them to ``device``)
    device: str = "cpu"

    def total_steps(self, n_train: int) -> int:
        """Optimizer steps of the whole run over ``n_train`` training sequences (the cosine schedule's length)."""
        if self.epochs is None:
            return self.max_steps
        return max(1, min(self.max_steps, math.ceil(self.epochs * n_train / self.seqs_per_step)))

    def warmup(self, total: int) -> int:
        """Linear warmup steps of a ``total``-step run: ``warmup_steps``, but at most a tenth of the run (at least
        1), so a short run (an expensive objective on a CPU budget) still reaches its peak learning rate."""
        return max(1, min(self.warmup_steps, total // 10))

    def lr_at(self, step: int, total: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based) of a ``total``-step run: linear warmup
        (:meth:`warmup`), then cosine to 0 by ``total``."""
        lr = self.lr * min(1.0, (step + 1) / self.warmup(total))
        return lr * 0.5 * (1 + math.cos(math.pi * min(1.0, step / total)))


def bf16_native(flags=None) -> bool:
    """Whether this CPU multiplies bf16 matrices natively with AMX (``amx_bf16``): where a bf16-autocast training
    step pays (about twice as fast a step as fp32 there; docs/drafter.md). CPUs without it (AVX-512 BF16 only, or
    none) keep fp32 unless asked (``--bf16``).
    ``flags``: the ISA flags to read (default: this machine's, :func:`dspark_runtime.machine.sysinfo.cpu_features`)."""
    if flags is None:
        flags = cpu_features()["flags"]
    return "amx_bf16" in flags


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
    t2d_np = t2d.cpu().numpy()
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

    from dspark_export.drafter.model import block_mask

    b, L = batch["ids"].shape
    A = batch["anchors"].shape[1]
    dev = batch["ids"].device
    pos_ctx = torch.arange(L, device=dev).expand(b, L)
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
    w = batch["eval_mask"].float() * torch.exp(-torch.arange(gamma, device=dev).float() / s.loss_decay_gamma)
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


def _to(batch: dict, dev) -> dict:
    """``batch``'s tensors on ``dev`` (no copy for the CPU)."""
    return batch if dev.type == "cpu" else {k: v.to(dev, non_blocking=True) for k, v in batch.items()}


def _window(store, i: int, rng, crop: int) -> tuple:
    """Sequence ``i`` of ``store``, or a random window of ``crop`` tokens of it (drawn from ``rng``) when longer:
    (ids, mask, feats float32, aux)."""
    ids, m, f, l = store.get(i)
    if len(ids) > crop:
        a = int(rng.integers(0, len(ids) - crop + 1))
        ids, m, f, l = ids[a:a + crop], m[a:a + crop], f[a:a + crop], l[a:a + crop]
    return np.asarray(ids), np.asarray(m), np.asarray(f, np.float32), l


def heldout_acceptance(store, indices, model, target_head, s: TrainSettings, *, gamma: int, mask_token: int,
                       t2d=None) -> dict:
    """Teacher-forced greedy acceptance of ``model`` on the sequences ``indices`` of ``store`` (the held-out metric
    of :func:`train` and the training reports): a window of ``s.eval_seq_len`` tokens of each sequence and up to
    ``s.anchors_per_seq`` anchors, both drawn from a fixed seed, a block of ``gamma`` per anchor; position k
    accepted when the drafter's argmax equals the target's. ``model`` must be on ``s.device`` (``target_head`` is
    moved there); the model is left in train mode.

    Returns {"heldout_acc_pos": [gamma] acceptance by position (blocks whose label exists), "heldout_tau_greedy":
    mean accepted length + 1 over full blocks}.
    """
    import torch

    dev = torch.device(s.device)
    t2d = model.target_to_draft().cpu() if t2d is None else t2d
    target_head = None if target_head is None else target_head.to(dev)
    model.eval()
    agg, tau, nb = np.zeros(gamma), [], 0
    erng = np.random.default_rng(1234)
    with torch.no_grad():
        for i in indices:
            seq = _window(store, i, erng, s.eval_seq_len)
            an = sample_anchors(seq[1], s.anchors_per_seq, erng)
            if len(an) == 0:
                continue
            batch = _to(block_batch([seq], [an], gamma, mask_token, t2d), dev)
            _, met = dspark_loss(model, batch, target_head, s, gamma)
            agg += np.asarray(met["acc_pos"]) * met["n_blocks"]
            nb += met["n_blocks"]
            if "tau_greedy" in met:
                tau.append(met["tau_greedy"])
    model.train()
    return {"heldout_acc_pos": (agg / max(nb, 1)).round(3).tolist(),
            "heldout_tau_greedy": float(np.mean(tau)) if tau else float("nan")}


TRAIN_STATE = "train_state.pt"  # the resumable training state (model, optimizer, step), in the work directory


class Objective:
    """What one drafter family trains on (the loop, :func:`optimize`, is shared): ``batch`` builds a step's tensors
    from the step's windows, ``loss`` scores them, ``heldout`` measures the held-out sequences, ``save`` writes the
    family's checkpoint. ``name`` labels the progress bar."""

    name = "train-draft"

    def batch(self, seqs: list, rng: np.random.Generator):
        """A step's batch from ``seqs`` [(ids, mask, feats, aux)] (drawn with ``rng``), or None when nothing in them
        is trainable."""
        raise NotImplementedError

    def loss(self, model, batch) -> tuple:
        """(loss tensor, metrics {"loss", "acc_pos": [per position], ...}) of ``batch`` (on the training device)."""
        raise NotImplementedError

    def heldout(self, model, store, indices) -> dict:
        """{"heldout_acc_pos": [...], "heldout_tau_greedy": float} on the held-out sequences ``indices``."""
        raise NotImplementedError

    def save(self, model, out_dir: Path) -> None:
        """Write the checkpoint of ``model`` to ``out_dir``."""
        raise NotImplementedError


class DSparkObjective(Objective):
    """The DSpark / DFlash drafter's: anchors, γ-blocks (:func:`block_batch`) and :func:`dspark_loss`."""

    def __init__(self, model, target_head, s: TrainSettings, gamma: int, mask_token: int):
        self.s, self.gamma, self.mask_token = s, gamma, mask_token
        self.t2d = model.target_to_draft().cpu()  # built from draft_vocab_ids, used on the CPU
        self.target_head = target_head

    def batch(self, seqs, rng):
        seqs_an = [(q, sample_anchors(q[1], self.s.anchors_per_seq, rng)) for q in seqs]
        seqs_an = [(q, a) for q, a in seqs_an if len(a)]
        if not seqs_an:
            return None
        return block_batch([q for q, _ in seqs_an], [a for _, a in seqs_an], self.gamma, self.mask_token, self.t2d)

    def loss(self, model, batch):
        return dspark_loss(model, batch, self.target_head, self.s, self.gamma)

    def heldout(self, model, store, indices):
        return heldout_acceptance(store, indices, model, self.target_head, self.s, gamma=self.gamma,
                                  mask_token=self.mask_token, t2d=self.t2d)

    def save(self, model, out_dir):
        from dspark_export.drafter.checkpoint import save_checkpoint

        save_checkpoint(model, out_dir)


def train(store: FeatureStore, model, target_head, out_dir: Path, s: TrainSettings, *, gamma: int,
          mask_token: int, log=print, resume: Path | None = None) -> dict:
    """Train a DSpark (or DFlash) drafter: :func:`optimize` with :class:`DSparkObjective` (``target_head``: the
    frozen target LM head rows of the draft vocabulary [V_out, d], or None when the store holds target logits)."""
    import torch

    dev = torch.device(s.device)
    head = None if target_head is None else target_head.to(dev)
    return optimize(store, model, DSparkObjective(model, head, s, gamma, mask_token), out_dir, s, log=log,
                    resume=resume)


def optimize(store: FeatureStore, model, objective: Objective, out_dir: Path, s: TrainSettings, *, log=print,
             resume: Path | None = None) -> dict:
    """AdamW over the drafter's trainable parameters with held-out evaluation; checkpoints to ``out_dir``.

    The last ``s.eval_seqs`` sequences of the store are held out (never trained on). The run is
    ``s.total_steps(n_train)`` optimizer steps (warmup, then cosine to 0 by step); step k's sequences, crops and
    anchors are drawn from (seed, k) only, so a run stopped by ``s.time_budget_s`` (or killed) and resumed from
    ``resume`` (a :data:`TRAIN_STATE` file: model, optimizer, step, metrics; written every ``s.save_every_s``
    and when the budget ends) continues exactly where it stopped. A progress bar shows context tokens/s, loss,
    training and held-out position-1 acceptance. ``s.bf16``: the training forward runs under bf16 autocast (on
    ``s.device``), the weights, AdamW state and evaluation stay fp32. ``s.device``: the model moves there; batches
    are built on the CPU and copied.

    Returns the metrics of this call: {"steps" (done in total), "total_steps", "finished" (bool), "seconds",
    "train_tokens_per_s", held-out "heldout_acc_pos" and "heldout_tau_greedy", "train_loss_last100"}; the
    checkpoint in ``out_dir`` is written when the run finishes (and at every save, so an interrupted run leaves
    a usable one). Raises DSparkError when the store has no training sequences.
    """
    import torch
    from tqdm import tqdm

    n = len(store)
    held = list(range(max(0, n - s.eval_seqs), n))
    train_ids = list(range(0, max(0, n - s.eval_seqs)))
    if not train_ids:
        raise DSparkError("not enough sequences to train: extract more features")
    total = s.total_steps(len(train_ids))
    dev = torch.device(s.device)
    model.to(dev)  # before the optimizer takes the parameters
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay, betas=(0.9, 0.95))
    step, hist, spent = 0, [], 0.0
    if resume is not None and Path(resume).is_file():
        st = torch.load(resume, weights_only=False, map_location=dev)
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

    def evaluate():
        return objective.heldout(model, store, held)

    t0 = last_save = time.perf_counter()
    tokens = 0
    ev = evaluate()
    log(f"[train] {n - len(held)} train / {len(held)} held-out sequences, {store.num_tokens} tokens; "
        f"{total} steps ({s.seqs_per_step} sequences each, {'bf16 autocast' if s.bf16 else 'fp32'}); "
        f"held-out at step {step}: {ev}")
    bar = tqdm(total=total, initial=step, desc=objective.name, file=sys.stderr, mininterval=10)
    model.train()
    while step < total and time.perf_counter() - t0 < s.time_budget_s:
        lr = s.lr_at(step, total)
        for g in opt.param_groups:
            g["lr"] = lr
        rng = np.random.default_rng([s.seed, 1 << 20, step])
        seqs = [_window(store, train_ids[int(i)], rng, s.max_seq_len)
                for i in _step_sequences(step, len(train_ids), s.seqs_per_step, s.seed)]
        batch = objective.batch(seqs, rng)
        step += 1
        if batch is None:
            continue
        batch = _to(batch, dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=s.bf16):
            loss, m = objective.loss(model, batch)
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
            objective.save(model, out_dir)
            save_state()
            last_save = time.perf_counter()
    bar.close()
    ev = evaluate()
    objective.save(model, out_dir)
    save_state()
    dt = time.perf_counter() - t0
    res = {"steps": step, "total_steps": total, "finished": step >= total, "seconds": spent + dt,
           "train_tokens_per_s": tokens / dt if dt > 0 else 0.0, **ev,
           "train_loss_last100": float(np.mean([x["loss"] for x in hist[-100:]])) if hist else None}
    (Path(out_dir) / "train_report.json").write_text(json.dumps(res, indent=2) + "\n")
    log(f"[train] {'done' if res['finished'] else f'stopped at step {step}/{total} (resume to continue)'}: {res}")
    return res
