"""Cost of response_format constraints (``dspark_runtime.decoding.grammar``, llguidance) on a real vocabulary, and
outlines-core's for comparison when it is installed (it is no dependency: ``pip install outlines-core`` to include it).

For each schema kind it compiles the grammar (cold: a schema not seen before; cached: the same schema again) and
walks it two ways: ``lowest`` takes the forced tokens, else the lowest allowed id (the walk of the tests; capped at
``--tokens``), ``doc`` consumes the tokenization of a realistic document that follows the schema. Per token it times
``Grammar.allowed()`` (llguidance's mask plus unpacking it to bool [vocab]), ``mask_logits`` on a float32 row with
the mask known (the numpy part), ``consume`` and ``forced``; and per 8-token block what the decoding loop does for a
verify block: 8 times (mask, mask a logits row, consume the draft), then roll the 8 back. Along the ``doc`` walk
outlines-core (same tokens; its regex index is compiled ahead, so its mask is a table look-up) is timed the same way.
Prints tables; ``--json PATH`` writes every number.

    python -m benchmarks.grammar_mask_cost                       # Qwen2.5 tokenizer of engines/qwen2.5-coder-1.5b
    python -m benchmarks.grammar_mask_cost --repeat 3 --json results/grammar_mask_cost.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from dspark_runtime.machine.sysinfo import machine_description, usable_cpus

TOKENIZER = Path("engines/qwen2.5-coder-1.5b/tokenizer/tokenizer.json")
BLOCK = 8

TICKET = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "status": {"enum": ["open", "in_progress", "closed"]},
        "priority": {"enum": ["low", "medium", "high", "critical"]},
        "owner": {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"},
                                                    "teams": {"type": "array", "items": {"type": "string"}}},
                  "required": ["name", "email", "teams"], "additionalProperties": False},
        "labels": {"type": "array", "items": {"enum": ["bug", "feature", "docs", "perf"]}, "maxItems": 4},
        "estimate_hours": {"type": "number"},
    },
    "required": ["id", "status", "priority", "owner", "labels", "estimate_hours"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "$defs": {"item": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": {"type": "integer", "minimum": 1},
        "unit_price": {"type": "number"}, "gift": {"type": "boolean"}},
        "required": ["sku", "qty", "unit_price", "gift"], "additionalProperties": False}},
    "properties": {"order_id": {"type": "string"}, "items": {"type": "array", "items": {"$ref": "#/$defs/item"},
                                                             "minItems": 1},
                   "currency": {"enum": ["EUR", "USD", "GBP"]}},
    "required": ["order_id", "items", "currency"],
    "additionalProperties": False,
}
EVENT = {
    "type": "object",
    "properties": {
        "when": {"type": "string", "format": "date-time"},
        "payload": {"anyOf": [
            {"type": "object", "properties": {"kind": {"const": "click"}, "x": {"type": "integer"},
                                              "y": {"type": "integer"}},
             "required": ["kind", "x", "y"], "additionalProperties": False},
            {"type": "object", "properties": {"kind": {"const": "key"}, "key": {"type": "string", "maxLength": 16}},
             "required": ["kind", "key"], "additionalProperties": False}]},
        "note": {"type": ["string", "null"]},
    },
    "required": ["when", "payload", "note"],
    "additionalProperties": False,
}
FLAT = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                   "height_m": {"type": "number"}, "active": {"type": "boolean"}, "city": {"type": "string"}},
    "required": ["name", "age", "height_m", "active", "city"],
    "additionalProperties": False,
}
# (name, response_format schema or None for json_object, a document that follows it; llguidance keeps the
# properties in the schema's order)
CASES = [
    ("json_object", None, {"title": "Speculative decoding", "year": 2023, "authors": ["Leviathan", "Kalman",
                                                                                    "Matias"],
                           "venue": {"name": "ICML", "oral": True}, "pages": [19274, 19286], "doi": None}),
    ("flat object", FLAT, {"name": "Ada Lovelace", "age": 36, "height_m": 1.65, "active": False,
                           "city": "London"}),
    ("nested + enums + arrays", TICKET, {
        "id": 4127, "status": "in_progress", "priority": "high",
        "owner": {"name": "Grace Hopper", "email": "grace@example.com", "teams": ["compilers", "navy"]},
        "labels": ["bug", "perf"], "estimate_hours": 3.5}),
    ("array of $ref objects", ORDER, {"order_id": "A-1009", "items": [
        {"sku": "ABC-1234", "qty": 2, "unit_price": 9.99, "gift": False},
        {"sku": "XYZ-0007", "qty": 1, "unit_price": 120.0, "gift": True}], "currency": "EUR"}),
    ("anyOf + format + const", EVENT, {"when": "2024-05-01T12:30:00Z",
                                       "payload": {"kind": "key", "key": "Enter"}, "note": None}),
]


def _rf(schema, bust: str | None = None) -> dict:
    """The response_format of a case; ``bust`` adds a title so that the compiler's cache misses."""
    if schema is None and bust is None:
        return {"type": "json_object"}
    schema = dict(schema or {"type": "object"})
    if bust:
        schema["title"] = bust
    return {"type": "json_schema", "json_schema": {"name": "case", "schema": schema}}


