"""Time the peer systems a user would pick instead of DSpark on an NVIDIA GPU: ONNX Runtime GenAI (its model
builder's fp16 CUDA model, with and without CUDA graphs) and Hugging Face transformers (``generate``, dynamic and
static cache), on a Qwen2.5-1.5B-architecture model with random weights, greedy, at fixed batch sizes / prompt
length / new tokens. Run by ``benchmarks.gpu.check_cuda``'s peers phase; each subcommand's docstring says what it
does and the output JSON is :class:`Report`'s.

    python -m benchmarks.peers.gpu_peers make-model OUT [--tiny] [--device cuda|cpu]
    python -m benchmarks.peers.gpu_peers genai HF_FOLDER WORK --out genai.json [--ep cuda|cpu]
    python -m benchmarks.peers.gpu_peers hf HF_FOLDER --out hf.json [--device cuda|cpu]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

T0 = time.monotonic()

QWEN25_1P5B = dict(
    vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
    num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
    rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643,
    rope_theta=1e6, initializer_range=0.02, hidden_act="silu", use_sliding_window=False,
    sliding_window=32768, max_window_layers=21,
)
TINY = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
    rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=319, eos_token_id=319,
    rope_theta=1e6, initializer_range=0.02, hidden_act="silu", use_sliding_window=False,
    sliding_window=32768, max_window_layers=2,
)
EOS_TEXT = "<|endoftext|>"
WARMUP_NEW_TOKENS = 8


# ----------------------------------------------------------------------------------------------
# small helpers


def elapsed() -> float:
    return time.monotonic() - T0


class Scrubber:
    """Replaces absolute paths and the host name in free text (error messages) by placeholders."""

    def __init__(self, named_paths: dict):
        self.pairs = []
        for name, p in named_paths.items():
            if p:
                for v in {str(p), str(Path(p).resolve())}:
                    self.pairs.append((v, f"<{name}>"))
        for name, p in (("python", sys.prefix), ("cwd", os.getcwd()), ("home", str(Path.home()))):
            self.pairs.append((p, f"<{name}>"))
        for p in sys.path:  # PYTHONPATH entries, site-packages
            if p and os.path.isabs(p) and len(p) > 1:
                self.pairs.append((p, "<pypath>"))
        self.pairs.sort(key=lambda kv: -len(kv[0]))  # longest first
        self.host = socket.gethostname()

    def __call__(self, text: str) -> str:
        for v, tag in self.pairs:
            if v and v != "/":
                text = text.replace(v, tag)
        if self.host and len(self.host) > 2:
            text = text.replace(self.host, "<host>")
        return text


class Report:
    """The output JSON, rewritten atomically after every change.

    Output JSON (rewritten after every configuration; no host names or absolute paths: those in error
    texts become <hf>, <work>, <pypath>, <home>, <host>):
        {"tool", "mode": "genai"|"hf", "status": "running"|"done"|"failed",
         "complete": true when no configuration was skipped or failed, "elapsed_s",
         "gpu": {"name", "driver", "memory"}, "cuda": {onnxruntime build / providers / preload_dlls,
         og.is_cuda_available (genai); torch.version.cuda (hf)}, "versions": {package: version},
         "settings": {...}, "model": {config summary, "creation": make-model's record, "weights_bytes"},
         "build": {...}  (genai only: builder argv with placeholders, wall_s, rc, peak RSS, output_bytes,
                          genai_config provider options / past_present_share_buffer, log tail),
         "configs": [{"system", "variant" (genai-cuda, genai-cuda-cudagraph, hf-dynamic, hf-static),
                      "batch", "prompt_len", "new_tokens", "cuda_graph", "cache" (hf),
                      "prefill_ms", "first_token_ms" (genai), "decode_steps" (N - 1),
                      "decode_ms_per_step", "tokens_per_s",
                      "decode_ms_per_step_median", "tokens_per_s_median" (genai),
                      "generated_tokens_ok" (exactly N new tokens in every row),
                      "row0_first16", "first_token_per_row" (to compare the systems' outputs),
                      "repeats": [per-run figures], "wall_s", "model_load_s" / "device_type" (genai),
                      "peak_gpu_mem_mb" (hf), "error" + "traceback_tail" (only on failure)}],
         "skipped": [{"variant", "batch", "reason"}], "notes": [...]}

    Timing definitions (both systems): the first new token comes from the prefill's logits, each later one
    costs one 1-token forward pass (decode step), so N new tokens = prefill + N - 1 decode steps.
    ``decode_ms_per_step`` = decode time / (N - 1); ``tokens_per_s`` = B * (N - 1) / decode time (the
    TTFT-free decode throughput of the whole batch); for GenAI also the median step
    (``decode_ms_per_step_median``, ``tokens_per_s_median``), which leaves out the steps that captured the
    CUDA graph. Every configuration gets one untimed warm-up run (same B and P, 8 new tokens) and
    ``--repeats`` timed runs; the reported figures are the medians over the repeats, each repeat is listed.
    The prompt is a (max B, P) block of random ids below the EOS id (numpy ``default_rng(seed)``, seed 0);
    batch B takes its first B rows, so both systems see the same ids.
    """

    def __init__(self, path: str | None, mode: str, scrub: Scrubber):
        self.path = Path(path) if path else None
        self.scrub = scrub
        self.data = {"tool": "benchmarks/peers/gpu_peers.py", "mode": mode, "status": "running", "complete": False,
                     "elapsed_s": 0.0, "gpu": {}, "cuda": {}, "versions": {}, "settings": {}, "model": {},
                     **({"build": {}} if mode == "genai" else {}), "configs": [], "skipped": [], "notes": []}

    def write(self):
        self.data["elapsed_s"] = round(elapsed(), 2)
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        os.replace(tmp, self.path)

    def note(self, text: str):
        self.data["notes"].append(self.scrub(text))
        self.write()


def parse_batches(s: str) -> list:
    return [int(x) for x in s.split(",") if x.strip()]


def package_versions() -> dict:
    import importlib.metadata as md
    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "onnxruntime", "onnxruntime-gpu", "onnxruntime-genai",
                 "onnxruntime-genai-cuda", "onnx", "onnx-ir", "onnxscript", "numpy", "safetensors",
                 "tokenizers"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def gpu_info() -> dict:
    """GPU name / driver from nvidia-smi, else torch; {} without a GPU."""
    info = {}
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        if r.returncode == 0 and r.stdout.strip():
            name, driver, mem = [x.strip() for x in r.stdout.strip().splitlines()[0].split(",")]
            info = {"name": name, "driver": driver, "memory": mem}
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    if not info:
        try:
            import torch
            if torch.cuda.is_available():
                info = {"name": torch.cuda.get_device_name(0)}
        except Exception:  # noqa: BLE001 - best effort
            pass
    return info


def model_summary(hf_folder: str) -> dict:
    folder = Path(hf_folder)
    cfg = json.loads((folder / "config.json").read_text())
    keys = ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "intermediate_size", "vocab_size", "max_position_embeddings",
            "tie_word_embeddings", "dtype", "torch_dtype", "eos_token_id", "rope_parameters", "rope_theta")
    out = {"folder_name": folder.resolve().name, **{k: cfg[k] for k in keys if k in cfg}}
    rec = folder / "peers_model.json"
    if rec.is_file():
        out["creation"] = json.loads(rec.read_text())
    out["weights_bytes"] = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return out


def eos_id(hf_folder: str) -> int:
    cfg = json.loads((Path(hf_folder) / "config.json").read_text())
    e = cfg.get("eos_token_id")
    if isinstance(e, list):
        e = e[0]
    return int(e) if e is not None else int(cfg["vocab_size"]) - 1


def prompt_ids(max_batch: int, prompt_len: int, high: int, seed: int):
    import numpy as np
    rng = np.random.default_rng(seed)
    return rng.integers(0, high, size=(max_batch, prompt_len), dtype=np.int64)


class Deadline:
    """Skips a configuration when the last one's duration would carry it past the deadline."""

    def __init__(self, deadline_s: float | None):
        self.deadline_s = deadline_s
        self.last: dict = {}

    def reason_to_skip(self, key) -> str | None:
        if self.deadline_s is None:
            return None
        now = elapsed()
        if now >= self.deadline_s:
            return f"deadline: {now:.1f} s elapsed of {self.deadline_s:.1f} s"
        est = self.last.get(key, max(self.last.values(), default=0.0))
        if now + est > self.deadline_s:
            return (f"deadline: {now:.1f} s elapsed, the last configuration took {est:.1f} s, "
                    f"deadline {self.deadline_s:.1f} s")
        return None

    def done(self, key, seconds: float):
        self.last[key] = seconds


def median(xs, nd=3):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), nd) if xs else None


