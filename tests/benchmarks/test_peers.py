"""benchmarks.compare's peers (benchmarks/peers/): the system table, the up-front refusal of a peer that is
not installed, the resume logic (progress file, schedule, settings mismatch) with a fake worker, and the
parsing of llama.cpp's llama-speculative output from text captured from the real binary
(tests/fixtures/data/llama_speculative_*.txt). No network, no peer venv, no model."""
import json
from pathlib import Path

import pytest

from benchmarks.compare import report, resume, run, systems
from benchmarks.peers import llama_speculative, worker as peer_worker

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "data"


@pytest.fixture(scope="module")
def lspec():
    return llama_speculative


@pytest.fixture(scope="module")
def worker():
    return peer_worker


# ---------------------------------------------------------------------------------------------
# the system table and the refusal


def test_peer_systems_in_table():
    s = systems.SYSTEMS
    for name, backend, peer in [("llama-cpp", "llama-cpp", "llama-cpp"), ("llama-cpp-pld", "llama-cpp", "llama-cpp"),
                                ("llama-speculative", "llama-speculative", "llama-cpp"),
                                ("ort-genai", "ort-genai", "ort-genai"), ("ort-genai-ngram", "ort-genai", "ort-genai")]:
        assert s[name].backend == backend and s[name].peer == peer, name
        assert s[name].description
    assert s["llama-cpp-pld"].options == {"prompt_lookup": 10}
    assert s["ort-genai-ngram"].options == {"speculative": {"ngram_size": 3, "max_draft_tokens": 4}}
    assert s["llama-cpp-pld"].baseline == s["llama-speculative"].baseline == "llama-cpp"
    assert s["ort-genai-ngram"].baseline == "ort-genai"
    assert s["llama-cpp"].baseline is None and s["hf"].peer is None and s["dspark-lm"].peer is None
    assert set(systems.PEER_INSTALL) == {"llama-cpp", "ort-genai", "openvino"}  # openvino: test_peers_openvino.py


