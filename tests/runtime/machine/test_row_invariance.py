"""Row padding for row-count invariance (dspark_runtime/machine/row_invariance.py, DecoderRunner.row_multiple)."""
import json

import numpy as np
import pytest

from dspark_runtime.backends.ort import StepOutput
from dspark_runtime.errors import InputError
from dspark_runtime.runners.sequence import DecoderRunner
from dspark_runtime.machine.row_invariance import max_difference, padded_rows, probe_row_multiple, teacher_force

VOCAB, LAYERS, KVH, HD = 11, 2, 1, 4


class ParityBackend:
    """A fake decoder whose float results depend on the call's row count like a kernel with a separate
    path for odd row counts: logits/keys of a position are a function of its token and position, plus
    ``eps`` when the call has an odd number of rows. Records every call's shapes."""

    def __init__(self, eps: float = 1e-6, odd_only_when_single: bool = False):
        self.eps, self.single_only, self.calls = eps, odd_only_when_single, []

    def empty_kv(self, batch):
        z = np.zeros((batch, KVH, 0, HD), np.float32)
        return [(z, z) for _ in range(LAYERS)]

    def step(self, ids, pos, mask, kv):
        n = ids.shape[1]
        self.calls.append({"rows": n, "positions": pos[0].tolist(), "mask": mask.shape, "past": kv[0][0].shape[2]})
        assert mask.shape == (1, 1, n, kv[0][0].shape[2] + n)
        noise = self.eps if (n == 1 if self.single_only else n % 2) else 0.0
        base = (ids[0, :, None] * 0.37 + pos[0, :, None] * 0.011 + np.arange(VOCAB) * 0.1).astype(np.float32)
        logits = (np.sin(base) + noise).astype(np.float32)[None]
        new = np.broadcast_to(logits[:, None, :, :HD], (1, KVH, n, HD)).astype(np.float32)
        kv = [(np.concatenate([np.asarray(k), new], axis=2), np.concatenate([np.asarray(v), -new], axis=2))
              for k, v in kv]
        return StepOutput(logits, logits[..., :3].copy(), kv)


def test_padded_rows():
    assert [padded_rows(q, 2) for q in (1, 2, 3, 4, 5)] == [2, 2, 4, 4, 6]
    assert [padded_rows(q, 1) for q in (1, 3)] == [1, 3]
    assert padded_rows(5, 4) == 8
    with pytest.raises(ValueError):
        padded_rows(0, 2)


def test_runner_pads_calls_and_hides_the_padding():
    be = ParityBackend()
    r = DecoderRunner(be, row_multiple=2)
    r.prefill([5, 6, 7])                       # 3 rows -> one call of 4
    out = r.step([8])                          # 1 row -> 2
    assert [c["rows"] for c in be.calls] == [4, 2]
    assert be.calls[0]["positions"] == [0, 1, 2, 3] and be.calls[1]["positions"] == [3, 4]
    assert be.calls[1]["past"] == 3            # the padded position 3 of the first call was never kept
    assert out.shape == (1, VOCAB) and r.length == 4 and r.features.shape == (4, 3)
    assert [k.shape[2] for k, _ in r.cache.view()] == [4, 4]
    # the real rows' values are those the unpadded runner gets (the fake adds eps only to odd calls)
    ref = DecoderRunner(ParityBackend(eps=0.0))
    ref.prefill([5, 6, 7])
    np.testing.assert_array_equal(out, ref.step([8]))


def test_prefill_chunk_leaves_room_for_padding():
    be = ParityBackend()
    be.max_q = 5                                # a TensorRT-style prefill limit
    r = DecoderRunner(be, row_multiple=2)
    r.prefill(list(range(9)))
    assert max(c["rows"] for c in be.calls) <= 5 and r.length == 9
    assert all(c["rows"] % 2 == 0 for c in be.calls)


def test_unpadded_runner_sees_the_row_count_dependence_and_padding_removes_it():
    prompt, cont = [1, 2, 3, 4], list(range(3, 11))
    r = DecoderRunner(ParityBackend(eps=1e-6))
    assert max_difference(teacher_force(r, prompt, cont, 1), teacher_force(r, prompt, cont, 2)) > 0
    r.row_multiple = 2
    ref = teacher_force(r, prompt, cont, 1)
    for block in (2, 3, 4, 5):
        assert max_difference(ref, teacher_force(r, prompt, cont, block)) == 0.0


