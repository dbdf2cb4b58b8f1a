"""The compared systems (the extension point) and the peers' venvs and files.

A :class:`System` names a backend and its options; ``name@T<t>`` variants run it at temperature t. The peers
(llama.cpp, ONNX Runtime GenAI, OpenVINO GenAI) each live in their own venv under --peer-dir
(``benchmarks/peers/install.sh``), never a project dependency; a selected peer that is not installed is refused before
anything runs, with the command that installs it. A peer's speculative variant is compared with its own target-only
system (``baseline``).
"""
from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class System:
    """One compared system.

    backend: "hf" (transformers ``generate`` on the --target folder) or "dspark" (``Engine`` on
    --engine). options, per backend:
      hf:     assistant (bool: --draft as ``assistant_model``), prompt_lookup_num_tokens (int),
              generate_kwargs (dict, passed to ``generate`` as is).
      dspark: draft (None | "lm" | "ngram" | any name ``Engine.generate(draft=)`` accepts),
              draft_length (int | "auto" | "scheduled"), engine (a directory overriding --engine), prompts (where
              prompt chunks run: ``Engine.load(prompts=)``, default "auto").
      openvino-genai (peer openvino): prompt_lookup ({"num_assistant_tokens", "max_ngram_size"}), draft (true: the
              --draft model's OpenVINO export as draft_model; {"num_assistant_tokens": N} to set its length).
    """

    name: str
    backend: str
    options: dict = field(default_factory=dict)
    description: str = ""
    # the peer (benchmarks/peers/install.sh NAME) whose own venv runs this system's worker; None: the project's
    peer: str | None = None
    # a peer's own target-only system (same weights): greedy, it must reproduce its tokens; compared as
    # ``vs_baseline`` besides the REFERENCES (the project's systems have those as their baselines)
    baseline: str | None = None