def _fake_peer_tree(root: Path, target="tgt"):
    """The files install.sh leaves for both peers, empty."""
    for rel in ["llama-cpp/venv/bin/python", "llama-cpp/bin/llama-speculative", "ort-genai/venv/bin/python",
                f"ort-genai/models/{target}-int4/genai_config.json"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("")


def test_refusal_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_PEER_DIR", str(tmp_path / "peers"))  # the default peer dir here
    peers = tmp_path / "peers"
    tg, dg = tmp_path / "t.gguf", tmp_path / "d.gguf"
    tg.write_text("")  # the target GGUF is there, the draft GGUF is not
    msgs = systems.check_peers(["llama-cpp", "hf", "llama-speculative", "ort-genai-ngram"], peers, "tgt", "drf", tg, dg)
    assert len(msgs) == 3  # hf needs no peer
    m_cpp, m_spec, m_ort = msgs
    assert m_cpp.startswith("system llama-cpp needs its peer (llama-cpp): ")
    assert f"{peers}/llama-cpp/venv/bin/python is missing, run `benchmarks/peers/install.sh llama-cpp`" in m_cpp
    assert "t.gguf" not in m_cpp
    assert "llama-cpp/bin/llama-speculative is missing" in m_spec
    assert f"{dg} is missing, run `dspark-export fetch drf`" in m_spec
    assert "run `benchmarks/peers/install.sh ort-genai`" in m_ort
    assert f"{peers}/ort-genai/models/tgt-int4/genai_config.json is missing, run " \
           "`benchmarks/peers/install.sh ort-genai-model tgt`" in m_ort

    _fake_peer_tree(peers)
    dg.write_text("")
    assert systems.check_peers(["llama-cpp", "llama-cpp-pld", "llama-speculative", "ort-genai", "ort-genai-ngram"],
                           peers, "tgt", "drf", tg, dg) == []


def test_refusal_in_another_peer_dir_says_where_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_PEER_DIR", str(tmp_path / "default"))
    other = tmp_path / "elsewhere"
    (msg,) = systems.check_peers(["ort-genai"], other, "tgt", "drf", tmp_path / "t.gguf", tmp_path / "d.gguf")
    assert f"run `DSPARK_PEER_DIR={other} benchmarks/peers/install.sh ort-genai`" in msg


def test_main_refuses_missing_peer_before_any_worker(tmp_path, monkeypatch):
    target = tmp_path / "qwen-tgt"
    target.mkdir()
    (tmp_path / "t.gguf").write_text("")
    monkeypatch.setattr(run, "run_worker", lambda *a, **k: pytest.fail("no worker may start"))
    with pytest.raises(SystemExit) as e:
        run.main(["--target", str(target), "--systems", "llama-cpp,ort-genai", "--peer-dir", str(tmp_path / "none"),
                  "--target-gguf", str(tmp_path / "t.gguf"), "--out-dir", str(tmp_path / "out")])
    text = str(e.value)
    assert text.startswith("error: peer systems not installed")
    assert "system llama-cpp needs its peer" in text and "system ort-genai needs its peer" in text
    assert "install.sh ort-genai-model qwen-tgt" in text


def test_default_peer_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("DSPARK_PEER_DIR", raising=False)
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    assert systems.default_peer_dir() == tmp_path / "cache" / "peers"
    monkeypatch.delenv("DSPARK_CACHE")
    assert systems.default_peer_dir() == Path.home() / ".cache" / "dspark" / "peers"


def test_peer_context():
    assert systems.peer_context(100, 128) == 2048  # floor
    assert systems.peer_context(3000, 128) == 3328  # 3000 + 128 + 64 = 3192 -> next multiple of 256


# ---------------------------------------------------------------------------------------------
# resume


def _prompts(n):
    return [{"dataset": "humaneval", "index": i, "key": f"humaneval[{i}]", "text": f"prompt {i}", "seed": i}
            for i in range(n)]


def test_schedule_skips_done_pairs_and_keeps_rotation():
    chunks = [_prompts(4)[:2], _prompts(4)[2:]]
    names = ["a", "b", "c"]
    full = resume.schedule(chunks, names, set())
    assert [(c, s, [p["index"] for p in t]) for c, s, t in full] == [
        (0, "a", [0, 1]), (0, "b", [0, 1]), (0, "c", [0, 1]), (1, "b", [2, 3]), (1, "c", [2, 3]), (1, "a", [2, 3])]
    done = {("a", "humaneval[0]"), ("a", "humaneval[1]"), ("b", "humaneval[0]"), ("c", "humaneval[3]")}
    plan = resume.schedule(chunks, names, done)
    assert [(c, s, [p["index"] for p in t]) for c, s, t in plan] == [
        (0, "b", [1]), (0, "c", [0, 1]), (1, "b", [2, 3]), (1, "c", [2]), (1, "a", [2, 3])]


def _settings(**kw):
    st = {"target": "/m/tgt", "draft_name": "drf", "engine": None, "datasets": ["humaneval"], "n": 4,
          "max_new_tokens": 8, "temperatures": [0.0], "seed": 0, "chunk": 2, "threads": 2,
          "systems": ["a", "b"], "system_options": {"a": {}, "b": {"x": 1}}, "peer_models": None,
          "descriptions": {"a": "not part of the fingerprint"}}
    st.update(kw)
    return st


def _fake_run(calls, fail_on=None):
    """A fake worker: token ids [index, index] for every prompt; writes each row to the progress file as
    the real workers do; raises KeyboardInterrupt (the run killed) when it reaches ``fail_on``."""
    def run(job, tag):
        calls.append((job["system"], [p["key"] for p in job["prompts"]]))
        rows = []
        for p in job["prompts"]:
            if (job["system"], p["key"]) == fail_on:
                raise KeyboardInterrupt
            r = {"system": job["system"], "dataset": p["dataset"], "index": p["index"], "key": p["key"],
                 "token_ids": [p["index"]] * 2, "new_tokens": 2, "ttft_ms": 10.0, "decode_tokens": 1,
                 "decode_s": 0.5, "tokens_per_second": 2.0, "peak_rss_mb": 100.0}
            cmp_append(job["progress"], {"row": r, "tag": tag})
            rows.append(r)
        return rows, {"load_s": 1.0, "peak_rss_mb": 123.0, "model_bytes": 1000}, None
    return run


def cmp_append(path, obj):
    with open(path, "a") as f:
        f.write(json.dumps(obj) + "\n")


def _session(out, settings, prompts, resume_run, run_worker):
    fp = resume.fingerprint(settings, prompts)
    progress, rows, workers = resume.open_progress(out, fp, resume_run)
    result = {"settings": dict(settings), "rows": list(rows), "workers": list(workers), "sessions": []}
    done = {(r["system"], r["key"]) for r in rows}
    chunks = [prompts[i:i + settings["chunk"]] for i in range(0, len(prompts), settings["chunk"])]
    plan = resume.schedule(chunks, settings["systems"], done)

    def make_job(s, todo):
        return {"system": s, "prompts": todo, "progress": str(progress)}

    run.run_schedule(plan, chunks, result, make_job, run_worker, progress, out, 0.0)
    return result, plan


def test_resume_runs_only_what_is_left(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "write_outputs", lambda *a, **k: None)
    out, prompts, st = tmp_path / "out", _prompts(4), _settings()
    calls = []
    with pytest.raises(KeyboardInterrupt):  # killed while system b runs its second prompt of chunk 1
        _session(out, st, prompts, False, _fake_run(calls, fail_on=("b", "humaneval[3]")))
    assert calls == [("a", ["humaneval[0]", "humaneval[1]"]), ("b", ["humaneval[0]", "humaneval[1]"]),
                     ("b", ["humaneval[2]", "humaneval[3]"])]
    prog = resume.read_progress(out / resume.PROGRESS)
    assert sorted(prog["rows"]) == [("a", "humaneval[0]"), ("a", "humaneval[1]"), ("b", "humaneval[0]"),
                                    ("b", "humaneval[1]"), ("b", "humaneval[2]")]
    assert set(prog["workers"]) == {"c0-a", "c0-b"}  # the killed worker never finished

    calls.clear()
    result, plan = _session(out, st, prompts, True, _fake_run(calls))
    # chunk 1 rotated (b first): b's remaining prompt, then a's two
    assert calls == [("b", ["humaneval[3]"]), ("a", ["humaneval[2]", "humaneval[3]"])]
    got = sorted((r["system"], r["key"]) for r in result["rows"])
    assert got == sorted((s, p["key"]) for s in "ab" for p in prompts)  # every pair once
    by = {(r["system"], r["key"]): r for r in result["rows"]}
    assert by[("a", "humaneval[0]")]["peak_rss_mb"] == 123.0  # from its finished worker's record
    assert by[("b", "humaneval[2]")]["peak_rss_mb"] == 100.0  # its worker died: the row's own figure
    assert [w["tag"] for w in result["workers"]] == ["c0-a", "c0-b", "c1-b", "c1-a"]

    calls.clear()  # a third run with everything done runs nothing
    _, plan = _session(out, st, prompts, True, _fake_run(calls))
    assert plan == [] and calls == []


def test_resume_redoes_failed_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "write_outputs", lambda *a, **k: None)
    out, prompts, st = tmp_path / "out", _prompts(2), _settings(systems=["a"])
    fp = resume.fingerprint(st, prompts)
    path, _, _ = resume.open_progress(out, fp, False)
    cmp_append(path, {"row": {"system": "a", "key": "humaneval[0]", "error": "boom"}, "tag": "c0-a"})
    cmp_append(path, {"row": {"system": "a", "key": "humaneval[1]", "token_ids": [1]}, "tag": "c0-a"})
    with open(path, "a") as f:
        f.write('{"row": {"system": "a", "key": "hum')  # torn last line of a killed run
    calls = []
    _session(out, st, prompts, True, _fake_run(calls))
    assert calls == [("a", ["humaneval[0]"])]