def _pct(xs, q) -> float:
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def _walk(g, tokens, rows, limit):
    """Walk ``g`` along ``tokens`` (or, when None, the forced tokens else the lowest allowed id, at most ``limit``);
    time each step's parts. Returns (tokens walked, {part: [seconds]})."""
    parts = {"mask": [], "apply": [], "consume": [], "forced": []}
    out = []
    i = 0
    while not g.finished and (len(out) < limit if tokens is None else i < len(tokens)):
        x = rows[len(out) % len(rows)].copy()
        t0 = time.perf_counter()
        a = g.allowed()
        t1 = time.perf_counter()
        g.mask_logits(x)
        t2 = time.perf_counter()
        f = g.forced(BLOCK)
        t3 = time.perf_counter()
        tok = tokens[i] if tokens is not None else (f[0] if f else int(np.flatnonzero(a)[0]))
        if not a[tok]:
            raise SystemExit(f"the document's token {tok} at {i} is not allowed: the case is wrong")
        t4 = time.perf_counter()
        g.consume([tok])
        t5 = time.perf_counter()
        parts["mask"].append(t1 - t0)
        parts["apply"].append(t2 - t1)
        parts["forced"].append(t3 - t2)
        parts["consume"].append(t5 - t4)
        out.append(tok)
        i += 1
    return out, parts


def _blocks(g, tokens, rows):
    """The loop's verify block along ``tokens``: per block of 8, mask + mask a row + consume each, then roll the 8
    back (timed), then consume them again to move on (untimed). Seconds per block."""
    out = []
    for p in range(0, len(tokens) - BLOCK + 1, BLOCK):
        blk = tokens[p:p + BLOCK]
        x = rows[:BLOCK].copy()
        t0 = time.perf_counter()
        for k, tok in enumerate(blk):
            g.allowed()
            g.mask_logits(x[k])
            g.consume([tok])
        g.rollback(BLOCK)
        out.append(time.perf_counter() - t0)
        g.consume(blk)
    return out