@pytest.mark.parametrize("kind, expected", [("odd", 2), ("single", 2), ("none", 1)])
def test_probe_finds_the_smallest_invariant_multiple(kind, expected):
    be = ParityBackend(eps=0.0 if kind == "none" else 1e-5, odd_only_when_single=kind == "single")
    r = DecoderRunner(be, row_multiple=3)
    res = probe_row_multiple(r, [1, 2, 3], list(range(4, 24)))
    assert res["row_multiple"] == expected
    assert res["max_abs_difference"][str(expected)] == 0.0
    if expected > 1:
        assert res["max_abs_difference"]["1"] == pytest.approx(1e-5, rel=1e-2)
    assert r.row_multiple == 3 and r.length == 0  # restored


class HeadRowsRunner(DecoderRunner):
    """A DecoderRunner over :class:`ParityBackend` (odd calls off by 1e-5, so padding to 2 is needed) that can run
    its LM head on a padded call's real rows only: the logits then get ``head_eps`` when the real rows are odd, as
    an LM head kernel with a separate odd-row path would."""

    can_skip_padding_head = True

    def __init__(self, head_eps: float):
        super().__init__(ParityBackend(eps=1e-5))
        self.head_eps = head_eps

    def step(self, tokens):
        out = super().step(tokens)
        return out + np.float32(self.head_eps) if self.head_skips_padding and len(tokens) % 2 else out


@pytest.mark.parametrize("head_eps, skip", [(0.0, True), (1e-6, False)])
def test_probe_keeps_the_lm_head_on_real_rows_only_where_it_is_invariant(head_eps, skip):
    r = HeadRowsRunner(head_eps)
    res = probe_row_multiple(r, [1, 2, 3], list(range(4, 24)))
    assert res["row_multiple"] == 2 and res["head_skips_padding"] is skip
    d = res["max_abs_difference"]
    assert d["1"] > 0 and d["2:real-rows-head"] == pytest.approx(head_eps, abs=1e-7)
    assert ("2" not in d) if skip else d["2"] == 0.0  # the head on every row is tried only when needed
    assert r.row_multiple == 1 and r.head_skips_padding is False  # restored
    plain = probe_row_multiple(DecoderRunner(ParityBackend(eps=1e-5)), [1, 2, 3], list(range(4, 24)))
    assert plain["head_skips_padding"] is False and "2:real-rows-head" not in plain["max_abs_difference"]


def test_probe_reports_none_when_padding_cannot_help():
    class Noisy(ParityBackend):
        def step(self, ids, pos, mask, kv):
            out = super().step(ids, pos, mask, kv)
            out.logits += np.float32(1e-4 * len(self.calls))  # differs from call to call
            return out

    res = probe_row_multiple(DecoderRunner(Noisy(eps=0.0)), [1, 2], list(range(3, 23)), candidates=(1, 2))
    assert res["row_multiple"] is None and all(v > 0 for v in res["max_abs_difference"].values())
    with pytest.raises(ValueError, match="continuation tokens"):
        probe_row_multiple(DecoderRunner(ParityBackend()), [1], [2, 3])


# --- on the tiny real engine (ONNX Runtime) ---------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tiny_engine_dir):
    from dspark_runtime import Engine

    return Engine.load(tiny_engine_dir, row_multiple=2)


@pytest.mark.parametrize("draft, gamma", [("lm", 3), ("lm", 4), ("ngram", 3)])
def test_padded_speculative_equals_padded_target_only(engine, draft, gamma):
    prompt = "Write a function that sorts a list of numbers. " * 3
    ref = engine.generate(prompt, max_new_tokens=40, draft=None)
    spec = engine.generate(prompt, max_new_tokens=40, draft=draft, draft_length=gamma)
    assert spec.token_ids == ref.token_ids and len(ref.token_ids) == 40
    assert spec.stats.num_rounds < len(ref.token_ids) or draft == "ngram"