SYSTEMS = {s.name: s for s in [
    System("hf", "hf", {}, "transformers generate, fp32 torch CPU, plain decoding"),
    System("hf-assisted", "hf", {"assistant": True},
           "transformers assisted generation, --draft as assistant_model, transformers' default schedule"),
    System("hf-pld", "hf", {"prompt_lookup_num_tokens": 10},
           "transformers prompt lookup decoding (prompt_lookup_num_tokens=10, max_matching_ngram_size default 2)"),
    System("dspark-target", "dspark", {"draft": None}, "DSpark runtime, target only"),
    # our default configuration: whatever `--draft auto` picks on --engine (Engine.auto_draft), its default length
    System("dspark-auto", "dspark", {"draft": "auto"}, "DSpark runtime, --draft auto (the engine's default "
           "drafter and draft length)"),
    # prompt chunks on the int4 target itself (`--prompts target`: what an engine without a prompt graph does; less
    # memory, a longer time to first token)
    System("dspark-target-int4-prompts", "dspark", {"draft": None, "prompts": "target"},
           "DSpark runtime, target only, prompt chunks on the int4 target (--prompts target)"),
    # prompt chunks on ONNX Runtime's OpenVINO provider (`--prompts openvino`: Intel CPUs, the openvino extra); the
    # speculative one is compared with its own target-only system (the prompt's numerics are OpenVINO's)
    System("dspark-target-openvino", "dspark", {"draft": None, "prompts": "openvino"},
           "DSpark runtime, target only, prompt chunks on ONNX Runtime's OpenVINO provider (--prompts openvino)"),
    System("dspark-auto-openvino", "dspark", {"draft": "auto", "prompts": "openvino"},
           "DSpark runtime, --draft auto, prompt chunks on ONNX Runtime's OpenVINO provider (--prompts openvino)",
           baseline="dspark-target-openvino"),
    # the fp32 graph of the same weights: the reference every other system's greedy agreement is measured against
    System("dspark-fp32", "dspark", {"draft": None, "engine": "engines/qwen2.5-coder-1.5b-fp32"},
           "DSpark runtime, fp32 target only (engines/qwen2.5-coder-1.5b-fp32: `dspark-export build "
           "engines/qwen2.5-coder-1.5b.json --precision fp32 --name qwen2.5-coder-1.5b-fp32`)"),
    # the exact GGUF re-pack (the int4 default before gguf-compact): target-only steps before/after in one run
    System("dspark-target-exact", "dspark", {"draft": None, "engine": "engines/qwen2.5-coder-1.5b-exact"},
           "DSpark runtime, target only, int4 target re-packed exactly from the GGUF with its LM head read whole "
           "(engines/qwen2.5-coder-1.5b-exact: `dspark-export build qwen2.5-coder-1.5b --lm-head full --name "
           "qwen2.5-coder-1.5b-exact`)"),
    System("dspark-lm", "dspark", {"draft": "lm", "draft_length": 3}, "DSpark runtime, draft LM, gamma 3"),
    System("dspark-ngram", "dspark", {"draft": "ngram", "draft_length": 4},
           "DSpark runtime, n-gram prompt lookup, gamma 4"),
    System("dspark-lm-int8", "dspark", {"draft": "lm", "draft_length": 3,
                                        "engine": "engines/qwen2.5-coder-1.5b-int8draft"},
           "DSpark runtime, dynamic-INT8 draft LM (fp32 target), gamma 3"),
    # the DSpark block drafter compiled beside the 0.5B draft (dspark-export add-draft; scripts/quickstart.sh)
    System("dspark-drafter", "dspark", {"draft": "dspark", "draft_length": 7},
           "DSpark runtime, DSpark drafter trained on this CPU, block 7"),
    # per round n-gram lookup or the DSpark block, verify length by Algorithm 1 (needs `dspark-export calibrate`
    # and `dspark-export profile` on the engine: router priors and the cost table)
    System("dspark-router", "dspark", {"draft": "router", "draft_length": "scheduled"},
           "DSpark runtime, router (n-gram lookup or DSpark drafter per round), scheduled verify length"),
    # ---- peers: what users would pick instead, each in its own venv (benchmarks/peers/install.sh), fed the
    # preflight's prompt token ids; they run the Q4 GGUF the models were fetched as (llama.cpp) or an int4
    # graph of ONNX Runtime GenAI's model builder: other weights than the fp32 systems, so greedy outputs
    # differ from hf/dspark-target at near-ties (reported, not hidden); each is compared with its own
    # target-only decoding as its baseline.
    System("llama-cpp", "llama-cpp", {}, "llama.cpp (llama-cpp-python), Q4_K_M GGUF of the target, greedy, "
           "logits_all=False", peer="llama-cpp"),
    System("llama-cpp-pld", "llama-cpp", {"prompt_lookup": 10},
           "llama-cpp-python with LlamaPromptLookupDecoding(num_pred_tokens=10, max_ngram_size 2) as draft_model "
           "(the library then keeps logits for every position)", peer="llama-cpp", baseline="llama-cpp"),
    System("llama-speculative", "llama-speculative", {},
           "llama.cpp's llama-speculative binary: Q4_K_M 1.5B target, -md the 0.5B GGUF draft, --temp 0, its "
           "default draft length (3), one process per prompt (prompt as chat-template text, its tokenization "
           "checked equal to the preflight ids)", peer="llama-cpp", baseline="llama-cpp"),
    System("ort-genai", "ort-genai", {}, "ONNX Runtime GenAI, int4 graph of its model builder (-p int4 -e cpu), "
           "greedy (do_sample False)", peer="ort-genai"),
    System("ort-genai-ngram", "ort-genai", {"speculative": {"ngram_size": 3, "max_draft_tokens": 4}},
           "ONNX Runtime GenAI n-gram speculative decoding (set_speculative_options ngram_size 3, "
           "max_draft_tokens 4: its documented starting point), same int4 graph", peer="ort-genai",
           baseline="ort-genai"),
    # OpenVINO GenAI's LLMPipeline on CPU runs its paged-attention (continuous batching) backend for all three;
    # OpenVINO's CPU defaults stay as they are (the worker records the precisions they give)
    System("openvino-genai", "openvino-genai", {},
           "OpenVINO GenAI LLMPipeline (CPU, INFERENCE_NUM_THREADS = --threads), int4 model of `optimum-cli export "
           "openvino --weight-format int4` (its default int4 config), greedy; OpenVINO's CPU defaults "
           "(inference precision, u8 KV cache, dynamic activation quantization) as recorded", peer="openvino"),
    System("openvino-genai-pld", "openvino-genai", {"prompt_lookup": {"num_assistant_tokens": 10,
                                                                      "max_ngram_size": 2}},
           "OpenVINO GenAI prompt lookup decoding (LLMPipeline prompt_lookup=True, num_assistant_tokens 10, "
           "max_ngram_size 2: as llama-cpp-pld; it verifies all 10 positions every round, a lookup miss padded), "
           "same int4 model", peer="openvino", baseline="openvino-genai"),
    System("openvino-genai-draft", "openvino-genai", {"draft": True},
           "OpenVINO GenAI speculative decoding: LLMPipeline with draft_model = the 0.5B draft exported the same way "
           "(int4), its default num_assistant_tokens (5)", peer="openvino", baseline="openvino-genai"),
]}
PEER_INSTALL = {"llama-cpp": "benchmarks/peers/install.sh llama-cpp",
                "ort-genai": "benchmarks/peers/install.sh ort-genai",
                "openvino": "benchmarks/peers/install.sh openvino"}
