"""Where prompt chunks run (dspark_runtime/backends/prompt_place.py, Engine.load(prompts=...)): the choice and its
refusals, the runner's one-request calls with a minimum row count for kernels whose results depend on the call's rows
(ScatterRunner with a prompt_calls_alone backend), the chunking check (row_invariance.check_prompt_chunks_invariant),
and on Intel CPUs with the OpenVINO plugin installed, speculative output equal to target-only output with prompt
chunks on OpenVINO."""
import numpy as np
import pytest

from dspark_runtime.errors import DSparkError, InputError


def _openvino_or_skip():
    from dspark_runtime.backends.ort_openvino import openvino_cpu_devices

    try:
        openvino_cpu_devices()
    except DSparkError as e:
        pytest.skip(f"no OpenVINO device here: {e}")


def test_the_prompt_place_and_its_refusals(int4_engine, tiny_scatter_engine_dir):
    from dspark_runtime import Engine
    from dspark_runtime.backends.prompt_place import resolve_prompt_place
    from dspark_runtime.engine_dir.manifest import load_manifest

    m = load_manifest(int4_engine, verify=False)
    cpu = {k: "cpu" for k in m.graphs}
    assert resolve_prompt_place("auto", m, cpu) == "prompt-graph"  # the engine has one
    assert resolve_prompt_place("target", m, cpu) == "target"
    assert resolve_prompt_place("openvino", m, cpu) == "openvino"  # checked on first use, not here
    with pytest.raises(InputError, match="unknown prompt place 'gpu'"):
        resolve_prompt_place("gpu", m, cpu)
    with pytest.raises(InputError, match="on the CPU with the scatter KV layout"):
        resolve_prompt_place("openvino", m, {**cpu, "target": "cuda"})
    plain = load_manifest(tiny_scatter_engine_dir, verify=False)
    assert resolve_prompt_place("auto", plain, {k: "cpu" for k in plain.graphs}) == "target"
    with pytest.raises(InputError, match="add-prompt-graph"):
        Engine.load(tiny_scatter_engine_dir, prompts="prompt-graph")


def test_an_8bit_prompt_graph_is_not_run_where_the_u8s8_kernel_saturates(int4_engine, monkeypatch):
    """A prompt graph built with 8-bit weights (on a VNNI/AMX CPU) computes wrong results where the u8·s8 kernel
    saturates (AVX2 without VNNI): "auto" takes the target there and says why, "prompt-graph" is refused with the
    rebuild named; a 7-bit one runs everywhere."""
    import dataclasses
    import warnings

    from dspark_runtime.backends import prompt_place
    from dspark_runtime.engine_dir.manifest import PROMPT_GRAPH, load_manifest
    from dspark_runtime.machine import kernel_probe
    from dspark_runtime.machine.sysinfo import OtherCpuWarning

    m = load_manifest(int4_engine, verify=False)
    cpu = {k: "cpu" for k in m.graphs}

    def with_bits(bits):
        g = m.graphs[PROMPT_GRAPH]
        q = {**g.quantization, "weight_bits": bits}
        graphs = {**m.graphs, PROMPT_GRAPH: dataclasses.replace(g, quantization=q)}
        return dataclasses.replace(m, graphs=graphs)

    monkeypatch.setattr(kernel_probe, "u8s8_saturates", lambda: True)
    with pytest.warns(OtherCpuWarning, match="weight-bits 7"):
        assert prompt_place.resolve_prompt_place("auto", with_bits(8), cpu) == "target"
    with pytest.raises(InputError, match=r"wrong results here.*--weight-bits 7.*--prompts target"):
        prompt_place.resolve_prompt_place("prompt-graph", with_bits(8), cpu)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert prompt_place.resolve_prompt_place("auto", with_bits(7), cpu) == "prompt-graph"
        assert prompt_place.resolve_prompt_place("prompt-graph", with_bits(7), cpu) == "prompt-graph"
        monkeypatch.setattr(kernel_probe, "u8s8_saturates", lambda: False)
        assert prompt_place.resolve_prompt_place("auto", with_bits(8), cpu) == "prompt-graph"