def test_padded_runs_are_bitwise_invariant_on_the_real_graph(engine):
    r = engine.runner("target")
    assert r.row_multiple == 2
    ids = list(range(40, 80))
    ref = teacher_force(r, ids[:16], ids[16:], 1)
    for block in (2, 3, 5):
        assert max_difference(ref, teacher_force(r, ids[:16], ids[16:], block)) == 0.0
    # and the padded logits are the unpadded graph's up to float rounding
    r.row_multiple = 1
    try:
        unpadded = teacher_force(r, ids[:16], ids[16:], 1)
    finally:
        r.row_multiple = 2
    np.testing.assert_allclose(ref[0], unpadded[0], atol=1e-4)


def test_row_multiple_from_the_manifest_and_bad_values(tiny_engine_dir, tmp_path):
    import shutil

    from dspark_runtime import Engine

    d = tmp_path / "e"
    shutil.copytree(tiny_engine_dir, d)
    m = json.loads((d / "manifest.json").read_text())
    assert Engine.load(d).row_multiple == 1  # nothing probed: no padding
    m["speculation"]["row_invariance"] = {"row_multiple": 4, "backend": "ort"}
    (d / "manifest.json").write_text(json.dumps(m))
    eng = Engine.load(d)
    assert eng.row_multiple == 4 and eng.runner("target").row_multiple == 4 and eng.runner("draft").row_multiple == 1
    assert Engine.load(d, row_multiple=1).row_multiple == 1  # the caller wins
    for bad in (0, -2, 1.5, "2", True):
        with pytest.raises(InputError, match="row_multiple must be a positive integer"):
            Engine.load(d, row_multiple=bad)


def test_the_lm_head_on_real_rows_from_the_manifest(tiny_scatter_engine_dir, tmp_path):
    """A stored probe with ``head_skips_padding`` sets it on the target's runners (one request and a batch; not the
    draft LM's), only while the probe's own padding is used (not a caller's row_multiple, not another target graph's
    probe); the padded speculative output still equals padded target-only."""
    import shutil
    import warnings

    from dspark_runtime import Engine

    d = tmp_path / "e"
    shutil.copytree(tiny_scatter_engine_dir, d)
    m = json.loads((d / "manifest.json").read_text())
    sha = m["graphs"]["target"]["files"][0]["sha256"]
    m["speculation"]["row_invariance"] = {"row_multiple": 2, "head_skips_padding": True, "backend": "ort",
                                          "target_sha256": sha}
    (d / "manifest.json").write_text(json.dumps(m))
    eng = Engine.load(d)
    assert eng.head_skips_padding and eng.runner("target").head_skips_padding
    assert eng.loop_runner("target", max_requests=2).head_skips_padding
    assert not eng.runner("draft").head_skips_padding
    prompt = "Write a function that sorts a list of numbers. " * 3
    ref = eng.generate(prompt, max_new_tokens=24, draft=None)
    spec = eng.generate(prompt, max_new_tokens=24, draft="lm", draft_length=2)
    assert len(ref.token_ids) == 24 and eng.runner("target").head_skips_padding
    ids = list(range(40, 80))
    if probe_row_multiple(eng.runner("target"), ids[:16], ids[16:], candidates=(2,))["head_skips_padding"]:
        assert spec.token_ids == ref.token_ids  # where this CPU's fp32 head is row-count invariant (the probe says)
    assert not Engine.load(d, row_multiple=2).head_skips_padding
    m["speculation"]["row_invariance"]["target_sha256"] = "0" * 64
    (d / "manifest.json").write_text(json.dumps(m))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert not Engine.load(d).head_skips_padding


def test_profile_probes_and_stores_the_row_multiple(tiny_engine_dir, tmp_path):
    import shutil

    from dspark_export.fit.cost_profile import profile_engine
    from dspark_runtime import Engine

    d = tmp_path / "e"
    shutil.copytree(tiny_engine_dir, d)
    t = profile_engine(d, max_tokens=4, repeats=1, context=16)
    probe = json.loads((d / "manifest.json").read_text())["speculation"]["row_invariance"]
    assert probe == t["row_invariance"]
    m = probe["row_multiple"]
    assert m in (1, 2, 4, 8) and probe["max_abs_difference"][str(m)] == 0.0 and probe["backend"] == "ort"
    assert probe["head_skips_padding"] is False  # a growing-layout graph: its head runs on every row
    assert probe["threads"] >= 1 and probe["onnxruntime"] and probe["machine"]
    assert Engine.load(d).row_multiple == m


