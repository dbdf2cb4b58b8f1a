"""The OpenVINO GenAI peer (benchmarks/peers/): its three systems, the up-front refusal naming the install steps,
``install.sh openvino`` / ``openvino-model`` (usage, arguments, the memory wait, what built.json records, with a
stand-in optimum-cli), and the worker with openvino / openvino_genai faked at the library boundary (what it
passes to LLMPipeline and generate, what it makes of the streamer's writes). No OpenVINO needed; the last test runs
the real install when it is there (slow)."""
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from benchmarks.compare import run, systems
from benchmarks.peers import worker

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "benchmarks" / "peers" / "install.sh"
OV_SYSTEMS = ("openvino-genai", "openvino-genai-pld", "openvino-genai-draft")


# ---------------------------------------------------------------------------------------------
# the system table and the refusal


def test_openvino_systems_in_table():
    s = systems.SYSTEMS
    for name in OV_SYSTEMS:
        assert s[name].backend == "openvino-genai" and s[name].peer == "openvino", name
    assert s["openvino-genai"].options == {} and s["openvino-genai"].baseline is None
    assert s["openvino-genai-pld"].options == {"prompt_lookup": {"num_assistant_tokens": 10, "max_ngram_size": 2}}
    assert s["openvino-genai-draft"].options == {"draft": True}
    assert s["openvino-genai-pld"].baseline == s["openvino-genai-draft"].baseline == "openvino-genai"
    # the descriptions say what runs: the settings, as in llama-cpp-pld
    assert "num_assistant_tokens 10" in s["openvino-genai-pld"].description
    assert "max_ngram_size 2" in s["openvino-genai-pld"].description
    assert "0.5B draft" in s["openvino-genai-draft"].description
    assert "--weight-format int4" in s["openvino-genai"].description
    assert systems.PEER_INSTALL["openvino"] == "benchmarks/peers/install.sh openvino"
    # every option a system gives is one the worker accepts
    for name in OV_SYSTEMS:
        assert set(s[name].options) <= set(worker.OV_OPTIONS)


def _ov_tree(root: Path, *names):
    for rel in ["openvino/venv/bin/python", *[f"openvino/models/{n}-int4/openvino_model.xml" for n in names]]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("")


def test_openvino_refusal_names_the_install_steps(tmp_path, monkeypatch):
    peers = tmp_path / "peers"
    monkeypatch.setenv("DSPARK_PEER_DIR", str(peers))
    g = tmp_path / "x.gguf"
    m_plain, m_draft = systems.check_peers(["openvino-genai", "openvino-genai-draft"], peers, "tgt", "drf", g, g)
    assert m_plain.startswith("system openvino-genai needs its peer (openvino): ")
    assert f"{peers}/openvino/venv/bin/python is missing, run `benchmarks/peers/install.sh openvino`" in m_plain
    assert f"{peers}/openvino/models/tgt-int4/openvino_model.xml is missing, run " \
           "`benchmarks/peers/install.sh openvino-model tgt`" in m_plain
    assert "drf" not in m_plain and ".gguf" not in m_plain  # the plain system needs neither draft nor GGUF
    assert "`benchmarks/peers/install.sh openvino-model drf`" in m_draft

    _ov_tree(peers, "tgt")  # the target exported, the draft not
    (msg,) = systems.check_peers(list(OV_SYSTEMS), peers, "tgt", "drf", g, g)
    assert msg.startswith("system openvino-genai-draft") and "openvino-model drf" in msg
    _ov_tree(peers, "tgt", "drf")
    assert systems.check_peers(list(OV_SYSTEMS), peers, "tgt", "drf", g, g) == []


def test_main_refuses_missing_openvino_before_any_worker(tmp_path, monkeypatch):
    target = tmp_path / "qwen-tgt"
    target.mkdir()
    monkeypatch.setattr(run, "run_worker", lambda *a, **k: pytest.fail("no worker may start"))
    with pytest.raises(SystemExit) as e:
        run.main(["--target", str(target), "--systems", "openvino-genai-draft", "--draft", "qwen-drf",
                  "--peer-dir", str(tmp_path / "none"), "--out-dir", str(tmp_path / "out")])
    text = str(e.value)
    assert text.startswith("error: peer systems not installed")
    assert "install.sh openvino-model qwen-tgt" in text and "install.sh openvino-model qwen-drf" in text


