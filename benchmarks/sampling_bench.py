"""Cost of turning logits into the sampling distribution (``dspark_runtime.decoding.sampling.process_logits``)
against the full-sort reference it replaced, side by side in one run.

The reference (a stable ``argsort`` of the whole vocabulary per row, float64, for top-k and again for top-p) lives
here only, as this benchmark's baseline and ``tests/runtime/decoding/test_sampling.py``'s reference. Each case checks both give the
same distribution, then times each (best of ``--repeat``, interleaved). Prints a table per case set:

* "random": ``--rows`` rows of N(0, ``--scale``^2) float32 logits at ``--temperature``;
* "verify block": one speculative verify block, 8 rows of logits spread like a real LM head's
  (:func:`lm_head_logits`) at temperature 1, each case also as a ratio to temperature-only; the
  distributions must be bit-identical; each implementation's cases are timed in rounds of their own.

    python -m benchmarks.sampling_bench                  # 8 rows x 151,936 tokens (Qwen2 vocabulary)
    python -m benchmarks.sampling_bench --rows 1 --repeat 20
    python -m benchmarks.sampling_bench --set "verify block" --repeat 20
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from dspark_runtime.decoding.sampling import SamplingParams, process_logits
from dspark_runtime.machine.sysinfo import machine_description, usable_cpus


def reference_process_logits(
    logits: np.ndarray,  # float [..., vocab]; -inf allowed
    params: SamplingParams,
) -> np.ndarray:  # float64 [..., vocab]; each row sums to 1
    """The full-sort reference: softmax(logits / T) in float64, top-k by a stable sort of the whole row
    (ties to the lowest id), then top-p by a stable sort of the probabilities (keep every rank whose preceding
    mass is < top_p), renormalising after each cut. Greedy (T == 0): one-hot argmax.

    Raises:
        InputError: from ``params.validate()``.
        ValueError: not a floating array with vocab >= 1, NaN or +inf, or a row entirely -inf.
    """
    params.validate()
    x = np.asarray(logits)
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"logits must have shape [..., vocab] with vocab >= 1, got {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"logits must be a floating array, got dtype {x.dtype}")
    if np.isnan(x).any() or np.isposinf(x).any():
        raise ValueError("logits contain NaN or +inf")
    if np.isneginf(x).all(axis=-1).any():
        raise ValueError("a logits row is entirely -inf: no token can be chosen")
    if params.greedy:
        probs = np.zeros(x.shape, dtype=np.float64)
        np.put_along_axis(probs, np.argmax(x, axis=-1)[..., None], 1.0, axis=-1)
        return probs
    z = x.astype(np.float64) / float(params.temperature)
    vocab = z.shape[-1]
    if 0 < params.top_k < vocab:
        order = np.argsort(-z, axis=-1, kind="stable")
        keep = np.zeros(z.shape, dtype=bool)
        np.put_along_axis(keep, order[..., : int(params.top_k)], True, axis=-1)
        z = np.where(keep, z, -np.inf)
    e = np.exp(z - np.max(z, axis=-1, keepdims=True))
    probs = e / np.sum(e, axis=-1, keepdims=True)
    if params.top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        before = np.cumsum(sorted_probs, axis=-1)
        before = np.concatenate([np.zeros_like(before[..., :1]), before[..., :-1]], axis=-1)
        keep = np.zeros(probs.shape, dtype=bool)
        np.put_along_axis(keep, order, before < float(params.top_p), axis=-1)
        kept = np.where(keep, probs, 0.0)
        probs = kept / np.sum(kept, axis=-1, keepdims=True)
    return probs


def lm_head_logits(
    rows: int,
    vocab: int,
    seed: int = 0,
) -> np.ndarray:  # float32 [rows, vocab]
    """Logits spread like a real LM head's (shape read off Qwen2.5-Coder-1.5B rows at temperature 1):
    a N(-4, 2.7^2) bulk and a head of min(4096, vocab // 4) tokens at random ids whose sorted logits
    fall about 1-1.8 per doubling of the rank from a top 20-30 above the bulk mean, the top token
    ahead by an extra Exp(3) gap. At top-p 0.9 the nucleus holds 1 to a few tens of tokens."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, vocab)) * 2.7 - 4.0  # [rows, vocab]
    n_head = max(1, min(4096, vocab // 4))
    rank = np.arange(1, n_head + 1)  # [n_head]
    for r in range(rows):
        ids = rng.choice(vocab, n_head, replace=False)
        head = (rng.uniform(20.0, 30.0) - 4.0 - rng.uniform(1.0, 1.8) * np.log2(rank)
                - rng.exponential(3.0) * (rank > 1) + rng.normal(0.0, 0.3, n_head))
        x[r, ids] = np.maximum(x[r, ids], head)
    return x.astype(np.float32)


CASES = [
    ("top-k 50", dict(top_k=50)),
    ("top-p 0.9", dict(top_p=0.9)),
    ("top-k 50 + top-p 0.9", dict(top_k=50, top_p=0.9)),
    ("temperature only", dict()),
]

#: the "verify block" case set: temperature-only first (the ratios' denominator)
VERIFY_CASES = [
    ("temperature only", dict()),
    ("top-p 0.9", dict(top_p=0.9)),
    ("top-k 50 + top-p 0.9", dict(top_k=50, top_p=0.9)),
]
VERIFY_ROWS = 8


def _best_ms(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _time_pair(logits: np.ndarray, params: SamplingParams, repeat: int) -> tuple[float, float]:
    """(full-sort ms, partial ms) per call, best of ``repeat``, interleaved so that a busy machine slows both alike."""
    old_ms = new_ms = float("inf")
    for _ in range(repeat):
        old_ms = min(old_ms, _best_ms(lambda: reference_process_logits(logits, params), 1))
        new_ms = min(new_ms, _best_ms(lambda: process_logits(logits, params), 1))
    return old_ms, new_ms


def _random_set(a) -> int:
    rng = np.random.default_rng(a.seed)
    logits = (rng.standard_normal((a.rows, a.vocab)) * a.scale).astype(np.float32)  # [rows, vocab]
    print(f"random: logits float32 [{a.rows}, {a.vocab}] ~ N(0, {a.scale}^2); temperature {a.temperature}; "
          f"best of {a.repeat}")
    head = (f"{'case':<22} {'full sort ms/call':>17} {'ms/row':>8} {'partial ms/call':>15} {'ms/row':>8} "
            f"{'speed-up':>8} {'max |diff|':>10}")
    print(head)
    print("-" * len(head))
    for name, kw in CASES:
        params = SamplingParams(temperature=a.temperature, **kw)
        ref, new = reference_process_logits(logits, params), process_logits(logits, params)  # warm-up + check
        diff = float(np.max(np.abs(ref - new)))
        if not np.array_equal(ref > 0, new > 0):
            print(f"{name}: the kept token sets differ", file=sys.stderr)
            return 1
        old_ms, new_ms = _time_pair(logits, params, a.repeat)
        print(f"{name:<22} {old_ms:>17.2f} {old_ms / a.rows:>8.3f} {new_ms:>15.2f} {new_ms / a.rows:>8.3f} "
              f"{old_ms / new_ms:>7.1f}x {diff:>10.1e}")
    return 0


def _round_robin_ms(fn, logits: np.ndarray, params: list, repeat: int) -> list:
    """ms per call of ``fn(logits, p)`` for each of ``params``, best of ``repeat`` rounds over all of them (one
    implementation at a time, so that the other's allocations do not change its page faults)."""
    best = [float("inf")] * len(params)
    for _ in range(repeat):
        for i, p in enumerate(params):
            best[i] = min(best[i], _best_ms(lambda: fn(logits, p), 1))
    return best


def _verify_block_set(a) -> int:
    logits = lm_head_logits(VERIFY_ROWS, a.vocab, a.seed)  # [8, vocab]
    print(f"verify block: logits float32 [{VERIFY_ROWS}, {a.vocab}] spread like an LM head's (lm_head_logits); "
          f"temperature 1.0; best of {a.repeat} rounds over the cases, per implementation; "
          f"ratio = ms / temperature-only ms of the same implementation")
    params = [SamplingParams(temperature=1.0, **kw) for _, kw in VERIFY_CASES]
    kept = []
    for (name, _), p in zip(VERIFY_CASES, params):
        new = process_logits(logits, p)
        if not np.array_equal(reference_process_logits(logits, p), new):
            print(f"verify block, {name}: not bit-identical to the full-sort reference", file=sys.stderr)
            return 1
        kept.append(np.count_nonzero(new, axis=-1))
    old_ms = _round_robin_ms(reference_process_logits, logits, params, a.repeat)
    new_ms = _round_robin_ms(process_logits, logits, params, a.repeat)
    head = (f"{'case':<22} {'full sort ms/block':>18} {'ratio':>6} {'partial ms/block':>16} {'ratio':>6} "
            f"{'kept/row':>13} {'bit-exact':>9}")
    print(head)
    print("-" * len(head))
    for (name, _), o, n, k in zip(VERIFY_CASES, old_ms, new_ms, kept):
        print(f"{name:<22} {o:>18.2f} {o / old_ms[0]:>6.2f} {n:>16.2f} {n / new_ms[0]:>6.2f} "
              f"{f'{k.min()}-{k.max()}':>13} {'yes':>9}")
    return _verify_block_loop_case(a, logits, new_ms[0])


def _verify_block_loop_case(a, logits: np.ndarray, temperature_only_ms: float) -> int:
    """The loop's whole processing of a sampled verify block with penalties and a grammar mask
    (``DecodingLoop._processed``: :func:`~dspark_runtime.decoding.penalties.penalize_rows` over a 256-token history,
    each row's allowed-token mask applied, then top-p 0.9), against temperature-only; bit-exact against the full-sort
    reference on the same processed logits. The grammar's own mask computation is ``benchmarks.grammar_mask_cost``."""
    rng = np.random.default_rng(a.seed + 1)
    prompt = np.unique(rng.integers(0, a.vocab, 300))
    history = rng.integers(0, a.vocab, 256).tolist()
    block = rng.integers(0, a.vocab, VERIFY_ROWS).tolist()
    # the worst case for a mask: half the vocabulary allowed per row, at random; JSON-like: rows inside a string
    # (all but 1% allowed) alternating with structural rows (20 tokens allowed)
    half = [rng.random(a.vocab) < 0.5 for _ in range(VERIFY_ROWS)]
    json_like = [rng.random(a.vocab) < 0.99 if k % 2 else np.isin(np.arange(a.vocab), rng.integers(0, a.vocab, 20))
                 for k in range(VERIFY_ROWS)]
    for masks in (half, json_like):
        for k, m in enumerate(masks):
            m[int(np.argmax(logits[k]))] = True
    p = SamplingParams(temperature=1.0, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
    for label, masks in (("random half masked", half), ("JSON-like masks", json_like)):
        if _loop_case(a, logits, temperature_only_ms, p, prompt, history, block, masks, label):
            return 1
    return 0


def _loop_case(a, logits, temperature_only_ms, p, prompt, history, block, masks, label) -> int:
    """One :func:`_verify_block_loop_case` line for ``masks``; 1 when not bit-exact."""
    from dspark_runtime.decoding.grammar import masked_rows
    from dspark_runtime.decoding.penalties import penalize_rows

    def processed(x):
        y = penalize_rows(x, p, prompt, history, block)
        return masked_rows(y, masks, inplace=True)  # as DecodingLoop._processed

    if not np.array_equal(process_logits(processed(logits), p), reference_process_logits(processed(logits), p)):
        print("verify block, penalties + mask + top-p: not bit-identical to the full-sort reference", file=sys.stderr)
        return 1
    ms = _round_robin_ms(lambda x, q: process_logits(processed(x), q), logits, [p], a.repeat)[0]
    print(f"{'penalties+mask+top-p':<22} {'':>18} {'':>6} {ms:>16.2f} {ms / temperature_only_ms:>6.2f} "
          f"{'':>13} {'yes':>9}   (presence/frequency 0.5, repetition 1.1, 256-token history; {label})")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=151936, help="tokens per row (default: Qwen2's 151,936)")
    ap.add_argument("--rows", type=int, default=8, help="rows per call of the random set (default 8: one verify block)")
    ap.add_argument("--temperature", type=float, default=0.7, help="temperature of the random set (default 0.7)")
    ap.add_argument("--scale", type=float, default=3.0,
                    help="standard deviation of the random set's float32 logits (default 3.0)")
    ap.add_argument("--repeat", type=int, default=5, help="timed calls per case and implementation; best kept")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", choices=["all", "random", "verify block"], default="all", help="case sets to run")
    a = ap.parse_args(argv)
    if a.vocab < 2 or a.rows < 1 or a.repeat < 1:
        ap.error("--vocab must be >= 2, --rows and --repeat >= 1")

    print(f"machine: {machine_description()}; usable CPUs {usable_cpus()}; numpy {np.__version__}")
    rc = 0
    if a.set in ("all", "random"):
        rc = rc or _random_set(a)
    if a.set in ("all", "verify block"):
        if a.set == "all":
            print()
        rc = rc or _verify_block_set(a)
    return rc


if __name__ == "__main__":
    sys.exit(main())