def test_resume_with_other_settings_is_refused(tmp_path):
    out, prompts = tmp_path / "out", _prompts(2)
    resume.open_progress(out, resume.fingerprint(_settings(), prompts), False)
    with pytest.raises(SystemExit) as e:
        resume.open_progress(out, resume.fingerprint(_settings(max_new_tokens=16, threads=1), prompts), True)
    msg = str(e.value)
    assert msg.startswith("error: --resume with other settings than the run in")
    assert "max_new_tokens: was 8, now 16" in msg and "threads: was 2, now 1" in msg
    assert "systems" not in msg
    other_prompts = [dict(p, text=p["text"] + "!") for p in prompts]
    with pytest.raises(SystemExit, match="prompts: was"):
        resume.open_progress(out, resume.fingerprint(_settings(), other_prompts), True)
    # descriptions are not settings: same fingerprint
    assert resume.fingerprint(_settings(descriptions={}), prompts) == resume.fingerprint(_settings(), prompts)


def test_fresh_run_keeps_the_old_progress_aside(tmp_path):
    out, prompts = tmp_path / "out", _prompts(1)
    path, _, _ = resume.open_progress(out, resume.fingerprint(_settings(), prompts), False)
    cmp_append(path, {"row": {"system": "a", "key": "humaneval[0]", "token_ids": [1]}, "tag": "c0-a"})
    path2, rows, workers = resume.open_progress(out, resume.fingerprint(_settings(n=1), prompts), False)
    assert path2 == path and rows == [] and workers == []
    aside = [p for p in out.iterdir() if p.name.startswith("progress.") and p.name != resume.PROGRESS]
    assert len(aside) == 1 and "humaneval[0]" in aside[0].read_text()
    assert resume.read_progress(path)["rows"] == {}