def _outlines(compiler, schema, tokens, rows, eos, vocab_size):
    """outlines-core on the same tokens: (compile seconds, per-token mask seconds, per-block seconds) or an error."""
    try:
        import outlines_core as oc
    except ImportError:
        return None
    if not hasattr(_outlines, "vocab"):
        lt = compiler.ll_tokenizer
        m = {}
        for i in range(compiler.tokenizer_size):
            if i not in eos and not lt.is_special_token(i):
                m.setdefault(lt.decode_bytes([i]), []).append(i)
        t0 = time.perf_counter()
        _outlines.vocab = oc.Vocabulary(eos[0], m)
        _outlines.vocab_s = time.perf_counter() - t0
        _outlines.version = getattr(oc, "__version__", None) or _version("outlines-core")
    try:
        t0 = time.perf_counter()
        regex = oc.json_schema.build_regex_from_schema(json.dumps(schema or {"type": "object"}))
        index = oc.Index(regex, _outlines.vocab)
        compile_s = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - a schema outlines-core does not support
        return {"error": " ".join(str(e).split())[:200]}
    guide = oc.Guide(index, max_rollback=BLOCK)
    bits = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)

    def mask_row(x):
        guide.write_mask_into(bits.ctypes.data, bits.size, 4)
        a = np.unpackbits(bits.view(np.uint8), count=vocab_size, bitorder="little").view(bool)
        np.copyto(x, -np.inf, where=~a)
        return a

    masks = []
    try:
        for tok in tokens:
            t0 = time.perf_counter()
            guide.write_mask_into(bits.ctypes.data, bits.size, 4)
            masks.append(time.perf_counter() - t0)
            guide.advance(tok, return_tokens=False)
        guide.reset()
        blocks = []
        for p in range(0, len(tokens) - BLOCK + 1, BLOCK):
            blk = tokens[p:p + BLOCK]
            x = rows[:BLOCK].copy()
            t0 = time.perf_counter()
            for k, tok in enumerate(blk):
                mask_row(x[k])
                guide.advance(tok, return_tokens=False)
            guide.rollback_state(BLOCK)
            blocks.append(time.perf_counter() - t0)
            for tok in blk:
                guide.advance(tok, return_tokens=False)
    except Exception as e:  # noqa: BLE001 - the document's tokenization is outside outlines-core's regex
        return {"compile_s": compile_s, "error": " ".join(str(e).split())[:200]}
    return {"compile_s": compile_s, "mask_us_p50": _pct(masks, 50) * 1e6, "mask_us_p90": _pct(masks, 90) * 1e6,
            "block_ms_p50": _pct(blocks, 50) * 1e3, "tokens": len(tokens)}


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=TOKENIZER, help=f"tokenizer.json (default {TOKENIZER})")
    ap.add_argument("--vocab-size", type=int, default=151936, help="the model's logits width (default Qwen2.5's)")
    ap.add_argument("--eos", type=int, nargs="+", default=[151645, 151643], help="EOS ids (default Qwen's)")
    ap.add_argument("--tokens", type=int, default=128, help="cap of the lowest-id walk (default 128)")
    ap.add_argument("--repeat", type=int, default=3, help="cold compiles + walks per case (default 3)")
    ap.add_argument("--no-outlines", action="store_true", help="skip outlines-core even when installed")
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args(argv)
    if not a.tokenizer.is_file():
        print(f"{a.tokenizer} not found: this benchmark needs a real tokenizer (build or fetch the "
              f"qwen2.5-coder-1.5b engine, or pass --tokenizer); nothing measured")
        return 0
    try:
        from dspark_runtime.decoding.grammar import GrammarCompiler
        from dspark_runtime.errors import InputError

        t0 = time.perf_counter()
        compiler = GrammarCompiler(a.tokenizer, a.vocab_size, a.eos)
        build_s = time.perf_counter() - t0
    except InputError as e:
        print(f"{e}; nothing measured")
        return 0
    rng = np.random.default_rng(0)
    rows = (rng.standard_normal((BLOCK, a.vocab_size)) * 3).astype(np.float32)
    ll_tok = compiler.ll_tokenizer
    print(f"machine: {machine_description()}; usable CPUs {usable_cpus()}")
    print(f"llguidance {compiler.version}; numpy {np.__version__}; {a.tokenizer} ({compiler.tokenizer_size} ids, "
          f"logits width {a.vocab_size}); tokenizer build {build_s:.2f} s; {a.repeat} cold compiles per case")
    results = []
    for name, schema, doc in CASES:
        doc_tokens = ll_tok.tokenize_str(json.dumps(doc))
        rec = {"case": name, "schema": schema, "document": doc, "compile_ms": [], "first_mask_ms": []}
        for walk in ("lowest", "doc"):
            rec[walk] = {"mask": [], "apply": [], "consume": [], "forced": []}
        blocks = []
        for r in range(a.repeat):
            t0 = time.perf_counter()
            g = compiler.compile(_rf(schema, bust=f"r{r}-{time.perf_counter_ns()}"))
            rec["compile_ms"].append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            g.allowed()
            rec["first_mask_ms"].append((time.perf_counter() - t0) * 1e3)
            for walk, toks in (("lowest", None), ("doc", doc_tokens)):
                h = g.fork()
                walked, parts = _walk(h, toks, rows, a.tokens)
                rec[f"{walk}_tokens"] = len(walked)
                for k, v in parts.items():
                    rec[walk][k] += v[1:] if r == 0 else v  # the cold first mask is counted apart
            blocks += _blocks(g.fork(), doc_tokens, rows)
        _walk(compiler.compile(_rf(schema)), doc_tokens, rows, a.tokens)  # compiles it and walks a first copy
        t0 = time.perf_counter()
        cached = compiler.compile(_rf(schema))  # a schema seen before: a copy of the cached matcher
        rec["cached_compile_ms"] = (time.perf_counter() - t0) * 1e3
        _, parts = _walk(cached, doc_tokens, rows, a.tokens)
        warm = parts["mask"]
        rec["blocks_ms"] = [b * 1e3 for b in blocks]
        rec["warm_mask_us"] = [w * 1e6 for w in warm]
        rec["outlines"] = None if a.no_outlines else _outlines(compiler, schema, doc_tokens, rows, a.eos,
                                                                a.vocab_size)
        for walk in ("lowest", "doc"):
            rec[walk] = {k: [s * 1e6 for s in v] for k, v in rec[walk].items()}  # microseconds
        results.append(rec)

    head = (f"{'case':<24} {'walk':<6} {'tok':>4} {'compile ms':>10} {'1st mask':>8} {'mask us p50':>11} "
            f"{'p90':>6} {'max':>6} {'apply us':>8} {'consume':>7} {'forced':>6} {'8-block ms':>10} {'warm mask':>9}")
    print("\nllguidance (mask = allowed(): llguidance's bitmask + unpack; apply = mask_logits with the mask known; "
          "8-block = 8 x (mask, mask a row, consume) + rollback(8); compile = a new schema, first mask apart; "
          "warm = the doc walk of a cached schema)")
    print(head)
    print("-" * len(head))
    for rec in results:
        for walk in ("lowest", "doc"):
            p = rec[walk]
            blk = f"{_pct(rec['blocks_ms'], 50):>10.3f}" if walk == "doc" else f"{'':>10}"
            wm = f"{_pct(rec['warm_mask_us'], 50):>9.1f}" if walk == "doc" else f"{'':>9}"
            print(f"{rec['case'] if walk == 'lowest' else '':<24} {walk:<6} {rec[walk + '_tokens']:>4} "
                  f"{np.median(rec['compile_ms']):>10.2f} {np.median(rec['first_mask_ms']):>8.2f} "
                  f"{_pct(p['mask'], 50):>11.1f} {_pct(p['mask'], 90):>6.0f} {max(p['mask']):>6.0f} "
                  f"{_pct(p['apply'], 50):>8.1f} {_pct(p['consume'], 50):>7.1f} {_pct(p['forced'], 50):>6.1f} "
                  f"{blk} {wm}")
    oc_ver = getattr(_outlines, "version", None)
    if any(r["outlines"] for r in results):
        print(f"\noutlines-core {oc_ver} on the doc walk (Vocabulary built in {_outlines.vocab_s:.2f} s; compile = "
              "JSON schema -> regex -> token index, against llguidance's; mask = write_mask_into alone; 8-block as "
              "above, beside llguidance's)")
        head = (f"{'case':<24} {'compile s':>9} {'/ llguidance':>12} {'mask us p50':>11} {'p90':>6} "
                f"{'8-block ms':>10} {'llguidance':>10}")
        print(head)
        print("-" * len(head))
        for rec in results:
            o = rec["outlines"]
            if "mask_us_p50" not in o:
                print(f"{rec['case']:<24} {o.get('compile_s', float('nan')):>9.2f}  error: {o['error']}")
                continue
            ratio = o["compile_s"] * 1e3 / np.median(rec["compile_ms"])
            print(f"{rec['case']:<24} {o['compile_s']:>9.2f} {ratio:>11.0f}x {o['mask_us_p50']:>11.1f} "
                  f"{o['mask_us_p90']:>6.0f} {o['block_ms_p50']:>10.3f} {_pct(rec['blocks_ms'], 50):>10.3f}")
    elif not a.no_outlines:
        print("\noutlines-core not installed: no comparison (pip install outlines-core to add it)")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({
            "machine": machine_description(), "usable_cpus": usable_cpus(), "llguidance": compiler.version,
            "outlines_core": oc_ver, "tokenizer": str(a.tokenizer), "tokenizer_ids": compiler.tokenizer_size,
            "vocab_size": a.vocab_size, "tokenizer_build_s": build_s, "block": BLOCK, "repeat": a.repeat,
            "results": results}, indent=1))
        print(f"\nwrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
