"""``dspark-export train-draft``: the resumable pipeline around :func:`dspark_export.drafter.train.train` — the run's
state in its work directory (:class:`RunState`), the stages answers -> sequences -> features -> train -> calibrate
(:func:`train_draft_pipeline`), and answers carried from one run to another (:func:`import_answers`).
"""
from __future__ import annotations

import gzip
import json
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dspark_runtime.engine_dir.integrity import atomic_write_text
from dspark_runtime.errors import DSparkError
from dspark_runtime.machine.sysinfo import cpu_features

from dspark_export.drafter import data as answers_data  # by module: tests replace its answer generators
from dspark_export.drafter.checkpoint import load_weights_into
from dspark_export.drafter.config import load_config
from dspark_export.drafter.data import EVERY, done_keys
from dspark_export.drafter.features import (FeatureStore, answer_sequences, choose_draft_vocab, extract_features,
                                            extract_features_ort, pick_mask_token, sharegpt_sequences,
                                            stdlib_sequences)
from dspark_export.drafter.train import TRAIN_STATE, TrainSettings, train
from dspark_export.drafter.eagle3_train import train_eagle3_stage
from dspark_export.drafter.init_checkpoint import (cached_vocab, check_reused_data_fits, checkpoint_vocab,
                                                   settings_from_checkpoint)
from dspark_export.engine_dir.add_draft import add_dspark_draft
from dspark_export.engine_dir.add_eagle3 import add_eagle3_draft
from dspark_export.fit.calibrate_drafter import calibrate_engine


@dataclass
class PipelineSettings:
    """Sizes of ``train_draft_pipeline``'s stages (what the run is; :class:`TrainSettings` is how it trains)."""

    answer_prompts: int | None = None  # training prompts the target answers (None: all of them)
    answer_tokens: int = 256
    answer_batch: int = 8
    sharegpt_prompts: int = 500  # ShareGPT first turns among the prompts the target answers
    code_task_prompts: int = 2000  # standard-library code tasks among them (drafter.code_tasks)
    stdlib_tokens: int = 40000
    sharegpt_tokens: int = 40000
    feature_tokens: int | None = None  # the features stage stops after the shards holding this many tokens (None: all)
    # where the features are computed: "cpu" (the engine's target graph on ONNX Runtime's CPU provider, the deployed
    # arithmetic), "openvino" (that graph on its OpenVINO provider: bf16 on AMX, Intel CPUs) or "torch-bf16" (the
    # target's Hugging Face weights in torch bf16); without an engine, torch fp32 unless "torch-bf16" (docs/drafter.md)
    features_on: str = "cpu"
    max_seq_len: int = 1024
    feature_layers: tuple = (1, 13, 25)
    draft_vocab_size: int = 16384
    num_layers: int = 1
    intermediate_size: int = 3072
    block_size: int = 7
    markov_rank: int = 64
    markov_head_type: str = "vanilla"
    confidence_head: bool = True  # False with markov_rank 0: DeepSpec's DFlash (no Markov, no confidence head)
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_intermediate_size: int | None = None
    mask_token_id: int | None = None  # the block's mask token (None: an unused special token of the tokenizer)
    method: str = "dspark"  # the drafter family trained: "dspark" (DSpark / DFlash) or "eagle3"
    ttt_length: int = 7  # EAGLE-3: draft steps trained (training-time test) and drafted per round
    # a DSpark checkpoint folder whose weights training continues from (its architecture, draft vocabulary and mask
    # token replace the fields above: :func:`settings_from_checkpoint`); None: from scratch
    init: str | None = None


# The settings that decide a run's data (answers, sequences, features): a run started with ``reuse_data`` takes
# them from the run whose data it reuses.
DATA_FIELDS = ("answer_prompts", "answer_tokens", "answer_batch", "sharegpt_prompts", "code_task_prompts",
               "stdlib_tokens", "sharegpt_tokens", "feature_tokens", "features_on", "max_seq_len", "feature_layers",
               "draft_vocab_size")
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
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps(self.data, indent=2) + "\n")


