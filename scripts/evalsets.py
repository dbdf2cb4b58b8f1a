"""Shared by the benchmark scripts: the evaluation split of the prompt sets and a machine description."""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "data" / "prompts"
# Evaluation split (data/prompts/README.md): all of humaneval and mt-bench; gsm8k 1001-1319; mbpp 201-257.
EVAL_START = {"humaneval": 0, "mt-bench": 0, "gsm8k": 1000, "mbpp": 200, "aime25": 0, "math500": 400}
EVAL_END = {"humaneval": None, "mt-bench": None, "gsm8k": 1319, "mbpp": 257, "aime25": None, "math500": 500}


def machine() -> str:
    """CPU model, cores, RAM and OS of this machine."""
    from dspark_runtime.sysinfo import machine_description

    return machine_description()


def load_prompts(dataset: str, n: int) -> list:
    """First turns of the first ``n`` evaluation-split prompts of ``dataset``."""
    lines = (PROMPTS / f"{dataset}.jsonl").read_text().splitlines()
    start, end = EVAL_START[dataset], EVAL_END[dataset] or len(lines)
    return [json.loads(l)["turns"][0] for l in lines[start:min(start + n, end)]]