def test_baseline_identity():
    rows = [{"system": "llama-cpp", "key": "k", "dataset": "d", "token_ids": [1, 2, 3]},
            {"system": "llama-cpp-pld", "key": "k", "dataset": "d", "token_ids": [1, 2, 3]},
            {"system": "llama-speculative", "key": "k", "dataset": "d", "token_ids": [1, 5, 3]},
            {"system": "hf", "key": "k", "dataset": "d", "token_ids": [1, 2, 4]}]
    report.add_correctness(rows)
    assert rows[1]["vs_baseline"] is None and rows[2]["vs_baseline"] == 1
    assert rows[1]["vs_hf"] == 2 and "vs_baseline" not in rows[0] and "vs_baseline" not in rows[3]


# ---------------------------------------------------------------------------------------------
# llama-speculative output (captured from the real binary: llama.cpp of llama-cpp-python 0.3.36,
# Qwen2.5-Coder-1.5B-Instruct Q4_K_M target, 0.5B draft, --temp 0 -n 32 -lv 5)


def test_parse_llama_speculative_output(lspec):
    out = (DATA / "llama_speculative_stdout.txt").read_text()
    err = (DATA / "llama_speculative_stderr.txt").read_text()
    expect = json.loads((DATA / "llama_speculative_expected.json").read_text())
    st = lspec.parse_output(out, err)
    assert st["ok"]
    # the figures as the binary printed them ("encoded  167 tokens in    9.654 seconds", "n_predict = 33", ...)
    assert (st["prompt_tokens"], st["encode_s"], st["decoded_tokens"], st["decode_s"]) == (167, 9.654, 33, 20.9)
    assert (st["n_draft"], st["n_predict"], st["n_drafted"], st["n_accept"]) == (3, 33, 24, 24)
    assert st["token_ids"][:5] == [73594, 12669, 198, 1499, 19496]  # "```", "python", "\n", "from", " typing"
    assert st["rounds"] == [(3, 3)] * 8  # 8 verify rounds, all 3 drafts accepted (+ the prefill token)
    assert st["load_ms"] == [3253.08, 1198.2]
    for k in ("prompt_tokens", "n_draft", "n_predict", "n_drafted", "n_accept", "decoded_tokens"):
        assert st[k] == expect[k], k
    assert st["encode_s"] == pytest.approx(expect["encode_s"])
    assert st["decode_s"] == pytest.approx(expect["decode_s"])
    assert st["accept_pct"] == pytest.approx(expect["accept_pct"])
    assert st["token_ids"] == expect["token_ids"]  # the ids llama-cpp-python decodes to the printed text
    assert len(st["token_ids"]) == st["n_predict"]
    # rounds: every verify round drafted n_draft tokens; accepted per round adds up to n_accept
    assert all(p == st["n_draft"] for p, _ in st["rounds"])
    assert sum(a for _, a in st["rounds"]) == st["n_accept"]
    assert len(st["rounds"]) * st["n_draft"] == st["n_drafted"]
    assert st["rounds"] == [tuple(r) for r in expect["rounds"]]
    assert len(st["load_ms"]) == 2  # draft and target perf summaries


def test_llama_speculative_command(lspec):
    argv = lspec.command("/p/llama-speculative", "/m/t.gguf", "/m/d.gguf", "<|im_start|>user\nhi<|im_end|>\n",
                         max_new_tokens=32, threads=2, n_ctx=2048)
    assert argv[0] == "/p/llama-speculative"
    i = argv.index("-p")
    assert argv[i + 1].endswith("\n")  # passed as is: -f would strip the trailing newline
    for flag, val in [("-m", "/m/t.gguf"), ("-md", "/m/d.gguf"), ("-n", "32"), ("--temp", "0"), ("-c", "2048"),
                      ("-t", "2"), ("-td", "2"), ("-tb", "2"), ("-tbd", "2"), ("-lv", "5")]:
        assert argv[argv.index(flag) + 1] == val, flag
    assert "--spec-draft-n-max" not in argv
    assert lspec.command("b", "t", "d", "x", max_new_tokens=1, threads=1, n_ctx=1, draft_max=5)[-1] == "5"


def test_parse_failure_is_not_ok(lspec):
    st = lspec.parse_output("", "error: failed to load model\n")
    assert not st["ok"] and st["token_ids"] == [] and st["rounds"] == []


