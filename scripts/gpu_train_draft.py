"""Train a DSpark, DFlash or EAGLE-3 drafter on one NVIDIA GPU from the target's GGUF and token sequences.

    python scripts/gpu_train_draft.py --gguf TARGET.gguf --data DATA.npz --out OUT_DIR [--minutes 5] [--deadline-s S]
        [--method eagle3] [--init CKPT]

From the repository root with the project installed (``pip install -e .``), or with ``PYTHONPATH=.`` (a GPU machine).

What the CPU pipeline (``dspark-export train-draft``) does in stages over hours, at GPU speed, for a machine that
has the target as a GGUF file and nothing else (no engine, no Hugging Face folder):

0. optionally (``--answer-minutes``), the target's own answers to DATA's ``prompts`` (greedy, or ``--answer-samples``
   sampled answers a prompt), generated on the GPU (:func:`dspark_export.drafter.data.answer_prompts`; the GGUF's
   tokenizer and chat template) and added to the training sequences;
1. the target: the GGUF dequantized by transformers (the same weights ``dspark-export fetch`` converts and the
   int4 engine packs, :mod:`dspark_export.precision.nbits`), on the GPU in float32 with TF32 matrix products;
2. features: one teacher-forced pass over every sequence (batched by length, right-padded) keeping the
   ``target_layer_ids`` features and the final normed hidden state in fp16 host memory;
3. training: :func:`dspark_export.drafter.train.optimize` on the GPU (``TrainSettings.device``), bf16 autocast,
   with the DSpark objective (``--method dspark``: DATA's ``config``, DSpark or DFlash) or EAGLE-3's (``--method
   eagle3``: one layer fusing the same target layers, ``--ttt-length`` steps, a head over DATA's draft vocabulary),
   until ``--minutes`` or ``--deadline-s`` (seconds since start) run out, the held-out sequences evaluated every
   ``--eval-every`` steps; the checkpoint (``config.json`` + weights: DeepSpec's layout, SpecForge's for EAGLE-3)
   and a report (``gpu_train_report.json``: tokens, seconds and tokens/s per stage, held-out acceptance by
   position).

DATA.npz: ``ids`` int32 [n], ``mask`` uint8 [n] (loss positions), ``starts`` int64 [s+1] (training sequences);
``held_ids``/``held_mask``/``held_starts`` (held-out, never trained on); ``draft_vocab_ids`` int64 [V_d] and
``config`` (the bytes of a drafter ``config.json``: the architecture to train, e.g. the shipped drafter's, so the
result drops into an engine with ``dspark-export add-draft``); optionally ``prompts`` (the bytes of a JSON list of
[source, key, text], ``scripts/gpu_draft_data.py --answer-prompts``).

Training starts from scratch, or with ``--init CKPT`` from an earlier run's weights (a checkpoint of DATA's ``config``
and draft vocabulary, e.g. what the previous GPU session brought back), under a fresh schedule and optimizer. The
checkpoint is written in Hugging Face shards of at most ``--shard-mib`` MiB (``model-0000i-of-0000n.safetensors`` +
``model.safetensors.index.json``; 0: one ``model.safetensors``), so a machine that returns small files only can hand
every piece back; ``dspark-export add-draft`` and ``--init`` read the folder as it is.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

T0 = time.perf_counter()


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


class MemoryStore:
    """The :class:`dspark_export.drafter.features.FeatureStore` interface over in-memory arrays."""

    aux = "last"

    def __init__(self, seqs: list):
        self.seqs = seqs  # [(ids int32 [n], mask uint8 [n], feats fp16 [n, F], last fp16 [n, d])]

    def __len__(self):
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return int(sum(len(s[0]) for s in self.seqs))

    def get(self, i: int):
        return self.seqs[i]


def split(ids, mask, starts) -> list:
    return [(ids[a:b], mask[a:b]) for a, b in zip(starts[:-1], starts[1:])]


def load_target(gguf: Path):
    import torch
    from transformers import AutoModelForCausalLM
    kw = {"gguf_file": gguf.name}
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
    except TypeError:  # transformers < 4.56 names it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), torch_dtype=torch.float32, **kw)
    return model


def features(model, seqs: list, layer_ids: list, max_batch_tokens: int) -> list:
    """Teacher-forced features of ``seqs`` [(ids, mask)] -> [(ids, mask, feats fp16, last fp16)], input order."""
    import torch
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))
    out = [None] * len(seqs)
    dev = next(model.parameters()).device
    k = 0
    while k < len(order):
        L = len(seqs[order[k]][0])
        nb = max(1, max_batch_tokens // L)
        idx = order[k:k + nb]
        k += nb
        ids = np.zeros((len(idx), L), np.int64)
        att = np.zeros((len(idx), L), np.int64)
        for r, i in enumerate(idx):
            n = len(seqs[i][0])
            ids[r, :n], att[r, :n] = seqs[i][0], 1
        with torch.inference_mode():
            o = model.model(input_ids=torch.as_tensor(ids, device=dev), attention_mask=torch.as_tensor(att, device=dev),
                            output_hidden_states=True)
            hs = o.hidden_states
            f = torch.cat([hs[j + 1] for j in layer_ids], dim=-1).to(torch.float16).cpu().numpy()
            last = o.last_hidden_state.to(torch.float16).cpu().numpy()
        for r, i in enumerate(idx):
            n = len(seqs[i][0])
            out[i] = (seqs[i][0], seqs[i][1], f[r, :n], last[r, :n])
    return out


def step_rate(model, objective, store, s, n: int = 12) -> float:
    """Training steps per second of ``objective`` (the same batch shapes as the training loop), timed on a copy of
    ``model``."""
    import copy
    import torch
    from dspark_export.drafter.train import _to, _window
    dev = torch.device(s.device)
    m = copy.deepcopy(model)
    m.to(dev).train()
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-6)
    rng = np.random.default_rng(7)
    t = None
    for k in range(n + 2):
        if k == 2:  # two warm-up steps
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
        seqs = [_window(store, int(i), rng, s.max_seq_len)
                for i in rng.integers(0, len(store) - s.eval_seqs, s.seqs_per_step)]
        batch = objective.batch(seqs, rng)
        if batch is None:
            continue
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=s.bf16):
            loss, _ = objective.loss(m, _to(batch, dev))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    rate = n / (time.perf_counter() - t)
    del m, opt
    return rate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=5.0, help="training wall-clock cap")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="stop training this many seconds after the script started (whichever comes first)")
    ap.add_argument("--seqs-per-step", type=int, default=32)
    ap.add_argument("--crop", type=int, default=256)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--ce-weight", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=3000, help="the cosine schedule's length")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--feature-batch-tokens", type=int, default=65536)
    ap.add_argument("--fit-steps", action="store_true", help="fit the schedule's length (<= --steps) to the budget")
    ap.add_argument("--answer-minutes", type=float, default=0.0,
                    help="first answer DATA's ``prompts`` with the target for up to this long (0: skip)")
    ap.add_argument("--answer-batch", type=int, default=256)
    ap.add_argument("--answer-tokens", type=int, default=256)
    ap.add_argument("--answer-samples", type=int, default=1, help="answers a prompt (sampled when > 1)")
    ap.add_argument("--answer-temperature", type=float, default=0.7, help="sampling temperature when samples > 1")
    ap.add_argument("--max-feature-gib", type=float, default=None,
                    help="host memory for the features (default: 80%% of the machine's); training sequences past it "
                         "are dropped, last first, with a message")
    ap.add_argument("--method", choices=("dspark", "eagle3"), default="dspark",
                    help="dspark: DATA's config (DSpark or DFlash); eagle3: an EAGLE-3 drafter over the same target "
                         "layers and draft vocabulary (SpecForge layout)")
    ap.add_argument("--ttt-length", type=int, default=7, help="EAGLE-3: draft steps trained (and drafted per round)")
    ap.add_argument("--init", type=Path, default=None,
                    help="start from this drafter checkpoint (DATA's config and draft vocabulary) instead of scratch")
    ap.add_argument("--shard-mib", type=float, default=15.0,
                    help="write the checkpoint in shards of at most this many MiB (0: one file)")
    ap.add_argument("--allow-cpu", action="store_true", help="run without CUDA (tests; hours for a real target)")
    a = ap.parse_args(argv)

    import torch
    from dspark_export.drafter.checkpoint import save_checkpoint
    from dspark_export.drafter.config import DSparkConfig
    from dspark_export.drafter.eagle3_specforge import save_specforge_checkpoint
    from dspark_export.drafter.eagle3_train import Eagle3Objective, new_eagle3_drafter
    from dspark_export.drafter.model import DSparkDraftModel
    from dspark_export.drafter.train import DSparkObjective, TrainSettings, optimize

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not a.allow_cpu:
        sys.exit("no CUDA device: this script is for an NVIDIA GPU (torch with CUDA); pass --allow-cpu to run it on "
                 "the CPU anyway (a real target then takes hours), or use `dspark-export train-draft` on a CPU")
    log(f"torch {torch.__version__}, device {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}")
    z = np.load(a.data)
    cfg = DSparkConfig.from_dict(json.loads(bytes(z["config"]).decode()))
    train_seqs = split(z["ids"], z["mask"], z["starts"])
    held_seqs = split(z["held_ids"], z["held_mask"], z["held_starts"])
    if a.init is not None and a.method != "dspark":
        sys.exit("--init continues a DSpark / DFlash drafter (DATA's config); an EAGLE-3 run starts from scratch")
    if a.init is not None:  # a checkpoint of another architecture is refused before the target loads
        from dspark_export.drafter.checkpoint import check_same_config
        from dspark_export.drafter.config import DraftConfigError
        try:
            check_same_config(cfg, a.init)
        except DraftConfigError as e:
            sys.exit(f"--init {a.init}: {e}; make DATA with gpu_draft_data.py --drafter pointing at that checkpoint, "
                     "or train from scratch")
    rep = {"train_sequences": len(train_seqs), "train_tokens": int(len(z["ids"])),
           "train_loss_tokens": int(z["mask"].sum()), "heldout_sequences": len(held_seqs)}

    t = time.perf_counter()
    target = load_target(a.gguf)
    rep["load_s"] = time.perf_counter() - t
    log(f"target loaded in {rep['load_s']:.0f} s")
    target.to(dev).eval()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.answer_minutes > 0 and "prompts" not in z.files:
        log("warning: --answer-minutes given but DATA has no prompts (make it with gpu_draft_data.py "
            "--answer-prompts N); no answers are generated")
    if a.answer_minutes > 0 and "prompts" in z.files:  # 0. the target's own answers to more training prompts
        from transformers import AutoTokenizer
        from dspark_export.drafter.data import answer_prompts, done_keys
        from dspark_export.drafter.features import answer_sequences

        tok = AutoTokenizer.from_pretrained(str(a.gguf.parent), gguf_file=a.gguf.name)
        answers = a.out / "answers.jsonl"
        done = {k.split("#")[0] for k in done_keys(answers)}  # a rerun into the same --out answers only the rest
        prompts = [tuple(p) for p in json.loads(bytes(z["prompts"]).decode()) if p[1] not in done]
        answer_s = a.answer_minutes * 60
        if a.deadline_s is not None:
            answer_s = min(answer_s, 0.5 * (a.deadline_s - (time.perf_counter() - T0)))
        samples = max(1, a.answer_samples)
        r = answer_prompts(target, tok, prompts, answers, max_new_tokens=a.answer_tokens,
                           batch_size=max(1, a.answer_batch // samples), time_budget_s=max(0.0, answer_s),
                           samples=samples,
                           temperature=a.answer_temperature if a.answer_samples > 1 else 0.0)
        new = answer_sequences(answers, 1024)
        train_seqs = train_seqs + new
        rep["answers"] = {**r, "sequences": len(new), "tokens": int(sum(len(q[0]) for q in new)),
                          "tokens_per_s": r["new_tokens"] / max(r["seconds"], 1e-9)}
        rep["train_sequences"], rep["train_tokens"] = len(train_seqs), int(sum(len(q[0]) for q in train_seqs))
        rep["train_loss_tokens"] = int(sum(int(q[1].sum()) for q in train_seqs))
        log(f"answers: {rep['answers']}")
    target_config = target.config.to_dict()
    emb = target.model.embed_tokens.weight.detach().float().cpu()
    head = target.lm_head.weight.detach().float().cpu()

    per_token = 2 * (len(cfg.target_layer_ids) + 1) * cfg.hidden_size  # fp16 features + final hidden state
    cap = a.max_feature_gib * 2**30 if a.max_feature_gib else 0.8 * os.sysconf("SC_PAGE_SIZE") * os.sysconf(
        "SC_PHYS_PAGES")
    room = int(cap // per_token) - sum(len(q[0]) for q in held_seqs)
    kept, n = [], 0
    for q in train_seqs:
        if n + len(q[0]) > room:
            break
        kept.append(q)
        n += len(q[0])
    if len(kept) < len(train_seqs):
        log(f"features of {sum(len(q[0]) for q in train_seqs)} tokens would not fit {cap / 2**30:.2f} GiB of host "
            f"memory ({per_token} bytes a token): training on the first {len(kept)} of {len(train_seqs)} sequences")
        train_seqs = kept
        rep["train_sequences"], rep["train_tokens"] = len(kept), n
        rep["train_loss_tokens"] = int(sum(int(q[1].sum()) for q in kept))
    t = time.perf_counter()
    feats = features(target, train_seqs + held_seqs, list(cfg.target_layer_ids), a.feature_batch_tokens)
    n_feat = sum(len(q[0]) for q in train_seqs + held_seqs)
    if dev == "cuda":
        torch.cuda.synchronize()
    rep["features_s"] = time.perf_counter() - t
    rep["features_tok_s"] = n_feat / rep["features_s"]
    log(f"features: {n_feat} tokens in {rep['features_s']:.0f} s "
        f"({rep['features_tok_s']:.0f} tok/s)")
    del target
    if dev == "cuda":
        torch.cuda.empty_cache()

    torch.manual_seed(0)
    vocab = torch.as_tensor(z["draft_vocab_ids"])
    if a.method == "eagle3":
        model = new_eagle3_drafter(target_config, list(cfg.target_layer_ids), a.ttt_length, cfg.intermediate_size,
                                   vocab.numpy())
    else:
        model = DSparkDraftModel(cfg)
        model.draft_vocab_ids.copy_(vocab)
    model.init_from_target(emb, head)
    if a.init is not None:
        from dspark_export.drafter.checkpoint import load_weights_into
        from dspark_export.drafter.config import DraftConfigError
        try:
            load_weights_into(model, a.init, target_embed=emb, target_lm_head=head)
        except DraftConfigError as e:
            sys.exit(f"--init {a.init}: {e}; make DATA with gpu_draft_data.py --drafter pointing at that checkpoint, "
                     "or train from scratch")
        rep["init"] = str(a.init)
        log(f"weights from {a.init}")
    store = MemoryStore(feats)
    s = TrainSettings(lr=a.lr, ce_alpha=a.ce_weight, max_seq_len=a.crop, seqs_per_step=a.seqs_per_step,
                      anchors_per_seq=a.anchors, max_steps=a.steps, eval_every=a.eval_every,
                      eval_seqs=len(held_seqs), save_every_s=1e9, bf16=True, device=dev)
    if a.method == "eagle3":  # its head's rows of the draft vocabulary are taken from the full head it is given
        objective = Eagle3Objective(model, head.to(dev), s, store)
    else:
        objective = DSparkObjective(model, head[vocab].to(dev), s, cfg.block_size, cfg.mask_token_id)
    del emb, head
    def left() -> float:
        b = a.minutes * 60
        return b if a.deadline_s is None else min(b, a.deadline_s - (time.perf_counter() - T0))

    if left() <= 5:
        sys.exit(f"no time left to train ({left():.0f} s after loading, answers and features): raise --deadline-s or "
                 "--minutes, or give less data")
    if a.fit_steps:  # size the cosine schedule to the budget: time a few steps on a throwaway copy first
        rate = step_rate(model, objective, store, s)
        s.max_steps = max(10, min(a.steps, int(0.92 * left() * rate)))
        rep["timed_steps_per_s"] = rate
        log(f"{rate:.2f} steps/s -> {s.max_steps} steps")
    s.time_budget_s = budget = left()
    log(f"training for at most {budget:.0f} s: {s}")
    r = optimize(store, model, objective, a.out, s, log=log)
    rep["train"] = r
    rep["method"] = a.method
    shard = int(a.shard_mib * 2**20) if a.shard_mib > 0 else None  # pieces a small-file transfer can carry
    if a.method == "eagle3":  # fp16 as the DSpark checkpoint (the training loop wrote fp32)
        save_specforge_checkpoint(model, a.out, dtype=torch.float16, shard_bytes=shard)
    else:
        save_checkpoint(model, a.out, shard_bytes=shard)
    rep["checkpoint_files"] = {f.name: f.stat().st_size for f in sorted(a.out.glob("*.safetensors"))}
    rep["machine"] = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    rep["total_s"] = time.perf_counter() - T0
    (a.out / "gpu_train_report.json").write_text(json.dumps(rep, indent=2) + "\n")
    log(json.dumps(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