def test_job_fields_carry_the_openvino_models(tmp_path):
    settings = {"peer_n_ctx": 2048, "peer_models": {
        "target_gguf": "t.gguf", "draft_gguf": "d.gguf", "llama_speculative": "ls", "ort_model": "om",
        "ov_model": "/p/openvino/models/tgt-int4", "ov_draft_model": "/p/openvino/models/drf-int4"}}
    f = systems.peer_job_fields("openvino-genai-draft", settings, tmp_path)
    assert f["python"] == str(tmp_path / "openvino" / "venv" / "bin" / "python")
    assert f["ov_model"] == "/p/openvino/models/tgt-int4" and f["ov_draft_model"] == "/p/openvino/models/drf-int4"
    files = systems.peer_files(tmp_path, "tgt", "drf")
    assert files["ov_model"] == tmp_path / "openvino" / "models" / "tgt-int4"
    assert files["ov_draft_model"] == tmp_path / "openvino" / "models" / "drf-int4"
    assert systems.peer_files(tmp_path, "tgt")["ov_draft_model"] is None


# ---------------------------------------------------------------------------------------------
# install.sh


def _install(*args, env=None, timeout=60):
    e = {k: v for k, v in os.environ.items() if k not in ("FORCE", "MEMINFO", "OV_EXPORT_MIN_GB", "MEM_WAIT_S")}
    e.update(env or {})
    return subprocess.run(["bash", str(INSTALL), *args], capture_output=True, text=True, env=e, timeout=timeout)


def test_install_usage_lists_openvino():
    r = _install("--help")
    assert r.returncode == 2
    assert "install.sh openvino " in r.stdout and "install.sh openvino-model [MODEL...]" in r.stdout
    assert "--task text-generation-with-past" in r.stdout and "--weight-format int4" in r.stdout
    assert "TORCH_INDEX" in r.stdout and "OV_EXPORT_MIN_GB" in r.stdout
    assert "set -euo" not in r.stdout  # the usage is the header comment only
    r = _install("openvinoo")
    assert r.returncode == 1 and "unknown peer 'openvinoo'" in r.stderr
    assert "openvino, openvino-model [MODEL...]" in r.stderr


def test_openvino_model_needs_the_venv_first(tmp_path):
    r = _install("openvino-model", env={"DSPARK_PEER_DIR": str(tmp_path / "peers")})
    assert r.returncode == 1
    assert "openvino is not installed: run" in r.stderr and "install.sh openvino first" in r.stderr


def _fake_openvino_venv(peers: Path) -> Path:
    """A peer folder with a stand-in optimum-cli (writes openvino_model.xml, prints NNCF's bitwidth table, records
    its arguments) and the project's python as the venv's."""
    bin_ = peers / "openvino" / "venv" / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "python").symlink_to(sys.executable)
    cli = bin_ / "optimum-cli"
    cli.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$FAKE_ARGV"\nout="${@: -1}"\nmkdir -p "$out"\n'
                   'echo "<net/>" > "$out/openvino_model.xml"\n'
                   "echo '│ Weight compression mode   │ % all parameters (layers)   │'\n"
                   "echo '│ int4_asym, group size 128 │ 74% (196 / 199)             │'\n")
    cli.chmod(0o755)
    return bin_


def _model_folder(tmp_path) -> Path:
    src = tmp_path / "hf" / "tiny-model"
    src.mkdir(parents=True)
    (src / "config.json").write_text("{}")
    return src


def _meminfo(path: Path, gib: int) -> Path:
    path.write_text(f"MemTotal:       25165824 kB\nMemAvailable:   {gib * 1048576} kB\n")
    return path