def rnd(x, nd=3):
    return None if x is None else round(float(x), nd)


# ----------------------------------------------------------------------------------------------
# make-model


def write_tokenizer(out: Path, vocab_size: int, eos: int, max_len: int):
    """A WordLevel tokenizer over the whole vocabulary (token i is ``<t{i}>``, the EOS id is
    ``<|endoftext|>``), saved with transformers so AutoTokenizer loads it offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"<t{i}>": i for i in range(vocab_size) if i != eos}
    vocab[EOS_TEXT] = eos
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<t0>" if eos != 0 else "<t1>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TEXT, pad_token=EOS_TEXT,
                                     unk_token="<t0>" if eos != 0 else "<t1>", model_max_length=max_len)
    hf_tok.save_pretrained(str(out))


def cmd_make_model(a) -> int:
    """make-model: a random-weight Hugging Face folder.

    Writes a Hugging Face folder: a ``Qwen2ForCausalLM`` of the Qwen2.5-1.5B config (hidden 1536,
    28 layers, 12 heads, 2 KV heads, intermediate 8960, vocab 151936, tied embeddings, rope_theta 1e6)
    initialised by transformers' own init (normal, std 0.02) after ``torch.manual_seed(0)``, saved as
    fp16 safetensors; built on the GPU when CUDA is there (the same seed gives other numbers on the
    CPU: the device is recorded in ``peers_model.json``). ``--tiny``: the same architecture at hidden 64,
    2 layers, 4 heads, 2 KV heads, intermediate 128, vocab 320, to test this script on a CPU. A
    minimal offline tokenizer (a ``tokenizers`` WordLevel over the vocabulary, ``<|endoftext|>`` at
    the EOS id) is written too because the GenAI model builder loads one; only token ids are used.
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
    spec = dict(TINY if a.tiny else QWEN25_1P5B)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cfg = Qwen2Config(**spec)
    cfg.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(a.seed)
    if device == "cuda":
        torch.cuda.manual_seed_all(a.seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)  # transformers' init: normal(0, initializer_range), norms 1
    model = model.to(torch.float16).eval()
    model.config.dtype = torch.float16
    model.generation_config = GenerationConfig(bos_token_id=spec["bos_token_id"],
                                               eos_token_id=spec["eos_token_id"],
                                               pad_token_id=spec["eos_token_id"], do_sample=False)
    t_init = time.perf_counter() - t0
    model.save_pretrained(str(out))
    write_tokenizer(out, spec["vocab_size"], spec["eos_token_id"], spec["max_position_embeddings"])
    n_params = sum(p.numel() for p in model.parameters())
    w = model.model.layers[0].mlp.up_proj.weight.detach().float()
    rec = {"config": "tiny" if a.tiny else "qwen2.5-1.5b", "seed": a.seed, "init_device": device,
           "init": "transformers default (normal std 0.02, norms 1), fp16 after init",
           "params": int(n_params), "torch": torch.__version__,
           "layer0_up_proj_std": round(float(w.std()), 5),
           "init_s": round(t_init, 2), "total_s": round(time.perf_counter() - t0, 2)}
    (out / "peers_model.json").write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps(rec))
    return 0


