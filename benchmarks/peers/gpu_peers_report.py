"""What the GPU peers' timing shares: the output JSON (:class:`Report`, its format and timing definitions), the
deadline that skips configurations, the scrubbing of paths and host names from error texts, the prompt ids, the
GPU / package facts recorded with each run. Standard library only (numpy where the prompt is made); used by
``benchmarks.peers.gpu_peers``'s subcommands.
"""
from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

T0 = time.monotonic()
WARMUP_NEW_TOKENS = 8


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

    def skip(self, variant: str, batch: int, reason: str):
        """Record a configuration left out (``skipped``) and rewrite the file."""
        self.data["skipped"].append({"variant": variant, "batch": batch, "reason": reason})
        self.write()

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
