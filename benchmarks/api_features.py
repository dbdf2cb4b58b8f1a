"""What production clients send, through the official ``openai`` client against ``dspark serve``: the same requests to
a target-only server and a speculative one (``--draft auto``) over one loaded engine, one after the other in one
process, and the answers compared.

* logprobs: per position, tokens and top alternatives equal, max |Δ logprob|;
* ``n`` = 3 with a seed: the same call twice gives the same choices (each server), and the choices differ;
* penalties (presence, frequency, repetition; greedy): output identical with speculation on and off;
* JSON schema (:data:`SCHEMAS`, nested objects, enums, arrays): every output valid (``jsonschema``) and identical on
  and off; decode tokens/s with the schema and without it (the same prompts, ``max_tokens`` = the schema output's
  length), tokens the grammar forced, drafts it masked, mask time per token.

    python -m benchmarks.api_features --engine engines/qwen2.5-coder-1.5b --n-each 2 --max-tokens 64 \
        --json results/api-features/api-features-qwen2.5-coder-1.5b.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

PROMPT_SETS = ("humaneval", "mbpp", "gsm8k", "mt-bench")
EVAL_FIRST_LINE = {"humaneval": 1, "mbpp": 201, "gsm8k": 1001, "mt-bench": 1}  # the evaluation split's first lines


def _obj(props: dict, required=None) -> dict:
    return {"type": "object", "properties": props, "required": list(required or props), "additionalProperties": False}


STR = {"type": "string", "maxLength": 40}
#: (request, schema): ≥ 20 schemas of the kinds clients send — nested objects, enums, arrays, numbers with ranges
SCHEMAS = [
    ("Describe the Python function `sorted` as JSON.", _obj({"name": STR, "returns": STR, "stable": {"type": "boolean"}})),
    ("Classify the sentiment of: 'The build finally passes!'", _obj({"sentiment": {"enum": ["positive", "neutral", "negative"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("List three prime numbers below 20.", _obj({"primes": {"type": "array", "items": {"type": "integer", "minimum": 2, "maximum": 19}, "minItems": 3, "maxItems": 3}})),
    ("Give a user record for Ada Lovelace.", _obj({"user": _obj({"first": STR, "last": STR, "born": {"type": "integer", "minimum": 1800, "maximum": 1900}})})),
    ("Extract the city and country from: 'I flew from Lyon, France yesterday.'", _obj({"city": STR, "country": STR})),
    ("Rate this code review comment's severity: 'missing null check'.", _obj({"severity": {"enum": ["low", "medium", "high", "critical"]}, "fix_needed": {"type": "boolean"}})),
    ("Describe a 2x2 identity matrix.", _obj({"rows": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1}, "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}})),
    ("Plan a three-step recipe for tea.", _obj({"steps": {"type": "array", "items": _obj({"n": {"type": "integer", "minimum": 1, "maximum": 3}, "action": STR}), "minItems": 3, "maxItems": 3}})),
    ("What HTTP method creates a resource? Answer as JSON.", _obj({"method": {"enum": ["GET", "POST", "PUT", "DELETE", "PATCH"]}, "idempotent": {"type": "boolean"}})),
    ("Summarize: 'Python 3.12 adds better error messages.'", _obj({"summary": {"type": "string", "maxLength": 80}, "topic": {"enum": ["language", "library", "tooling"]}})),
    ("Give the coordinates of Paris.", _obj({"lat": {"type": "number", "minimum": -90, "maximum": 90}, "lon": {"type": "number", "minimum": -180, "maximum": 180}})),
    ("Describe a git commit that fixes a typo.", _obj({"commit": _obj({"message": STR, "files": {"type": "array", "items": STR, "maxItems": 2}, "breaking": {"type": "boolean"}})})),
    ("Convert 3 hours to minutes.", _obj({"hours": {"type": "integer"}, "minutes": {"type": "integer"}})),
    ("Name two sorting algorithms and their average complexity.", _obj({"algorithms": {"type": "array", "items": _obj({"name": STR, "complexity": {"enum": ["O(n)", "O(n log n)", "O(n^2)"]}}), "minItems": 2, "maxItems": 2}})),
    ("Is 17 prime? Answer as JSON.", _obj({"number": {"type": "integer"}, "prime": {"type": "boolean"}, "reason": STR})),
    ("Describe a book you recommend.", _obj({"title": STR, "author": STR, "year": {"type": "integer", "minimum": 1500, "maximum": 2026}, "genres": {"type": "array", "items": {"enum": ["fiction", "science", "history", "tech"]}, "maxItems": 2}})),
    ("Make a to-do item for writing tests.", _obj({"todo": _obj({"title": STR, "priority": {"enum": [1, 2, 3]}, "done": {"type": "boolean"}})})),
    ("Describe the config of a web server.", _obj({"server": _obj({"host": STR, "port": {"type": "integer", "minimum": 1, "maximum": 65535}, "tls": _obj({"enabled": {"type": "boolean"}, "version": {"enum": ["1.2", "1.3"]}})})})),
    ("Give a JSON answer: what is 12 * 12?", _obj({"expression": STR, "value": {"type": "integer"}})),
    ("Tag this question: 'How do I reverse a list in Python?'", _obj({"tags": {"type": "array", "items": {"enum": ["python", "lists", "strings", "performance"]}, "minItems": 1, "maxItems": 3}, "answerable": {"type": "boolean"}})),
    ("Describe a unit test for an add function.", _obj({"test": _obj({"name": STR, "inputs": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}, "expected": {"type": "integer"}})})),
    ("Report the weather as JSON for a sunny 25 degree day.", _obj({"condition": {"enum": ["sunny", "cloudy", "rain", "snow"]}, "celsius": {"type": "integer", "minimum": -50, "maximum": 60}, "wind": _obj({"kmh": {"type": "integer", "minimum": 0, "maximum": 200}})})),
]


def eval_prompts(n_each: int) -> list:
    """The first ``n_each`` evaluation prompts of each set in :data:`PROMPT_SETS` (first turns) as chat messages."""
    root = Path(__file__).resolve().parents[1] / "dspark_export" / "data" / "prompts"
    out = []
    for name in PROMPT_SETS:
        lines = (root / f"{name}.jsonl").read_text().splitlines()
        first = EVAL_FIRST_LINE[name] - 1
        out += [(name, [{"role": "user", "content": json.loads(ln)["turns"][0]}]) for ln in lines[first:first + n_each]]
    return out


def run_side(engine, draft, args, log) -> dict:
    """Every request of the benchmark against one server over ``engine`` (``draft``: None = target-only)."""
    import openai

    from dspark_runtime.serving.app import create_app
    from dspark_runtime.serving.server import ServerThread

    app = create_app(engine, draft=draft, max_batch=1 if args.serial else 4)
    srv = ServerThread(app, timeout_graceful_shutdown=10).start()
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=1800)
    model = app.state.model_name
    side = {"draft": draft or "none"}
    try:
        t = time.perf_counter()
        side["logprobs"] = []
        for name, msgs in eval_prompts(args.n_each):
            r = c.chat.completions.create(model=model, messages=msgs, max_tokens=args.max_tokens, temperature=0,
                                          logprobs=True, top_logprobs=5)
            side["logprobs"].append({"set": name, "text": r.choices[0].message.content,
                                     "content": [{"token": x.token, "bytes": x.bytes, "logprob": x.logprob,
                                                  "top": [[y.token, y.logprob] for y in x.top_logprobs]}
                                                 for x in r.choices[0].logprobs.content],
                                     "dspark": r.model_extra.get("dspark")})
        log(f"  [{side['draft']}] logprobs {time.perf_counter() - t:.0f} s")
        t = time.perf_counter()
        side["penalties"] = []
        for name, msgs in eval_prompts(args.n_each):
            r = c.chat.completions.create(model=model, messages=msgs, max_tokens=args.max_tokens, temperature=0,
                                          presence_penalty=0.6, frequency_penalty=0.4,
                                          extra_body={"repetition_penalty": 1.1})
            side["penalties"].append({"set": name, "text": r.choices[0].message.content,
                                      "dspark": r.model_extra.get("dspark")})
        log(f"  [{side['draft']}] penalties {time.perf_counter() - t:.0f} s")
        t = time.perf_counter()
        msgs = eval_prompts(1)[3][1]
        kw = dict(model=model, messages=msgs, max_tokens=32, temperature=0.8, top_p=0.95, n=3, seed=2026)
        a, b = c.chat.completions.create(**kw), c.chat.completions.create(**kw)
        side["n3"] = {"first": [x.message.content for x in a.choices], "second": [x.message.content for x in b.choices],
                      "usage": a.usage.model_dump()}
        log(f"  [{side['draft']}] n=3 {time.perf_counter() - t:.0f} s")
        t = time.perf_counter()
        side["schemas"] = []
        for i, (ask, schema) in enumerate(SCHEMAS):
            fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
            messages = [{"role": "user", "content": ask + " Answer with JSON only."}]
            r = c.chat.completions.create(model=model, messages=messages, max_tokens=args.schema_tokens,
                                          temperature=0, response_format=fmt)
            out = {"text": r.choices[0].message.content, "finish": r.choices[0].finish_reason,
                   "tokens": r.usage.completion_tokens, "dspark": r.model_extra.get("dspark")}
            u = c.chat.completions.create(model=model, messages=messages, max_tokens=max(1, r.usage.completion_tokens),
                                          temperature=0)
            out["free"] = {"tokens": u.usage.completion_tokens, "dspark": u.model_extra.get("dspark")}
            side["schemas"].append(out)
        log(f"  [{side['draft']}] schemas {time.perf_counter() - t:.0f} s")
        side["metrics"] = {ln.split()[0]: float(ln.split()[1]) for ln in
                           __import__("httpx").get(srv.url + "/metrics").text.splitlines()
                           if ln.startswith(("dspark_constrained", "dspark_forced", "dspark_masked"))}
    finally:
        srv.stop()
    return side


def compare(off: dict, on: dict) -> dict:
    """The must-show verdicts of one run from the two sides."""
    import jsonschema

    lp = []
    for a, b in zip(off["logprobs"], on["logprobs"]):
        same = [x["bytes"] == y["bytes"] for x, y in zip(a["content"], b["content"])]
        n = len(same) if all(same) and len(a["content"]) == len(b["content"]) else same.index(False) if False in same \
            else min(len(a["content"]), len(b["content"]))
        diffs = [abs(x["logprob"] - y["logprob"]) for x, y in zip(a["content"][:n], b["content"][:n])]
        tops = all([t[0] for t in x["top"]] == [t[0] for t in y["top"]] for x, y in zip(a["content"][:n], b["content"][:n]))
        lp.append({"set": a["set"], "tokens": len(a["content"]), "identical_tokens": a["text"] == b["text"],
                   "max_abs_logprob_diff": max(diffs) if diffs else 0.0, "top5_ids_equal": tops,
                   "positions_differing": sum(d > 0 for d in diffs)})
    pen = [{"set": a["set"], "identical": a["text"] == b["text"], "chars": len(a["text"])}
           for a, b in zip(off["penalties"], on["penalties"])]
    sch = []
    for (ask, schema), a, b in zip(SCHEMAS, off["schemas"], on["schemas"]):
        valid = []
        for side in (a, b):
            try:
                jsonschema.validate(json.loads(side["text"]), schema)
                valid.append(True)
            except (ValueError, jsonschema.ValidationError):
                valid.append(False)
        sch.append({"ask": ask, "valid_off": valid[0], "valid_on": valid[1], "identical": a["text"] == b["text"],
                    "finish_on": b["finish"], "tokens": b["tokens"],
                    "forced_on": b["dspark"]["grammar"]["forced_tokens"], "forced_off": a["dspark"]["grammar"]["forced_tokens"],
                    "masked_drafts_on": b["dspark"]["grammar"]["masked_drafts"],
                    "mask_ms_per_token_on": b["dspark"]["grammar"]["mask_ms"] / max(1, b["dspark"]["grammar"]["masks"]),
                    "tok_s": {"off_schema": a["dspark"]["tokens_per_second"], "on_schema": b["dspark"]["tokens_per_second"],
                              "off_free": a["free"]["dspark"]["tokens_per_second"],
                              "on_free": b["free"]["dspark"]["tokens_per_second"]}})
    gm = lambda xs: statistics.geometric_mean([x for x in xs if x > 0]) if any(x > 0 for x in xs) else 0.0  # noqa: E731
    speed = {k: gm([s["tok_s"][k] for s in sch]) for k in ("off_schema", "on_schema", "off_free", "on_free")}
    return {"logprobs": lp, "penalties": pen, "schemas": sch,
            "n3": {side: {"reproducible": d["n3"]["first"] == d["n3"]["second"], "distinct": len(set(d["n3"]["first"]))}
                   for side, d in (("off", off), ("on", on))},
            "summary": {"logprobs_max_abs_diff": max(x["max_abs_logprob_diff"] for x in lp),
                        "logprobs_identical_tokens": sum(x["identical_tokens"] for x in lp),
                        "penalties_identical": sum(x["identical"] for x in pen), "prompts": len(pen),
                        "schemas": len(sch), "schemas_valid_on": sum(s["valid_on"] for s in sch),
                        "schemas_valid_off": sum(s["valid_off"] for s in sch),
                        "schemas_identical": sum(s["identical"] for s in sch),
                        "schema_tokens": sum(s["tokens"] for s in sch),
                        "forced_tokens_on": sum(s["forced_on"] for s in sch),
                        "masked_drafts_on": sum(s["masked_drafts_on"] for s in sch),
                        "mask_ms_per_mask_median": statistics.median(s["mask_ms_per_token_on"] for s in sch),
                        "decode_tok_s_geomean": speed}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, required=True)
    ap.add_argument("--n-each", type=int, default=1, help="evaluation prompts per set for logprobs and penalties")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--schema-tokens", type=int, default=256, help="max_tokens of a schema request (no truncation)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--serial", action="store_true", help="max_batch 1 (default 4; requests are sent one at a time)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from dspark_runtime import Engine
    from dspark_runtime.machine.sysinfo import machine_description

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    engine = Engine.load(args.engine, threads=args.threads)
    t0 = time.perf_counter()
    off = run_side(engine, None, args, log)
    on = run_side(engine, "auto", args, log)
    res = compare(off, on)
    res.update({"engine": str(args.engine), "machine": machine_description(), "threads": args.threads,
                "row_multiple": engine.row_multiple, "wall_s": round(time.perf_counter() - t0, 1),
                "date": time.strftime("%Y-%m-%d %H:%M"), "sides": {"off": off, "on": on}})
    print(json.dumps(res["summary"], indent=1))
    print(json.dumps({"n3": res["n3"], "logprobs": res["logprobs"]}, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1))
    ok = (res["summary"]["schemas_valid_on"] == len(SCHEMAS) and res["summary"]["schemas_identical"] == len(SCHEMAS)
          and res["summary"]["penalties_identical"] == res["summary"]["prompts"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