# ----------------------------------------------------------------------------------------------
# genai


def run_builder(a, report: Report, scrub: Scrubber) -> Path | None:
    work = Path(a.work)
    precision = a.precision or ("fp16" if a.ep == "cuda" else "fp32")
    out = work / f"onnx-{precision}-{a.ep}"
    cache = work / "cache"
    argv = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(Path(a.hf).resolve()),
            "-o", str(out.resolve()), "-p", precision, "-e", a.ep, "-c", str(cache.resolve())]
    build = {"argv": [scrub(x) for x in argv[1:]], "precision": precision, "ep": a.ep,
             "output_name": out.name}
    report.data["build"] = build
    if (out / "genai_config.json").is_file() and not a.rebuild:
        build["reused"] = True
        build["output_bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        report.write()
        return out
    if a.deadline_s is not None and elapsed() >= a.deadline_s:
        build["error"] = "deadline passed before the build"
        report.write()
        return None
    work.mkdir(parents=True, exist_ok=True)
    log_path = work / f"builder-{precision}-{a.ep}.log"
    timeout = None if a.deadline_s is None else max(1.0, a.deadline_s - elapsed())
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    build["wall_s"] = round(time.perf_counter() - t0, 1)
    build["rc"] = rc
    build["peak_rss_mb_children"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)
    build["log_name"] = log_path.name
    lines = [ln for ln in log_path.read_text(errors="replace").splitlines()
             if ln.strip() and "it/s]" not in ln and "s/it]" not in ln]  # no tqdm progress lines
    build["log_tail"] = [scrub(line)[-300:] for line in lines[-12:]]
    if rc != 0 or not (out / "genai_config.json").is_file():
        build["error"] = "builder timed out (deadline)" if rc is None else f"builder failed (rc {rc})"
        report.write()
        return None
    build["output_bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    gc = json.loads((out / "genai_config.json").read_text())
    build["genai_config"] = {
        "provider_options": gc["model"]["decoder"]["session_options"].get("provider_options"),
        "past_present_share_buffer": gc["search"].get("past_present_share_buffer"),
        "context_length": gc["model"].get("context_length"),
    }
    report.write()
    return out


def ort_cuda_info(preload: bool) -> dict:
    """onnxruntime's CUDA build and providers; with ``preload``, ``onnxruntime.preload_dlls()`` first
    (loads the CUDA / cuDNN libraries of the nvidia-* pip packages, e.g. torch's, so the CUDA EP that
    onnxruntime-genai opens later finds them without LD_LIBRARY_PATH)."""
    out = {}
    try:
        import onnxruntime as ort
        out["ort_version"] = ort.__version__
        try:
            from onnxruntime.capi import build_and_package_info as bpi
            out["ort_build_cuda_version"] = getattr(bpi, "cuda_version", None)
            out["ort_package_name"] = getattr(bpi, "package_name", None)
        except ImportError:
            pass
        if preload and hasattr(ort, "preload_dlls"):
            try:
                ort.preload_dlls()
                out["preload_dlls"] = "called"
            except Exception as e:  # noqa: BLE001
                out["preload_dlls"] = f"failed: {type(e).__name__}: {e}"[:300]
        out["ort_available_providers"] = ort.get_available_providers()
    except Exception as e:  # noqa: BLE001
        out["ort_error"] = f"{type(e).__name__}: {e}"[:300]
    return out


def genai_load(og, onnx_dir: Path, ep: str, cuda_graph: bool):
    config = og.Config(str(onnx_dir))
    config.clear_providers()
    if ep == "cuda":
        config.append_provider("cuda")
        config.set_provider_option("cuda", "enable_cuda_graph", "1" if cuda_graph else "0")
    return og.Model(config)


def genai_once(og, model, ids, new_tokens: int):
    """One generation. append_tokens runs the prefill forward pass; the first generate_next_token
    only picks the first token from its logits; every later one runs a 1-token forward pass, then
    picks. Returns (prefill_s, first_token_s, decode step times [s], new tokens per row, the first
    16 new tokens of row 0, the first new token of every row)."""
    import numpy as np
    b, p = ids.shape
    params = og.GeneratorParams(model)
    params.set_search_options(batch_size=b, do_sample=False, max_length=p + new_tokens,
                              min_length=p + new_tokens)
    gen = og.Generator(model, params)
    block = np.ascontiguousarray(ids, dtype=np.int32)
    t0 = time.perf_counter()
    gen.append_tokens(block)
    t1 = time.perf_counter()
    gen.generate_next_token()  # the first token, from the prefill's logits (no forward pass)
    t2 = time.perf_counter()
    steps = []
    last = t2
    while not gen.is_done():
        gen.generate_next_token()
        now = time.perf_counter()
        steps.append(now - last)
        last = now
    seqs = [gen.get_sequence(i) for i in range(b)]
    t3 = time.perf_counter()
    if steps:
        steps[-1] += t3 - last  # the device->host copy of the sequences closes the last step
    del gen, params
    return (t1 - t0, t2 - t0, steps, [len(s) - p for s in seqs], [int(x) for x in seqs[0][p:p + 16]],
            [int(s[p]) for s in seqs])


def cmd_genai(a) -> int:
    """genai: onnxruntime-genai's model builder, then Generator timing.

    Runs onnxruntime-genai's model builder (``python -m onnxruntime_genai.models.builder -i HF -o
    WORK/onnx-<precision>-<ep> -p fp16 -e cuda -c WORK/cache``; fp32 for ``--ep cpu``, the builder
    has no fp16 CPU) unless its output is already there (``--rebuild`` redoes it), then times
    ``og.Generator``: per configuration a ``GeneratorParams`` with ``batch_size=B, do_sample=False,
    min_length = max_length = P + N`` (so exactly N tokens come: EOS is masked below min_length, and
    the static KV buffers the CUDA model uses, ``search.past_present_share_buffer``, are sized to
    max_length, not to the 32k context), ``append_tokens`` of a (B, P) block of ids (the prefill),
    then ``generate_next_token`` until ``is_done``. CUDA graphs are a provider option
    (``enable_cuda_graph`` of the ``cuda`` provider in genai_config.json) set here through
    ``og.Config.set_provider_option``, so one build serves both; GenAI requires the shared
    past/present buffer for graph capture (it raises otherwise), captures only 1-token decode steps
    (the prefill runs eagerly) and captures one graph per Generator, during its first decode steps
    (those steps are in the mean, not in the median).
    """
    scrub = Scrubber({"hf": a.hf, "work": a.work})
    report = Report(a.out, "genai", scrub)
    d = report.data
    d["versions"] = package_versions()
    d["gpu"] = gpu_info() if a.ep == "cuda" else {}
    d["model"] = model_summary(a.hf)
    variants = {"both": [False, True], "on": [True], "off": [False]}[a.cuda_graph] if a.ep == "cuda" else [False]
    batches = parse_batches(a.batches)
    d["settings"] = {"ep": a.ep, "batches": batches, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
                     "repeats": a.repeats, "seed": a.seed, "cuda_graph_variants": variants,
                     "deadline_s": a.deadline_s, "warmup_new_tokens": WARMUP_NEW_TOKENS,
                     "search": "greedy (do_sample=False), min_length = max_length = P + N"}
    report.write()
    if a.ep == "cuda":
        d["cuda"].update(ort_cuda_info(preload=not a.no_preload))
        report.write()
    try:
        import onnxruntime_genai as og
        d["versions"]["onnxruntime_genai.__version__"] = og.__version__
        if a.ep == "cuda":
            d["cuda"]["og.is_cuda_available"] = bool(og.is_cuda_available())
    except Exception as e:  # noqa: BLE001
        d["status"] = "failed"
        report.note(f"import onnxruntime_genai failed: {e!r}")
        return 1
    onnx_dir = run_builder(a, report, scrub)
    if onnx_dir is None:
        d["status"] = "failed"
        report.write()
        return 1
    if a.build_only:
        d["status"] = "done"
        report.note("--build-only: no timing")
        return 0
    ids_all = prompt_ids(max(batches), a.prompt_len, eos_id(a.hf), a.seed)
    deadline = Deadline(a.deadline_s)
    models = {}
    for b in batches:
        for cg in variants:
            variant = f"genai-{a.ep}" + ("-cudagraph" if cg else "")
            skip = deadline.reason_to_skip(variant)
            if skip:
                d["skipped"].append({"variant": variant, "batch": b, "reason": skip})
                report.write()
                continue
            t_cfg = time.perf_counter()
            row = {"system": "onnxruntime-genai", "variant": variant, "batch": b, "prompt_len": a.prompt_len,
                   "new_tokens": a.new_tokens, "cuda_graph": cg}
            try:
                if cg not in models:
                    t_load = time.perf_counter()
                    models[cg] = genai_load(og, onnx_dir, a.ep, cg)
                    row["model_load_s"] = round(time.perf_counter() - t_load, 2)
                model = models[cg]
                row["device_type"] = str(getattr(model, "device_type", ""))
                ids = ids_all[:b]
                genai_once(og, model, ids, WARMUP_NEW_TOKENS)
                reps = []
                for _ in range(a.repeats):
                    prefill, first, steps, ngen, head, firsts = genai_once(og, model, ids, a.new_tokens)
                    dec = sum(steps)
                    reps.append({"prefill_ms": rnd(prefill * 1e3), "first_token_ms": rnd(first * 1e3),
                                 "decode_ms": rnd(dec * 1e3), "decode_steps": len(steps),
                                 "decode_ms_per_step": rnd(dec * 1e3 / max(1, len(steps)), 4),
                                 "decode_ms_per_step_median": rnd(median(steps) * 1e3 if steps else None),
                                 "step_ms_first5": [rnd(s * 1e3) for s in steps[:5]],
                                 "step_ms_max": rnd(max(steps) * 1e3 if steps else None),
                                 "generated_per_row": sorted(set(ngen)), "row0_first16": head,
                                 "first_token_per_row": firsts})
                steps_n = reps[-1]["decode_steps"]
                per_step = median([r["decode_ms_per_step"] for r in reps], 4)
                per_step_med = median([r["decode_ms_per_step_median"] for r in reps])
                row.update({
                    "prefill_ms": median([r["prefill_ms"] for r in reps]),
                    "first_token_ms": median([r["first_token_ms"] for r in reps]),
                    "decode_steps": steps_n,
                    "decode_ms_per_step": per_step,
                    "tokens_per_s": rnd(b * 1e3 / per_step, 1) if per_step else None,
                    "decode_ms_per_step_median": per_step_med,
                    "tokens_per_s_median": rnd(b * 1e3 / per_step_med, 1) if per_step_med else None,
                    "generated_tokens_ok": all(r["generated_per_row"] == [a.new_tokens] for r in reps),
                    "row0_first16": reps[0]["row0_first16"],
                    "first_token_per_row": reps[0]["first_token_per_row"],
                    "repeats": reps,
                })
            except Exception as e:  # noqa: BLE001
                row["error"] = scrub(f"{type(e).__name__}: {e}")[:2000]
                row["traceback_tail"] = scrub(traceback.format_exc())[-1500:]
            record_config(d, report, deadline, variant, row, t_cfg)
    return finish(d, report)



def record_config(d: dict, report, deadline, variant: str, row: dict, t_cfg: float) -> None:
    """Close one configuration: its wall time, the deadline's bookkeeping, the JSON rewritten, one line printed."""
    row["wall_s"] = round(time.perf_counter() - t_cfg, 2)
    deadline.done(variant, row["wall_s"])
    d["configs"].append(row)
    report.write()
    print(json.dumps({k: row.get(k) for k in ("variant", "batch", "prefill_ms", "decode_ms_per_step",
                                              "tokens_per_s", "error")}), flush=True)


def finish(d: dict, report) -> int:
    """Mark the report done (complete when nothing was skipped or failed) and write it; exit status 0."""
    d["status"] = "done"
    d["complete"] = not d["skipped"] and all("error" not in c for c in d["configs"])
    report.write()
    return 0

# ----------------------------------------------------------------------------------------------
# hf


def cmd_hf(a) -> int:
    """hf: transformers generate timing.

    transformers ``AutoModelForCausalLM`` in fp16 on CUDA, ``attn_implementation="sdpa"``,
    ``generate(do_sample=False, min_new_tokens=N, max_new_tokens=N, disable_compile=True)`` with (a) the
    default dynamic cache and (b) ``cache_implementation="static"`` (``disable_compile`` keeps
    transformers from torch.compiling the forward, which it does by itself for a static cache on
    CUDA). Decode = (time of generate with N new tokens) - (time with 1 new token), over N - 1 steps;
    prefill_ms = the time of generate with 1 new token.
    """
    scrub = Scrubber({"hf": a.hf})
    report = Report(a.out, "hf", scrub)
    d = report.data
    d["versions"] = package_versions()
    import torch
    from transformers import AutoModelForCausalLM
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    d["gpu"] = gpu_info() if device == "cuda" else {}
    d["cuda"] = {"torch.version.cuda": torch.version.cuda} if device == "cuda" else {}
    d["model"] = model_summary(a.hf)
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[a.dtype]
    caches = [c for c in a.caches.split(",") if c]
    batches = parse_batches(a.batches)
    d["settings"] = {"device": device, "dtype": a.dtype, "attn_implementation": a.attn,
                     "batches": batches, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
                     "repeats": a.repeats, "seed": a.seed, "caches": caches, "torch_compile": False,
                     "deadline_s": a.deadline_s, "warmup_new_tokens": WARMUP_NEW_TOKENS,
                     "search": "greedy (do_sample=False), min_new_tokens = max_new_tokens = N",
                     "decode": "t(generate N new) - t(generate 1 new), over N - 1 steps"}
    report.write()
    t_load = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a.hf, dtype=dtype, attn_implementation=a.attn).to(device).eval()
    d["model"]["load_s"] = round(time.perf_counter() - t_load, 2)
    report.write()
    eos = eos_id(a.hf)
    ids_all = torch.from_numpy(prompt_ids(max(batches), a.prompt_len, eos, a.seed))

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def gen(ids, n, cache):
        kw = dict(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=eos, eos_token_id=eos,
                  use_cache=True, disable_compile=True, attention_mask=torch.ones_like(ids))
        if cache != "dynamic":
            kw["cache_implementation"] = cache
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, **kw)
        sync()
        p = ids.shape[1]
        return time.perf_counter() - t0, out.shape[1] - p, out[0, p:p + 16].tolist(), out[:, p].tolist()

    deadline = Deadline(a.deadline_s)
    for b in batches:
        ids = ids_all[:b].to(device)
        for cache in caches:
            variant = f"hf-{cache}"
            skip = deadline.reason_to_skip(variant)
            if skip:
                d["skipped"].append({"variant": variant, "batch": b, "reason": skip})
                report.write()
                continue
            t_cfg = time.perf_counter()
            row = {"system": "transformers", "variant": variant, "cache": cache, "batch": b,
                   "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "cuda_graph": False}
            try:
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                gen(ids, WARMUP_NEW_TOKENS, cache)
                reps = []
                for _ in range(a.repeats):
                    t1, n1, _, _ = gen(ids, 1, cache)
                    tn, nn, head, firsts = gen(ids, a.new_tokens, cache)
                    dec = tn - t1
                    steps = a.new_tokens - 1
                    reps.append({"prefill_ms": rnd(t1 * 1e3), "generate_n_ms": rnd(tn * 1e3),
                                 "decode_ms": rnd(dec * 1e3), "decode_steps": steps,
                                 "decode_ms_per_step": rnd(dec * 1e3 / max(1, steps), 4),
                                 "generated": [n1, nn], "row0_first16": head,
                                 "first_token_per_row": firsts})
                per_step = median([r["decode_ms_per_step"] for r in reps], 4)
                row.update({
                    "prefill_ms": median([r["prefill_ms"] for r in reps]),
                    "decode_steps": a.new_tokens - 1,
                    "decode_ms_per_step": per_step,
                    "tokens_per_s": rnd(b * 1e3 / per_step, 1) if per_step and per_step > 0 else None,
                    "generated_tokens_ok": all(r["generated"] == [1, a.new_tokens] for r in reps),
                    "row0_first16": reps[0]["row0_first16"],
                    "first_token_per_row": reps[0]["first_token_per_row"],
                    "repeats": reps,
                })
                if device == "cuda":
                    row["peak_gpu_mem_mb"] = round(torch.cuda.max_memory_allocated() / 2**20)
            except Exception as e:  # noqa: BLE001
                row["error"] = scrub(f"{type(e).__name__}: {e}")[:2000]
                row["traceback_tail"] = scrub(traceback.format_exc())[-1500:]
            record_config(d, report, deadline, variant, row, t_cfg)
    return finish(d, report)


# ----------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    m = sub.add_parser("make-model", help="write a random-weight Qwen2.5-1.5B-architecture HF folder")
    m.add_argument("out")
    m.add_argument("--tiny", action="store_true", help="tiny config of the same architecture (CPU tests)")
    m.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    m.add_argument("--seed", type=int, default=0)

    def timing(p):
        p.add_argument("--out", required=True, help="result JSON (rewritten after every configuration)")
        p.add_argument("--batches", default="1,8,32")
        p.add_argument("--prompt-len", type=int, default=128)
        p.add_argument("--new-tokens", type=int, default=128)
        p.add_argument("--repeats", type=int, default=3)
        p.add_argument("--seed", type=int, default=0, help="seed of the prompt ids")
        p.add_argument("--deadline-s", type=float, default=None,
                       help="wall seconds from the script's start; later configurations are skipped")

    g = sub.add_parser("genai", help="onnxruntime-genai: model builder + Generator timing")
    g.add_argument("hf")
    g.add_argument("work", help="folder for the builder's output and cache")
    g.add_argument("--ep", choices=["cuda", "cpu"], default="cuda")
    g.add_argument("--precision", choices=["fp16", "bf16", "fp32", "int4"], default=None,
                   help="default fp16 for cuda, fp32 for cpu")
    g.add_argument("--cuda-graph", choices=["both", "on", "off"], default="both")
    g.add_argument("--rebuild", action="store_true", help="run the builder even if its output is there")
    g.add_argument("--build-only", action="store_true", help="run (or reuse) the builder, time nothing")
    g.add_argument("--no-preload", action="store_true",
                   help="do not call onnxruntime.preload_dlls() before loading the CUDA model")
    timing(g)

    h = sub.add_parser("hf", help="transformers generate timing")
    h.add_argument("hf")
    h.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    h.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    h.add_argument("--attn", default="sdpa", help="attn_implementation")
    h.add_argument("--caches", default="dynamic,static", help="comma list of dynamic / static")
    timing(h)

    a = ap.parse_args(argv)
    if a.cmd == "make-model":
        return cmd_make_model(a)
    if a.new_tokens < 2:
        ap.error("--new-tokens must be at least 2 (the decode part starts after the first token)")
    if a.cmd == "genai":
        return cmd_genai(a)
    return cmd_hf(a)


if __name__ == "__main__":
    sys.exit(main())