def test_a_missing_plugin_names_the_install(monkeypatch):
    import builtins

    from dspark_runtime.backends.ort_openvino import openvino_cpu_devices

    real = builtins.__import__

    def no_plugin(name, *a, **k):
        if name == "onnxruntime_ep_openvino":
            raise ImportError("No module named 'onnxruntime_ep_openvino'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_plugin)
    with pytest.raises(DSparkError, match=r"dspark\[openvino\]"):
        openvino_cpu_devices()


class _RowDependent:
    """A prompt backend over the CPU target graph whose calls are recorded and whose keys and logits move by 1e-3
    in calls of fewer than 8 query positions (what OpenVINO's kernels do, in kind)."""

    def __init__(self, real, alone: bool, min_rows: int):
        self.real, self.calls = real, []
        self.prompt_calls_alone, self.min_query_rows = alone, min_rows
        self.spec, self.path, self.providers = real.spec, real.path, ["FakeProvider"]
        self.takes_logits_from, self.takes_logits_to = real.takes_logits_from, real.takes_logits_to
        self.writes_kv_in_place = False

    def step(self, ids, pos, mask, kv, logits_from=0, logits_to=None):
        self.calls.append((ids.shape, logits_from, logits_to))
        out = self.real.step(ids, pos, mask, [(np.array(k), np.array(v)) for k, v in kv], logits_from, logits_to)
        if ids.shape[1] < 8:
            out.logits = out.logits + 1e-3
            out.kv = [(k + 1e-3, v) for k, v in out.kv]
        out.kv_written = False
        return out


def test_a_row_dependent_prompt_backend_gets_one_request_per_call_and_a_padded_minimum(int4_engine):
    """Prompt chunks of two requests go in one call each, of at least min_query_rows positions, with the LM head on
    the request's last position only; the results then do not depend on the chunking, and the check passes."""
    from dspark_runtime import Engine
    from dspark_runtime.machine.row_invariance import check_prompt_chunks_invariant
    from dspark_runtime.runners.scatter import ScatterRunner

    eng = Engine.load(int4_engine, row_multiple=2, prompts="target")
    target = eng.graph_backend("target")
    be = _RowDependent(target, alone=True, min_rows=8)
    r = ScatterRunner(target, row_multiple=2)
    r.prompt_backend = be
    r.add("a")
    r.add("b")
    out = r.step([("a", [5, 6, 7]), ("b", list(range(10, 21)))], last_only={"a", "b"})
    assert [c[0] for c in be.calls] == [(1, 8), (1, 12)]  # one request per call; 3 positions padded to 8, 11 to 12
    assert [c[1:] for c in be.calls] == [(2, 3), (10, 11)]  # the head on the last real position only
    assert [o.shape[0] for o in out] == [1, 1]
    check_prompt_chunks_invariant(target, be, row_multiple=2)
    with pytest.raises(DSparkError, match=r"chunks of 21 \+ 3 tokens differently"):
        check_prompt_chunks_invariant(target, _RowDependent(target, alone=True, min_rows=1), row_multiple=2)


def test_prompt_chunks_on_openvino_keep_speculative_output_equal_to_target_only(int4_engine):
    _openvino_or_skip()
    from dspark_runtime import Engine
    from dspark_runtime.backends.ort_openvino import OrtOpenVinoDecoder

    eng = Engine.load(int4_engine, row_multiple=2, prompts="openvino")
    assert isinstance(eng.runner("target").prompt_backend, OrtOpenVinoDecoder)  # checked on this CPU when made
    prompt = "Write a function that sorts a list of numbers. " * 3
    ref = eng.generate(prompt, max_new_tokens=32, draft=None)
    for draft in ("lm", "ngram"):
        assert eng.generate(prompt, max_new_tokens=32, draft=draft, draft_length=3).token_ids == ref.token_ids
    batch = eng.generate_batch([prompt, "Name three colours."], max_new_tokens=32, draft="lm")
    assert batch[0].token_ids == ref.token_ids  # served beside another request == solo


def test_dspark_generate_takes_prompts_and_refuses_what_the_engine_lacks(tiny_scatter_engine_dir, capsys):
    from dspark_runtime.cli import main

    args = ["generate", "--engine", str(tiny_scatter_engine_dir), "--prompt", "hi", "--max-new-tokens", "3", "--json"]
    with pytest.raises(SystemExit) as e:
        main(args + ["--prompts", "prompt-graph"])
    assert e.value.code == 2 and "add-prompt-graph" in capsys.readouterr().err
    try:
        main(args + ["--prompts", "target"])
    except SystemExit as e:
        assert e.code in (0, None)
    import json

    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 3


def test_the_prompt_graph_leaves_its_weights_on_base_pages(int4_engine):
    """Prompt chunks are compute-bound: the prompt graph's session skips the huge-page collapse the target's
    decoding steps pay for (dspark_runtime.machine.huge_pages), which would cost seconds at its first use."""
    from dspark_runtime import Engine
    from dspark_runtime.engine_dir.manifest import PROMPT_GRAPH

    eng = Engine.load(int4_engine)
    assert eng._backends[PROMPT_GRAPH].huge_pages is False
    assert eng._backends["target"].huge_pages is True