# ---------------------------------------------------------------------------------------------
# the peer worker's pure helpers


def test_pld_rounds(worker):
    generated = [5, 6, 7, 8, 9, 10, 11]
    # first token from prefill; draft at 1 proposes [6, 7, 0] -> commits 6, 7, 8 (2 accepted + correction);
    # draft at 4 proposes nothing -> commits 9; draft at 5 proposes [10, 11, 12], output cut after 11
    calls = [(1, [6, 7, 0]), (4, []), (5, [10, 11, 12])]
    assert worker.pld_rounds(calls, generated) == [(3, 2), (0, 0), (3, 2)]
    assert worker.pld_rounds([], generated) == []
    st = worker.round_stats(worker.pld_rounds(calls, generated))
    assert st["rounds"] == 3 and st["accepted"] == 4 and st["proposed"] == 6 and st["tau"] == pytest.approx(7 / 3)


def test_timing_row(worker):
    row = worker.timing_row([1, 2, 3], [7, 8, 9], 10.0, [10.5, 11.0, 11.5], 11.6)
    assert row["ttft_ms"] == pytest.approx(500.0)
    assert row["decode_tokens"] == 2 and row["decode_s"] == pytest.approx(1.1)
    assert row["tokens_per_second"] == pytest.approx(2 / 1.1)
    assert row["prompt_tokens"] == 3 and row["new_tokens"] == 3
    one = worker.timing_row([1], [7], 0.0, [0.2], 0.2)
    assert one["tokens_per_second"] is None and one["decode_tokens"] == 0


def test_report_flags_contended_workers():
    rows = [{"system": "llama-cpp", "dataset": "humaneval", "index": 0, "key": "humaneval[0]", "token_ids": [1, 2],
             "new_tokens": 2, "ttft_ms": 100.0, "decode_tokens": 1, "decode_s": 0.1, "tokens_per_second": 10.0,
             "peak_rss_mb": 1800.0},
            {"system": "ort-genai", "dataset": "humaneval", "index": 0, "key": "humaneval[0]", "token_ids": [1, 3],
             "new_tokens": 2, "ttft_ms": 100.0, "decode_tokens": 1, "decode_s": 0.05, "tokens_per_second": 20.0,
             "peak_rss_mb": 1500.0}]
    names = ["llama-cpp", "ort-genai"]
    report.add_correctness(rows)
    result = {"settings": {"systems": names, "datasets": ["humaneval"], "target_name": "tgt", "draft_name": "drf",
                           "engine": None, "n": 1, "max_new_tokens": 2, "temperatures": [0.0], "seed": 0, "chunk": 4,
                           "threads": 2, "descriptions": {s: systems.SYSTEMS[s].description for s in names},
                           "peer_versions": {"llama_cpp_python": "0.3.36"}},
              "summary": report.summarize(rows, names, ["humaneval"]), "rows": rows,
              "workers": [{"system": "llama-cpp", "chunk": 0, "wall_s": 100.0, "cpu_s": 60.0, "loadavg": [3.5],
                           "load_s": 0.8, "model_bytes": 1_117_320_768},
                          {"system": "ort-genai", "chunk": 0, "wall_s": 10.0, "cpu_s": 18.0, "loadavg": [2.0],
                           "load_s": 1.2, "model_bytes": 1_915_806_236}],
              "prompt_check": {"n": 1, "all_identical": True, "mismatched": [], "hf_only": True}}
    rep = report.render_report(result)
    assert "| llama-cpp | 0 | 100 | 30% | 3.50 |  |" in rep and "| ort-genai | 0 | 10 | 90% | 2.00 |  |" in rep
    assert "**1 of 2 workers ran with under 60% CPU use** (llama-cpp)" in rep
    assert "from the HF chat template for all 1 prompts" in rep
    assert "Peers: llama_cpp_python 0.3.36" in rep
    line = next(l for l in rep.splitlines() if l.startswith("| llama-cpp | 1 |"))
    assert line.endswith("| 1.76 | 0.8 | 1.12 |")  # peak RSS GB, load s, model GB
    assert "- `ort-genai`: ONNX Runtime GenAI, int4 graph" in rep


def test_peers_run_greedy_only(capsys):
    with pytest.raises(SystemExit):
        run.main(["--systems", "hf,llama-cpp", "--temperature", "0,1", "--sampled-systems", "hf,llama-cpp"])
    assert "the peers ['llama-cpp'] run greedy only" in capsys.readouterr().err