def test_openvino_model_export_records_command_and_cost(tmp_path):
    peers, src = tmp_path / "peers", _model_folder(tmp_path)
    _fake_openvino_venv(peers)
    argv_file = tmp_path / "argv.txt"
    env = {"DSPARK_PEER_DIR": str(peers), "FAKE_ARGV": str(argv_file),
           "MEMINFO": str(_meminfo(tmp_path / "meminfo", 20))}
    r = _install("openvino-model", str(src), env=env)
    assert r.returncode == 0, r.stderr
    out = peers / "openvino" / "models" / "tiny-model-int4"
    assert argv_file.read_text().split("\n")[:-1] == [
        "export", "openvino", "--model", str(src), "--task", "text-generation-with-past", "--weight-format", "int4",
        str(out)]
    built = json.loads((out / "built.json").read_text())
    assert built["command"] == (f"optimum-cli export openvino --model {src} --task text-generation-with-past "
                                f"--weight-format int4 {out}")
    assert built["source"] == str(src) and built["mem_available_gib_at_start"] == 20
    assert built["wall"] and built["peak_rss_kb"]  # /usr/bin/time -v, or seconds where it is missing
    assert built["export"]["bitwidth"] == {"int4_asym, group size 128": "74% (196 / 199)"}
    assert "optimum-intel" in built["export"]["versions"]  # null here: not installed in the project's venv

    argv_file.unlink()  # in place: skipped without FORCE, redone with it
    r = _install("openvino-model", str(src), env=env)
    assert r.returncode == 0 and "already exported" in r.stderr and not argv_file.exists()
    r = _install("openvino-model", str(src), env={**env, "FORCE": "1"})
    assert r.returncode == 0 and argv_file.exists()