REFERENCES = ("hf", "dspark-target", "dspark-fp32")  # greedy outputs are compared with these


def variant_name(system: str, temperature: float) -> str:
    """The key of one (system, temperature) pair: the system's name when greedy, else
    ``name@T<temperature>`` (e.g. ``hf-assisted@T1``)."""
    return system if temperature == 0 else f"{system}@T{temperature:g}"


def split_variant(name: str) -> tuple:
    """Inverse of :func:`variant_name`: ``"dspark-lm@T1"`` -> ``("dspark-lm", 1.0)``."""
    base, sep, t = name.partition("@T")
    return (base, float(t)) if sep else (name, 0.0)


def reference_for(variant: str, ref: str) -> str:
    """The reference a variant's ratios use: the same reference system at the same temperature."""
    return variant_name(ref, split_variant(variant)[1])


def default_peer_dir() -> Path:
    """``$DSPARK_PEER_DIR``, else ``${DSPARK_CACHE:-~/.cache/dspark}/peers`` (where install.sh puts them)."""
    if os.environ.get("DSPARK_PEER_DIR"):
        return Path(os.environ["DSPARK_PEER_DIR"]).expanduser()
    from dspark_runtime.engine_dir.manifest import cache_root

    return cache_root() / "peers"


def peer_python(peer_dir, peer: str) -> Path:
    return Path(peer_dir) / peer / "venv" / "bin" / "python"


def peer_files(peer_dir, target_name: str, draft_name: str | None = None) -> dict:
    """The files the peer systems load besides the GGUFs: the llama-speculative binary, the ort-genai model, the
    OpenVINO models of the target and of the draft (``install.sh openvino-model``; the draft's only when named)."""
    d = Path(peer_dir)
    ov = d / "openvino" / "models"
    return {"llama_speculative": d / "llama-cpp" / "bin" / "llama-speculative",
            "ort_model": d / "ort-genai" / "models" / f"{target_name}-int4",
            "ov_model": ov / f"{target_name}-int4",
            "ov_draft_model": ov / f"{draft_name}-int4" if draft_name else None}


