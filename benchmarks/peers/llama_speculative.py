"""llama.cpp's ``llama-speculative`` example binary: its command line and the parsing of its output.

Standard library only: imported by the peer worker (under the llama-cpp peer venv) and by the tests (under the
project venv). What the binary prints and how it is read: :func:`parse_output`.
"""
from __future__ import annotations

import re

# one committed token per match, in commit order
_COMMIT = re.compile(
    r"the sampled target token matches the \d+th drafted token of sequence \d+ \((-?\d+), '"
    r"|the sampled target token \((-?\d+), '.*?'\) did not match", re.S)
_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
# summary lines, maybe behind a log prefix ("0.36.735.570 I n_draft   = 3")
_STAT = re.compile(r"^(?:[\d.]+ )?(?:[IWED] )?(n_draft|n_predict|n_drafted|n_accept)\s*=\s*(\d+)\s*$", re.M)
_ACCEPT = re.compile(r"accept\s*=\s*([\d.]+)%")
_LOAD = re.compile(r"load time =\s*([\d.]+) ms")
_ROUND_START = "the sampled target token (", "the sampled target token matches"


def command(binary: str, target_gguf: str, draft_gguf: str, prompt_text: str, *, max_new_tokens: int,
            threads: int, n_ctx: int, seed: int = 0, draft_max: int | None = None) -> list:
    """The argv of one greedy llama-speculative run (the same threads for target and draft, prompt and
    batch)."""
    t = str(threads)
    argv = [binary, "-m", target_gguf, "-md", draft_gguf, "-p", prompt_text, "-n", str(max_new_tokens),
            "--temp", "0", "--seed", str(seed), "-c", str(n_ctx), "-t", t, "-tb", t, "-td", t, "-tbd", t,
            "-lv", "5", "--log-colors", "off"]
    if draft_max is not None:
        argv += ["--spec-draft-n-max", str(draft_max)]
    return argv


def committed_ids(stderr: str) -> list:
    """The committed token ids, in order, from the binary's debug log."""
    return [int(m.group(1) if m.group(1) is not None else m.group(2)) for m in _COMMIT.finditer(stderr)]


def round_pairs(stderr: str, n_draft: int) -> list:
    """(proposed, accepted) per verify round from the debug log: a round ends with the target's own
    token ("did not match"); the prefill round (the first token, sampled from the prompt's logits with
    nothing drafted) is not a round, as for the other systems. ``proposed`` is the round's draft
    length: the binary drafts n_draft tokens every round with one draft sequence (the default)."""
    pairs, accepted = [], 0
    for m in _COMMIT.finditer(stderr):
        if m.group(1) is not None:
            accepted += 1
        else:
            pairs.append(accepted)
            accepted = 0
    return [(n_draft, a) for a in pairs[1:]]


def parse_output(stdout: str, stderr: str) -> dict:
    """Timings and counters of one run. Keys: prompt_tokens, encode_s, decode_tokens (n_predict),
    decode_s, n_draft, n_predict, n_drafted, n_accept, accept_pct, token_ids, rounds ((proposed,
    accepted) pairs), load_ms (target, draft as printed by the perf summaries). Missing figures are
    absent; ``ok`` says whether the timing lines were found.

    What the binary does (examples/speculative/speculative.cpp of the vendored llama.cpp): it tokenizes
    ``-p`` with ``common_tokenize(ctx, prompt, add_special=true, parse_special=true)`` (chat-template
    special tokens such as ``<|im_start|>`` become their ids; Qwen2 adds no BOS), evaluates the prompt
    with both models (timed as "encoded"), samples the first token from the prompt's logits, then loops
    draft ``--spec-draft-n-max`` tokens (default 3) with the draft model / verify them in one target
    batch (timed as "decoded", the first token included). It stops after the round in which
    ``n_predict`` passed ``-n`` or an end-of-generation token came, so it may return a few tokens more
    than ``-n``. It prints the prompt's and then each committed token's text on stdout, and, at
    verbosity 5 (``-lv 5``), one debug line per committed token on stderr with its id:

        the sampled target token matches the 0th drafted token of sequence 0 (4710, ' def') - accepted
        the sampled target token (13, '.') did not match, or we ran out of drafted tokens

    (each verify round: its accepted draft tokens, then the target's own token that ended the round).
    ``-f FILE`` strips one trailing newline from the prompt (common/arg.cpp), which would drop the
    ``\\n`` after ``<|im_start|>assistant``: the prompt is passed with ``-p``.
    """
    text = stdout + "\n" + stderr
    out: dict = {}
    m = _ENCODED.search(text)
    if m:
        out["prompt_tokens"], out["encode_s"] = int(m.group(1)), float(m.group(2))
    m = _DECODED.search(text)
    if m:
        out["decoded_tokens"], out["decode_s"] = int(m.group(1)), float(m.group(2))
    for k, v in _STAT.findall(text):
        out[k] = int(v)
    m = _ACCEPT.search(text)
    if m:
        out["accept_pct"] = float(m.group(1))
    out["load_ms"] = [float(x) for x in _LOAD.findall(text)]
    out["token_ids"] = committed_ids(stderr)
    out["rounds"] = round_pairs(stderr, out.get("n_draft", 0))
    out["ok"] = "encode_s" in out and "decode_s" in out
    return out


def generated_text(stdout: str, prompt_text: str) -> str:
    """The generated text on stdout: after the echoed prompt, before the closing blank lines."""
    i = stdout.find(prompt_text)
    body = stdout[i + len(prompt_text):] if i >= 0 else stdout
    return body.rstrip("\n")