def test_openvino_model_refuses_a_missing_model_folder(tmp_path):
    peers = tmp_path / "peers"
    _fake_openvino_venv(peers)
    r = _install("openvino-model", str(tmp_path / "nope"), env={"DSPARK_PEER_DIR": str(peers),
                                                                "DSPARK_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 1 and "no converted HF folder for" in r.stderr and "dspark-export fetch" in r.stderr


def test_openvino_model_waits_for_memory_then_gives_up(tmp_path):
    peers, src = tmp_path / "peers", _model_folder(tmp_path)
    _fake_openvino_venv(peers)
    argv_file = tmp_path / "argv.txt"
    env = {"DSPARK_PEER_DIR": str(peers), "FAKE_ARGV": str(argv_file), "MEM_POLL_S": "1", "MEM_WAIT_S": "2",
           "MEMINFO": str(_meminfo(tmp_path / "meminfo", 5))}
    r = _install("openvino-model", str(src), env=env)
    assert r.returncode == 1
    assert "5 GiB available, waiting for 12 GiB (0/2 s)" in r.stderr
    assert "needs 12 GiB of available memory, 5 GiB after waiting 2 s" in r.stderr
    assert not argv_file.exists()  # the export never started


def test_openvino_model_starts_once_memory_frees(tmp_path):
    peers, src = tmp_path / "peers", _model_folder(tmp_path)
    _fake_openvino_venv(peers)
    meminfo = _meminfo(tmp_path / "meminfo", 4)
    argv_file = tmp_path / "argv.txt"
    env = {"DSPARK_PEER_DIR": str(peers), "FAKE_ARGV": str(argv_file), "MEM_POLL_S": "1", "MEM_WAIT_S": "30",
           "MEMINFO": str(meminfo), "OV_EXPORT_MIN_GB": "6"}
    threading.Timer(1.5, lambda: _meminfo(meminfo, 8)).start()  # the other job ends
    r = _install("openvino-model", str(src), env=env)
    assert r.returncode == 0, r.stderr
    assert "4 GiB available, waiting for 6 GiB" in r.stderr and argv_file.exists()
    assert json.loads((peers / "openvino/models/tiny-model-int4/built.json").read_text())[
        "mem_available_gib_at_start"] == 8


# ---------------------------------------------------------------------------------------------
# the worker: pure parts


def _model_dir(tmp_path, name="tgt-int4", runtime_options=None) -> Path:
    d = tmp_path / name
    d.mkdir()
    opts = "".join(f'<{k} value="{v}" />' for k, v in (runtime_options or {}).items())
    (d / "openvino_model.xml").write_text(
        '<?xml version="1.0"?>\n<net name="m" version="11"><layers><layer id="0" name="x" type="Parameter">'
        '<rt_info><attribute name="fused_names" version="0" value="x" /></rt_info></layer></layers><edges />'
        '<rt_info><nncf><weight_compression><mode value="int4_asym" /><group_size value="128" />'
        f'<advanced_parameters value="{"x" * 200}" /></weight_compression></nncf>'
        f"<runtime_options>{opts}</runtime_options></rt_info></net>")
    (d / "openvino_model.bin").write_bytes(b"\0" * 1000)
    return d


def _job(tmp_path, options=None, **kw):
    job = {"system": "openvino-genai", "backend": "openvino-genai", "options": options or {}, "threads": 2,
           "max_new_tokens": 6, "ov_model": str(tmp_path / "tgt-int4"), "ov_draft_model": str(tmp_path / "drf-int4"),
           "prompts": [{"dataset": "humaneval", "index": 0, "key": "humaneval[0]", "ids": [5, 6, 7]},
                       {"dataset": "mbpp", "index": 0, "key": "mbpp[0]", "ids": [8, 9]}]}
    job.update(kw)
    return job


def test_ov_settings(tmp_path):
    _model_dir(tmp_path)
    _model_dir(tmp_path, "drf-int4")
    st = worker.ov_settings(_job(tmp_path))
    assert st == {"model": str(tmp_path / "tgt-int4"), "draft_model": None, "properties": {"INFERENCE_NUM_THREADS": 2},
                  "prompt_lookup": None, "num_assistant_tokens": None}
    pld = {"num_assistant_tokens": 10, "max_ngram_size": 2}
    assert worker.ov_settings(_job(tmp_path, {"prompt_lookup": pld}))["prompt_lookup"] == pld
    st = worker.ov_settings(_job(tmp_path, {"draft": True}, threads=3))
    assert st["draft_model"] == str(tmp_path / "drf-int4") and st["properties"] == {"INFERENCE_NUM_THREADS": 3}
    assert worker.ov_settings(_job(tmp_path, {"draft": {"num_assistant_tokens": 3}}))["num_assistant_tokens"] == 3


@pytest.mark.parametrize("options, msg", [
    ({"speculative": {}}, "unknown option(s) ['speculative']; the options are prompt_lookup, draft"),
    ({"prompt_lookup": 10}, "prompt_lookup must be {'num_assistant_tokens': N, 'max_ngram_size': M}"),
    ({"prompt_lookup": {"num_assistant_tokens": 0, "max_ngram_size": 2}}, "with N, M > 0"),
    ({"prompt_lookup": {"num_assistant_tokens": 4}}, "with N, M > 0"),
    ({"draft": "yes"}, "draft must be true or {'num_assistant_tokens': N}"),
    ({"draft": True, "prompt_lookup": {"num_assistant_tokens": 4, "max_ngram_size": 2}}, "give one of them"),
])
def test_ov_settings_refuses_bad_options(tmp_path, options, msg):
    _model_dir(tmp_path)
    _model_dir(tmp_path, "drf-int4")
    with pytest.raises(ValueError) as e:
        worker.ov_settings(_job(tmp_path, options))
    assert msg in str(e.value)


def test_ov_settings_names_the_export_that_is_missing(tmp_path):
    with pytest.raises(ValueError) as e:
        worker.ov_settings(_job(tmp_path))
    assert f"no OpenVINO model at {tmp_path / 'tgt-int4'} (ov_model)" in str(e.value)
    assert "run `benchmarks/peers/install.sh openvino-model tgt`" in str(e.value)
    _model_dir(tmp_path)
    worker.ov_settings(_job(tmp_path))  # the plain system needs no draft export
    with pytest.raises(ValueError, match="openvino-model drf`"):
        worker.ov_settings(_job(tmp_path, {"draft": True}))
    with pytest.raises(ValueError, match="threads must be >= 1"):
        worker.ov_settings(_job(tmp_path, threads=0))


def test_commit_row_and_rounds():
    # first commit: the prefill's token; then rounds of 3, 1 and 2 tokens
    commits = [(10.5, 1), (11.0, 3), (11.2, 1), (11.5, 2)]
    row = worker.commit_row([1, 2], [7, 8, 9, 10, 11, 12, 13], 10.0, commits, 11.6)
    assert row["ttft_ms"] == pytest.approx(500.0)
    assert row["decode_tokens"] == 6 and row["decode_s"] == pytest.approx(1.1)
    assert row["tokens_per_second"] == pytest.approx(6 / 1.1)
    assert row["new_tokens"] == 7 and row["prompt_tokens"] == 2
    # width 4, limit 7: before each round 1, 4, 5 tokens are done -> 4, min(4, 7-4-1)=2, min(4, 7-5-1)=1 proposed
    assert worker.ov_rounds(commits, 4, 7) == [(4, 2), (2, 0), (1, 1)]
    assert worker.ov_rounds(commits[:1], 4, 7) == [] and worker.ov_rounds([], 4, 7) == []
    none = worker.commit_row([1], [], 0.0, [], 0.3)
    assert none["ttft_ms"] == pytest.approx(300.0) and none["tokens_per_second"] is None


def test_ov_model_rt_info(tmp_path):
    d = _model_dir(tmp_path, runtime_options={"KV_CACHE_PRECISION": "f16", "ACTIVATIONS_SCALE_FACTOR": "8.0"})
    info = worker.ov_model_rt_info(d)
    assert info["runtime_options"] == {"KV_CACHE_PRECISION": "f16", "ACTIVATIONS_SCALE_FACTOR": "8.0"}
    assert info["weight_compression"] == {"mode": "int4_asym", "group_size": "128"}  # the long value left out
    assert "fused_names" not in json.dumps(info)  # a layer's rt_info is not the model's


# ---------------------------------------------------------------------------------------------
# the worker with the library faked at its boundary


class _Type:
    def __init__(self, name):
        self.name_ = name

    def to_string(self):
        return self.name_


class _Enum:
    name = "PERFORMANCE"


def _fake_libs(plan, calls, ext=None):
    """(openvino, openvino_genai) stand-ins: generate streams ``plan`` (tokens per write, the first an int as the
    library writes a single token) cut at max_new_tokens, tokens 100, 101, ..."""
    ov = types.ModuleType("openvino")

    class Tensor:
        def __init__(self, arr):
            self.arr = arr

    class Core:
        def get_property(self, device, key):
            calls.setdefault("props", []).append((device, key))
            values = {"INFERENCE_PRECISION_HINT": _Type("bf16"), "KV_CACHE_PRECISION": _Type("u8"),
                      "DYNAMIC_QUANTIZATION_GROUP_SIZE": 32, "EXECUTION_MODE_HINT": _Enum()}
            if key not in values:
                raise RuntimeError(f"Unsupported property {key}")
            return values[key]

    ov.Tensor, ov.Core, ov.get_version = Tensor, Core, lambda: "fake-ov"
    g = types.ModuleType("openvino_genai")
    g.StreamingStatus = types.SimpleNamespace(RUNNING="running")
    g.get_version = lambda: "fake-genai"

    class StreamerBase:
        def __init__(self):
            calls["streamer_init"] = calls.get("streamer_init", 0) + 1

    class Mean:
        def __init__(self, v):
            self.mean = v

    class Config:
        def __init__(self):
            self.do_sample, self.max_new_tokens = True, None
            self.num_assistant_tokens, self.max_ngram_size = None, 0
            self.eos_token_id = 151645  # the model's own, kept

    class LLMPipeline:
        def __init__(self, path, device, **kw):
            calls["pipeline"] = (path, device, kw)
            self.config = Config()

        def get_generation_config(self):
            return self.config

        def generate(self, x, config, streamer):
            assert config is self.config and not config.do_sample and config.eos_token_id == 151645
            calls.setdefault("generate", []).append((x.arr.dtype.name, x.arr.shape, x.arr.tolist(),
                                                     config.max_new_tokens, config.num_assistant_tokens,
                                                     config.max_ngram_size))
            toks, k = [], 100
            for i, n in enumerate(plan):
                n = min(n, config.max_new_tokens - len(toks))
                if n <= 0:
                    break
                new = list(range(k, k + n))
                k += n
                toks += new
                assert streamer.write(new[0] if i == 0 else new) == "running"
                time.sleep(0.001)
            streamer.end()
            pm = types.SimpleNamespace(get_ttft=lambda: Mean(1.0), get_tpot=lambda: Mean(2.0),
                                       get_throughput=lambda: Mean(3.0), get_generate_duration=lambda: Mean(4.0))
            return types.SimpleNamespace(tokens=[toks], perf_metrics=pm, extended_perf_metrics=ext)

    def draft_model(path, device="", **kw):
        calls["draft_model"] = (path, device, kw)
        return ("draft-desc", path)

    g.StreamerBase, g.LLMPipeline, g.draft_model = StreamerBase, LLMPipeline, draft_model
    return ov, g


def _run_fake(tmp_path, monkeypatch, options, plan, ext=None):
    _model_dir(tmp_path, runtime_options={"ACTIVATIONS_SCALE_FACTOR": "8.0"})
    _model_dir(tmp_path, "drf-int4")
    calls = {}
    ov, g = _fake_libs(plan, calls, ext)
    monkeypatch.setitem(sys.modules, "openvino", ov)
    monkeypatch.setitem(sys.modules, "openvino_genai", g)
    rows = []
    meta = worker._openvino_genai_worker(_job(tmp_path, options), lambda p, row: rows.append((p["key"], row)))
    return rows, meta, calls


def test_worker_plain(tmp_path, monkeypatch):
    rows, meta, calls = _run_fake(tmp_path, monkeypatch, {}, [1, 1, 1, 1, 1, 1, 1, 1])
    path, device, kw = calls["pipeline"]
    assert (path, device, kw) == (str(tmp_path / "tgt-int4"), "CPU", {"INFERENCE_NUM_THREADS": 2})
    assert "draft_model" not in calls
    # warm-up (first prompt, 8 tokens), then every prompt: its ids as int64 [1, n], max_new_tokens as asked
    assert calls["generate"] == [("int64", (1, 3), [[5, 6, 7]], 8, None, 0), ("int64", (1, 3), [[5, 6, 7]], 6, None, 0),
                                 ("int64", (1, 2), [[8, 9]], 6, None, 0)]
    assert [k for k, _ in rows] == ["humaneval[0]", "mbpp[0]"]
    row = rows[0][1]
    assert row["token_ids"] == [100, 101, 102, 103, 104, 105] and row["decode_tokens"] == 5
    assert row["ttft_ms"] > 0 and row["tokens_per_second"] > 0 and "note" not in row
    assert "rounds" not in row and row["ov_metrics"] == {"ttft_ms": 1.0, "tpot_ms": 2.0, "throughput": 3.0,
                                                          "generate_ms": 4.0}
    o = meta["openvino"]
    assert o["device_defaults"] == {"INFERENCE_PRECISION_HINT": "bf16", "KV_CACHE_PRECISION": "u8",
                                    "DYNAMIC_QUANTIZATION_GROUP_SIZE": "32", "EXECUTION_MODE_HINT": "PERFORMANCE"}
    assert {k for _, k in calls["props"]} == set(worker.OV_PRECISION_KEYS)
    assert o["effective"]["INFERENCE_PRECISION_HINT"] == "bf16" and o["effective"]["INFERENCE_NUM_THREADS"] == "2"
    assert o["effective"]["ACTIVATIONS_SCALE_FACTOR"] == "8.0" and o["num_assistant_tokens"] is None
    assert o["model_weight_compression"] == {"mode": "int4_asym", "group_size": "128"}
    assert meta["model_bytes"] == 1000 + (tmp_path / "tgt-int4" / "openvino_model.xml").stat().st_size
    assert meta["versions"]["openvino_genai"] == "fake-genai" and meta["load_s"] >= 0 and meta["warmup_s"] >= 0


def test_worker_prompt_lookup(tmp_path, monkeypatch):
    rows, meta, calls = _run_fake(tmp_path, monkeypatch, {"prompt_lookup": {"num_assistant_tokens": 10,
                                                                            "max_ngram_size": 2}}, [1, 3, 1, 5])
    assert calls["pipeline"][2] == {"INFERENCE_NUM_THREADS": 2, "prompt_lookup": True}
    assert calls["generate"][1][3:] == (6, 10, 2)
    row = rows[0][1]
    assert row["token_ids"] == [100, 101, 102, 103, 104, 105]  # the last write cut at the limit
    # rounds: 3 tokens (2 accepted), 1 (0), 1 of 5 (cut): proposed capped by the tokens left but one
    assert (row["rounds"], row["accepted"], row["proposed"]) == (3, 2, 4 + 1 + 0)
    assert row["decode_tokens"] == 5 and "ov_stats" not in row
    assert meta["openvino"]["num_assistant_tokens"] == 10 and meta["openvino"]["max_ngram_size"] == 2


def test_worker_draft_uses_the_library_default(tmp_path, monkeypatch):
    ext = types.SimpleNamespace(get_num_accepted_tokens=lambda: 4, get_num_draft_tokens=lambda: 10,
                                get_draft_acceptance_rate=lambda: types.SimpleNamespace(mean=0.4))
    rows, meta, calls = _run_fake(tmp_path, monkeypatch, {"draft": True}, [1, 6, 1], ext)
    assert calls["draft_model"] == (str(tmp_path / "drf-int4"), "CPU", {"INFERENCE_NUM_THREADS": 2})
    assert calls["pipeline"][2] == {"INFERENCE_NUM_THREADS": 2,
                                    "draft_model": ("draft-desc", str(tmp_path / "drf-int4"))}
    assert calls["generate"][1][4] is None  # num_assistant_tokens left to the library
    row = rows[0][1]
    assert meta["openvino"]["num_assistant_tokens"] == worker.OV_DEFAULT_NUM_ASSISTANT_TOKENS == 5
    assert meta["openvino"]["num_assistant_tokens_set"] is None
    assert (row["rounds"], row["accepted"], row["proposed"]) == (1, 4, 4)  # 5 of 6 (cut); capped at 6-1-1
    assert row["ov_stats"] == {"num_accepted_tokens": 4, "num_draft_tokens": 10, "draft_acceptance_rate": 0.4}
    assert meta["model_bytes"] == 2000 + sum((tmp_path / d / "openvino_model.xml").stat().st_size
                                             for d in ("tgt-int4", "drf-int4"))


def test_worker_flags_a_round_wider_than_its_setting(tmp_path, monkeypatch):
    rows, _, _ = _run_fake(tmp_path, monkeypatch, {"draft": {"num_assistant_tokens": 2}}, [1, 4, 1])
    assert "a round committed more than num_assistant_tokens + 1 = 3 tokens" in rows[0][1]["note"]


# ---------------------------------------------------------------------------------------------
# the real install (benchmarks/peers/install.sh openvino + openvino-model), when it is there


def _real_peer():
    d = systems.default_peer_dir() / "openvino"
    models = [d / "models" / f"{n}-int4" for n in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")]
    if not (d / "venv" / "bin" / "python").exists() or not all((m / "openvino_model.xml").is_file() for m in models):
        return None
    return d, models


@pytest.mark.slow
@pytest.mark.skipif(_real_peer() is None, reason="OpenVINO peer not installed (benchmarks/peers/install.sh openvino "
                                                 "and openvino-model)")
def test_real_openvino_worker_speculative_equals_plain(tmp_path):
    from transformers import AutoTokenizer

    from benchmarks.compare.workers import run_worker
    from dspark_export.models.catalog import model_path

    d, (tgt, drf) = _real_peer()
    tok = AutoTokenizer.from_pretrained(model_path("qwen2.5-coder-1.5b-instruct"))
    ids = list(tok.apply_chat_template([{"role": "user", "content": "Write a Python function that returns the "
                                         "factorial of n."}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False))
    out = {}
    for name in OV_SYSTEMS:
        job = {**_job(tmp_path, systems.SYSTEMS[name].options, max_new_tokens=8, ov_model=str(tgt),
                      ov_draft_model=str(drf)), "system": name, "python": str(d / "venv" / "bin" / "python")}
        job["prompts"] = [{"dataset": "x", "index": 0, "key": "x[0]", "ids": ids}]
        rows, meta, err = run_worker(job, tmp_path, name)
        assert err is None and len(rows) == 1 and "error" not in rows[0], (err, rows)
        assert rows[0]["new_tokens"] == 8 and meta["openvino"]["effective"]["INFERENCE_NUM_THREADS"] == "2"
        out[name] = rows[0]["token_ids"]
    assert out["openvino-genai-pld"] == out["openvino-genai"] == out["openvino-genai-draft"]