def train_draft_pipeline(target_dir: Path, work_dir: Path, out_dir: Path | None, p: PipelineSettings | None,
                         s: TrainSettings | None, *, engine_dir: Path | None = None, time_limit_s: float | None = None,
                         compile_into_engine: bool | None = None, seed_answers: Path | None = None,
                         feature_tokens: int | None = None, reuse_data: Path | None = None, log=print) -> dict:
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
    4. train: :func:`train` to ``s.epochs`` (or ``s.max_steps``), state in ``train_state.pt`` (``p.method``
       "eagle3": an EAGLE-3 drafter fusing ``p.feature_layers``, :func:`train_eagle3_stage`, on the same data);
    5. calibrate (``engine_dir`` and ``compile_into_engine``): the checkpoint compiled into ``engine_dir``
       (:func:`dspark_export.engine_dir.add_draft.add_dspark_draft`) and its STS temperatures and router priors fitted on the
       calibration split (:func:`dspark_export.fit.calibrate_drafter.calibrate_engine`, also written to the checkpoint's
       ``sts.json``); an EAGLE-3 checkpoint is compiled beside the engine's other drafters
       (:func:`dspark_export.engine_dir.add_eagle3.add_eagle3_draft`), with nothing to calibrate.

    ``compile_into_engine``: whether stage 5 runs; None: as the run was started (a new run: True). A resumed run
    keeps its own choice unless this is given.
    ``time_limit_s``: this call stops (state saved) when it has run that long; calling again resumes.
    ``seed_answers``: a JSONL (or .jsonl.gz) file of answers from an earlier run (:func:`import_answers`) added to
    the work directory before stage 1, which then answers only the prompts it lacks.
    ``feature_tokens``: a new size cap of the features stage (``PipelineSettings.feature_tokens``) for a run in
    progress — the one setting a resumed run may change, since it only decides how many of the (mixed) sequences get
    features: training then uses the leading shards holding that many tokens (the shards already extracted count).
    Raises DSparkError when the training stage has already started (its data would change).
    ``reuse_data``: the work directory of another run whose features stage is done; this (new) run starts from its
    answers, sequences and features (answers and sequences copied, the feature directory linked, not copied) and
    takes its data settings (:data:`DATA_FIELDS`), target and engine, so another drafter configuration or training
    setting trains on exactly the same data without repeating the expensive stages (:func:`_reuse_data`).
    Returns {"finished", "stages" (per stage: seconds and figures), "train" (the last training report, or None),
    "checkpoint_bytes"}; a finished run also writes ``out_dir/train_report.json`` with the data sizes by source,
    wall time per stage and the machine.
    """
    import torch
    from transformers import AutoTokenizer

    from dspark_export.drafter.graph import target_frozen_weights
    from dspark_export.drafter.model import DSparkDraftModel, qwen2_draft_config

    work_dir = Path(work_dir)
    fresh = None
    if p is not None and p.init is not None:
        p = settings_from_checkpoint(p, Path(p.init))
    if p is not None:
        fresh = {"target": str(target_dir), "engine": None if engine_dir is None else str(engine_dir),
                 "out": str(out_dir), "pipeline": asdict(p), "train": asdict(s),
                 "compile": True if compile_into_engine is None else bool(compile_into_engine)}
        fresh["pipeline"]["feature_layers"] = list(p.feature_layers)
        if reuse_data is not None:
            src = _reuse_source(Path(reuse_data), fresh)
    state = RunState.open(work_dir, fresh)
    if fresh is not None and reuse_data is not None:
        _reuse_data(src, Path(reuse_data), state, work_dir, log)
    d = state.data
    if feature_tokens is not None and feature_tokens != d["pipeline"].get("feature_tokens"):
        tr = d["stages"].get("train", {})
        if tr.get("done") or tr.get("report") is not None or (work_dir / TRAIN_STATE).exists():
            raise DSparkError(f"{work_dir}: training has started on the features extracted so far, so the feature "
                              "token cap can no longer change; start a new run (--work) to train on another amount")
        d["pipeline"]["feature_tokens"] = int(feature_tokens)
        d["stages"].get("features", {})["done"] = False  # re-judged against the new cap below
        state.save()
        log(f"[3/5] features capped at {feature_tokens} tokens")
    if compile_into_engine is None:
        compile_into_engine = d.get("compile", True)  # runs started before it was stored: the old default
    if fresh is not None and reuse_data is not None and d["pipeline"].get("init"):
        check_reused_data_fits(d["pipeline"], Path(reuse_data), PipelineSettings())
    # a run started before code tasks existed answers none
    p = PipelineSettings(**{"code_task_prompts": 0, **d["pipeline"],
                            "feature_layers": tuple(d["pipeline"]["feature_layers"])})
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
        n_seed = import_answers(Path(seed_answers), answers, limit=p.answer_prompts)
        st["seeded"] = st.get("seeded", 0) + n_seed
        state.save()
        log(f"[1/5] {n_seed} answers imported from {seed_answers}")
    if not st["done"]:
        log(f"[1/5] target answers to training prompts -> {answers}"
            f"{' (batched through the engine)' if engine_dir is not None else ' (transformers generate)'}")
        t = time.perf_counter()
        if engine_dir is not None:
            r = answers_data.generate_answers_engine(engine_dir, answers, max_new_tokens=p.answer_tokens,
                                                     max_batch=p.answer_batch, limit=p.answer_prompts,
                                                     time_budget_s=left(), n_sharegpt=p.sharegpt_prompts,
                                                     n_code_tasks=p.code_task_prompts, log=log)
        else:
            r = answers_data.generate_answers(target_dir, answers, max_new_tokens=p.answer_tokens,
                                              batch_size=p.answer_batch, limit=p.answer_prompts,
                                              time_budget_s=left(), n_sharegpt=p.sharegpt_prompts,
                                              n_code_tasks=p.code_task_prompts)
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
    seqs = read_sequences(seq_file)
    eos = [i for i in np.atleast_1d(cfg.get("eos_token_id") or []).tolist()]
    eos += [tok.convert_tokens_to_ids(t_) for t_ in ("<|im_end|>", "<|endoftext|>") if t_ in tok.get_vocab()]
    counts = np.bincount(np.concatenate([a for a, _ in seqs]), minlength=cfg["vocab_size"])
    if p.init is not None:  # the continued checkpoint's draft vocabulary, whatever the counts say now
        vocab = checkpoint_vocab(Path(p.init))
    else:
        vocab = choose_draft_vocab(counts, p.draft_vocab_size, always=eos) if p.draft_vocab_size else None

    # 3. features
    feat_dir = work_dir / "features"
    st = state.stage("features")
    if not st["done"]:
        log(f"[3/5] target features -> {feat_dir}")
        t = time.perf_counter()
        if engine_dir is not None and p.features_on != "torch-bf16":
            if vocab is None:
                raise DSparkError("feature extraction through the engine stores logits over a reduced draft "
                                  "vocabulary; give --draft-vocab > 0 or extract with torch (no --engine)")
            if (feat_dir / "draft_vocab.npy").exists():
                vocab = cached_vocab(feat_dir, vocab, p.init)  # the vocabulary the cached logits were stored over
            r = extract_features_ort(engine_dir, seqs, feat_dir, vocab, time_budget_s=left(),
                                     max_tokens=p.feature_tokens, provider=p.features_on)
        else:
            r = extract_features(target_dir, seqs, feat_dir, list(p.feature_layers), time_budget_s=left(),
                                 dtype="bfloat16" if p.features_on == "torch-bf16" else "float32",
                                 max_tokens=p.feature_tokens)
        if not state.progress(st, time.perf_counter() - t, r["tokens"], r.get("complete", True)):
            return stopped("features")
    elif engine_dir is not None and p.features_on != "torch-bf16" and (feat_dir / "draft_vocab.npy").exists():
        vocab = cached_vocab(feat_dir, vocab, p.init)

    # 4. train
    store = FeatureStore(feat_dir)
    st = state.stage("train")
    if not st["done"] and p.method == "eagle3":
        rep = train_eagle3_stage(store, cfg, p.feature_layers, p.ttt_length, p.intermediate_size, s, vocab,
                                 target_dir, out_dir, work_dir / TRAIN_STATE, left(), log)
        st["seconds"] += rep["seconds_this_call"]
        st.update(done=rep["finished"], report=rep, tokens=store.num_tokens)
        state.save()
        if not st["done"]:
            return stopped("train")
    if not st["done"]:
        counts = store.token_counts(cfg["vocab_size"])
        emb, head = target_frozen_weights(target_dir)
        torch.manual_seed(s.seed)
        if p.init is not None:  # the architecture, draft vocabulary and mask token are the checkpoint's
            c = load_config(Path(p.init))
            model = DSparkDraftModel(c)
            if vocab is not None:
                model.draft_vocab_ids.copy_(torch.as_tensor(vocab))
            model.init_from_target(emb, head)  # frozen, as in a run from scratch
            load_weights_into(model, Path(p.init), target_embed=emb, target_lm_head=head)
            mask_id = c.mask_token_id
        else:
            mask_id = pick_mask_token(tok, counts) if p.mask_token_id is None else int(p.mask_token_id)
            c = qwen2_draft_config(cfg, mask_token_id=mask_id, num_layers=p.num_layers,
                                   intermediate_size=p.intermediate_size, block_size=p.block_size,
                                   target_layer_ids=p.feature_layers, markov_rank=p.markov_rank,
                                   markov_head_type=p.markov_head_type, confidence_head=p.confidence_head,
                                   draft_vocab_size=None if vocab is None else len(vocab),
                                   **_moe_kwargs(p))
            model = DSparkDraftModel(c)
            if vocab is not None:
                model.draft_vocab_ids.copy_(torch.as_tensor(vocab))
            model.init_from_target(emb, head)
        del emb
        if vocab is not None:
            target_head = None if store.aux == "tlogits" else head[model.draft_vocab_ids].clone()
            cover = float(counts[vocab].sum() / max(1, counts.sum()))
        else:
            target_head, cover = head, 1.0
        log(f"[4/5] training{' continues ' + p.init if p.init else ''}: "
            f"{sum(q.numel() for q in model.parameters() if q.requires_grad) / 1e6:.1f} M trainable "
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
    if not st["done"] and engine_dir is not None and compile_into_engine and p.method == "eagle3":
        t = time.perf_counter()
        log(f"[5/5] compiling {out_dir} into {engine_dir} (EAGLE-3: nothing to calibrate)")
        add_eagle3_draft(engine_dir, out_dir, log=log)
        st.update(done=True, seconds=time.perf_counter() - t)
        state.save()
    if not st["done"] and engine_dir is not None and compile_into_engine:
        t = time.perf_counter()
        log(f"[5/5] compiling {out_dir} into {engine_dir} and calibrating it")
        add_dspark_draft(engine_dir, out_dir, str(target_dir), log=log)
        cal = calibrate_engine(engine_dir, log=log, save_to_checkpoint=True)  # the run's own checkpoint
        st.update(done=True, seconds=time.perf_counter() - t, rounds=cal["rounds"],
                  temperatures=cal["temperatures"])
        state.save()
    report = {"stages": d["stages"], "settings": {"pipeline": d["pipeline"], "train": d["train"]},
              "machine": cpu_features(),
              "checkpoint_bytes": sum(f.stat().st_size for f in out_dir.glob("*.safetensors"))}
    (out_dir / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return {"finished": True, "stages": d["stages"], "train": d["stages"]["train"].get("report"),
            "checkpoint_bytes": report["checkpoint_bytes"]}


def read_sequences(seq_file: Path) -> list:
    """The (ids int32 [n], loss mask uint8 [n]) pairs of a ``sequences.npz`` (its ``ids``, ``mask`` and ``starts``),
    as views of one decompressed copy of each array: each ``npz[name]`` decompresses the whole array anew, and a
    slice of it keeps all of it alive (3,115 sequences of 956k tokens held ~15 GB that way)."""
    z = np.load(seq_file, allow_pickle=False)
    ids, mask, cuts = z["ids"], z["mask"], z["starts"]
    return [(ids[a:b], mask[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]


def _reuse_source(src_dir: Path, fresh: dict) -> dict:
    """The state of the run whose data a new run reuses; fills ``fresh``'s data settings, target and engine from
    it. Raises DSparkError when ``src_dir`` holds no run, its features are not done, or it has another target /
    engine than the new run names."""
    src = RunState.open(src_dir, None).data
    if not src["stages"].get("features", {}).get("done"):
        raise DSparkError(f"{src_dir}: that run's features stage is not finished, so there is no data to reuse yet; "
                          f"finish it first (`dspark-export train-draft --resume {src_dir}`)")
    if Path(src["target"]).resolve() != Path(fresh["target"]).resolve():
        raise DSparkError(f"{src_dir} holds features of the target {src['target']}, not {fresh['target']}: reuse "
                          "the data of a run of the same target")
    if fresh["engine"] is not None and src["engine"] is not None and \
            Path(src["engine"]).resolve() != Path(fresh["engine"]).resolve():
        raise DSparkError(f"{src_dir} extracted its features through the engine {src['engine']}, not "
                          f"{fresh['engine']}: drop --engine (the reused run's engine is taken) or give that one")
    fresh["engine"] = src["engine"] if fresh["engine"] is None else fresh["engine"]
    for k in DATA_FIELDS:  # a field the source run predates keeps the default it then had (the new run's)
        fresh["pipeline"][k] = src["pipeline"].get(k, fresh["pipeline"][k])
    return src


def _reuse_data(src: dict, src_dir: Path, state: RunState, work_dir: Path, log) -> None:
    """Bring ``src_dir``'s answers and sequences (copied) and features (a symbolic link) into ``work_dir`` and mark
    those stages done with the source run's records (``reused_from``); nothing is done twice on a re-run."""
    work_dir.mkdir(parents=True, exist_ok=True)
    for name in ("answers.jsonl", "sequences.npz"):
        if (src_dir / name).exists() and not (work_dir / name).exists():
            shutil.copy2(src_dir / name, work_dir / name)
    feats = work_dir / "features"
    if not feats.exists():
        feats.symlink_to((src_dir / "features").resolve(), target_is_directory=True)
    for name in ("answers", "sequences", "features"):
        if not state.stage(name).get("done"):
            state.data["stages"][name] = {**src["stages"].get(name, {"done": True, "seconds": 0.0}),
                                          "reused_from": str(src_dir)}
    state.save()
    log(f"[1-3/5] answers, sequences and features reused from {src_dir} (features linked: {feats} -> "
        f"{feats.resolve()})")


def import_answers(src: Path, answers: Path, limit: int | None = None) -> int:
    """Append to ``answers`` the records of ``src`` (JSONL, gzip when it ends in .gz; the format of
    :func:`dspark_export.drafter.data.generate_answers_engine`) whose key it lacks; returns how many. Records whose
    key is not a training prompt that passes the contamination check (every prompt of
    :func:`dspark_export.drafter.data.training_prompt_list`) are refused, so a file can never bring a calibration or
    evaluation prompt, or a copy of one, in. ``limit``: the answers file holds at most that many records afterwards
    (the run's ``answer_prompts``; the file's records in order, so a longer file seeds a smaller run with the same
    answers as before it grew).
    Raises DSparkError naming the file and line of a malformed record."""
    allowed = {k for _, k, _ in answers_data.training_prompt_list(n_sharegpt=EVERY, n_code_tasks=EVERY)}
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
            if key not in allowed:
                raise DSparkError(f"{src} line {i}: {key!r} is not a training prompt; answers files may only hold "
                                  "the training split, ShareGPT and code-task prompts that pass the contamination "
                                  "check (dspark_export.drafter.prompt_overlap)")
            if key not in have and (limit is None or len(have) < limit):
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