def test_probe_without_onnx_falls_back_to_the_graph_probe(tiny_engine_dir, monkeypatch):
    import sys

    from dspark_runtime import Engine

    monkeypatch.setitem(sys.modules, "onnx", None)  # a runtime-only install: `import onnx` raises ImportError
    eng = Engine.load(tiny_engine_dir, row_multiple=1)
    res = eng.probe_row_invariance(tokens=18)
    assert "kernel_max_abs_difference" not in res and "onnx package is not installed" in res["note"]
    assert res["row_multiple"] in (1, 2, 4, 8) and eng.row_multiple == res["row_multiple"]


def test_a_stored_probe_of_another_graph_or_thread_count_is_flagged(tiny_engine_dir, tmp_path):
    import shutil
    import warnings

    from dspark_runtime import Engine

    d = tmp_path / "e"
    shutil.copytree(tiny_engine_dir, d)
    m = json.loads((d / "manifest.json").read_text())
    sha = m["graphs"]["target"]["files"][0]["sha256"]
    for probe, threads, expect_m, expect_warning in [
            ({"row_multiple": 2, "target_sha256": sha, "threads": 1}, 1, 2, None),
            ({"row_multiple": 2, "target_sha256": "0" * 64, "threads": 1}, 1, 1, "probed on another target graph"),
            ({"row_multiple": 2, "target_sha256": sha, "threads": 2}, 1, 2, "probed with 2 threads")]:
        m["speculation"]["row_invariance"] = probe
        (d / "manifest.json").write_text(json.dumps(m))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            eng = Engine.load(d, threads=threads)
        assert eng.row_multiple == expect_m
        msgs = [str(w.message) for w in caught]
        assert (any(expect_warning in x for x in msgs) if expect_warning else not msgs), msgs


def test_quantize_drops_the_source_engines_probe_and_cost_table(tiny_engine_dir, tmp_path):
    import shutil

    from dspark_export.precision.quantize import quantize_engine

    d = tmp_path / "e"
    shutil.copytree(tiny_engine_dir, d)
    m = json.loads((d / "manifest.json").read_text())
    m["speculation"]["row_invariance"] = {"row_multiple": 2}
    m["speculation"]["cost_table"] = {"tokens": [1], "seconds": [0.1]}
    (d / "manifest.json").write_text(json.dumps(m))
    logs = []
    quantize_engine(d, tmp_path / "q", "draft=int8", calibration_prompts=1, log=logs.append)
    spec = json.loads((tmp_path / "q" / "manifest.json").read_text())["speculation"]
    assert "row_invariance" not in spec and "cost_table" not in spec
    assert any("dropped speculation.row_invariance" in x for x in logs)


def test_the_kernel_probe_multiplies_the_graphs_attention_rows():
    """The grouped export stacks a KV head's query heads as rows, so a call of n positions runs attention MatMuls of
    g * n rows (Qwen2.5-1.5B: 6 at one position): the kernel probe feeds its attention the same rows, and compares
    each position's rows across call sizes."""
    import dspark_runtime.machine.row_invariance as ri
    from dspark_runtime.engine_dir.graphspec import attention_rows_per_query

    assert attention_rows_per_query({"model_type": "qwen2", "num_attention_heads": 12, "num_key_value_heads": 2}) == 6
    assert attention_rows_per_query({"model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 32}) == 1
    assert attention_rows_per_query({"model_type": "gpt2", "num_attention_heads": 12}) == 1  # its own attention
    real = ri.kernel_probe_session(1)
    seen = []

    class Recording:
        def get_inputs(self):
            return real.get_inputs()

        def run(self, names, feeds):
            seen.append((feeds["x"].shape[1], feeds["q"].shape[2]))
            return real.run(names, feeds)

    orig = ri.kernel_probe_session
    ri.kernel_probe_session = lambda threads: Recording()
    try:
        diff = ri.kernel_row_difference(2, 1, rows=6, blocks=(1, 3), attention_rows=3)
    finally:
        ri.kernel_probe_session = orig
    assert seen == [(2, 6)] * 6 + [(4, 12)] * 2  # 1 position padded to 2 -> 6 attention rows; 3 padded to 4 -> 12
    assert diff >= 0.0