def install_command(cmd: str, peer_dir) -> str:
    """``cmd`` with the DSPARK_PEER_DIR that makes install.sh write into ``peer_dir`` when it is not the default."""
    if Path(peer_dir).expanduser().resolve() != default_peer_dir().resolve():
        return f"DSPARK_PEER_DIR={shlex.quote(str(peer_dir))} {cmd}"
    return cmd


def peer_requirements(system: str, peer_dir, target_name: str, draft_name: str, target_gguf, draft_gguf) -> list:
    """[(path that must exist, command that makes it)] for one system ([] for the project's systems)."""
    sd = SYSTEMS[split_variant(system)[0]]
    if sd.peer is None:
        return []
    files = peer_files(peer_dir, target_name, draft_name)
    need = [(peer_python(peer_dir, sd.peer), install_command(PEER_INSTALL[sd.peer], peer_dir))]
    if sd.backend in ("llama-cpp", "llama-speculative"):
        need.append((Path(target_gguf), f"dspark-export fetch {target_name}"))
    if sd.backend == "llama-speculative":
        need += [(files["llama_speculative"], install_command(PEER_INSTALL["llama-cpp"], peer_dir)),
                 (Path(draft_gguf), f"dspark-export fetch {draft_name}")]
    if sd.backend == "ort-genai":
        need.append((files["ort_model"] / "genai_config.json",
                     install_command(f"benchmarks/peers/install.sh ort-genai-model {target_name}", peer_dir)))
    if sd.backend == "openvino-genai":
        for key, name in [("ov_model", target_name)] + ([("ov_draft_model", draft_name)] if sd.options.get("draft")
                                                         else []):
            need.append((files[key] / "openvino_model.xml",
                         install_command(f"benchmarks/peers/install.sh openvino-model {name}", peer_dir)))
    return need


def check_peers(systems: list, peer_dir, target_name: str, draft_name: str, target_gguf, draft_gguf) -> list:
    """One message per system whose peer (venv, binary, model) is missing, with the command that installs it."""
    msgs = []
    for s in systems:
        miss = [(p, cmd) for p, cmd in peer_requirements(s, peer_dir, target_name, draft_name, target_gguf, draft_gguf)
                if not Path(p).exists()]
        if miss:
            msgs.append(f"system {s} needs its peer ({SYSTEMS[split_variant(s)[0]].peer}): "
                        + "; ".join(f"{p} is missing, run `{cmd}`" for p, cmd in miss))
    return msgs


def gguf_for(model_dir: Path, override: str | None = None) -> Path:
    """The GGUF a fetched model was converted from (``<cache>/gguf/<name>.gguf``), or ``override``."""
    if override:
        return Path(override).expanduser().resolve()
    try:
        from dspark_export.models.catalog import gguf_path

        return gguf_path(model_dir.name)
    except Exception:  # not a known model name: the cache layout by folder name
        return default_peer_dir().parent / "gguf" / f"{model_dir.name}.gguf"


def peer_context(n_prompt_max: int, max_new_tokens: int) -> int:
    """KV context of the llama.cpp peers: the longest prompt + the new tokens + a margin (llama-speculative
    finishes its last round past -n), rounded up to 256, at least 2048; one value for the whole run."""
    need = n_prompt_max + max_new_tokens + 64
    return max(2048, -(-need // 256) * 256)


def peer_job_fields(system: str, settings: dict, peer_dir: Path) -> dict:
    """What a peer system's worker job needs besides the common fields: its python and its files."""
    sd = SYSTEMS[split_variant(system)[0]]
    if sd.peer is None:
        return {}
    pm = settings["peer_models"]
    return {"python": str(peer_python(peer_dir, sd.peer)), "target_gguf": pm["target_gguf"],
            "draft_gguf": pm["draft_gguf"], "llama_speculative": pm["llama_speculative"],
            "ort_model": pm["ort_model"], "ov_model": pm.get("ov_model"), "ov_draft_model": pm.get("ov_draft_model"),
            "n_ctx": settings["peer_n_ctx"]}
