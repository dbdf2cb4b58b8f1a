"""benchmarks.step_profile groups ONNX Runtime's node profile of a real (tiny) engine graph."""
import json

import pytest

from benchmarks import step_profile


def test_step_profile_groups_the_nodes_of_one_step(tiny_engine_dir, tmp_path):
    sp = step_profile
    out = tmp_path / "p.json"
    assert sp.main(["--engine", str(tiny_engine_dir), "--past", "8,32", "--q", "1,4", "--repeats", "2",
                    "--threads", "1", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert [(r["past"], r["q"]) for r in rep["rows"]] == [(8, 1), (8, 4), (32, 1), (32, 4)]
    for r in rep["rows"]:
        cats = r["by_category_ms"]
        # the tiny graph has 2 layers x 7 weight MatMuls, the LM head, attention and the growing-KV Concats
        assert {"weight matmul", "lm_head", "attention matmul", "Concat (KV copies)"} <= set(cats)
        assert all(v >= 0 for v in cats.values())
        assert 0 < r["profiled_nodes_ms"] <= r["profiled_wall_ms"] + 0.5 and r["wall_ms"] > 0
        assert abs(sum(r["by_category_share"].values()) - 1) < 0.01


def test_against_times_two_engines_alternately(tiny_engine_dir, tmp_path):
    """--against: both engines' target steps timed in one process (a subprocess here: the shared thread pool is
    process-wide), one row per (past, q) with a positive median for each engine."""
    import subprocess
    import sys

    from benchmarks.evalsets import ROOT, child_env

    out = tmp_path / "ab.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.step_profile", "--engine", str(tiny_engine_dir), "--against",
                        str(tiny_engine_dir), "--past", "8,32", "--q", "2", "--repeats", "2", "--threads", "1",
                        "--json", str(out)], capture_output=True, text=True, timeout=300,
                       cwd=str(ROOT), env=child_env())
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    assert [(row["past"], row["q"]) for row in rep["rows"]] == [(8, 2), (32, 2)]
    assert all(len(row["ms"]) == 2 and all(v > 0 for v in row["ms"]) for row in rep["rows"])
    assert rep["engines"] == [str(tiny_engine_dir)] * 2
    assert rep["load_orders"] == [[0, 1], [1, 0]]  # the default: each rotation of the load order, its own process
    assert all(len(row["ms_by_load_order"]) == 2 for row in rep["rows"])
    assert "change" in r.stdout and "2 load orders" in r.stdout


def test_feeds_say_which_positions_the_lm_head_runs_on(tiny_scatter_engine_dir):
    """A scatter graph's head range: every position by default, the last with --last-logits, the real positions with
    --padding-rows (at least one)."""
    from dspark_runtime.engine_dir.manifest import load_manifest

    spec = load_manifest(tiny_scatter_engine_dir, verify=False).graphs["target"].spec
    head = lambda **kw: [int(step_profile._feeds(spec, 8, 4, **kw)[n][0]) for n in ("logits_from", "logits_to")]  # noqa: E731
    assert head() == [0, 4]
    assert head(last_logits=True) == [3, 4]
    assert head(padding_rows=1) == [0, 3]
    assert head(padding_rows=9) == [0, 1]


def test_the_profile_times_the_head_range_asked_for(tiny_scatter_engine_dir, monkeypatch):
    """The per-node profile (no --against) feeds the head range --last-logits / --padding-rows ask for, as --against
    does: a prompt chunk's profile must not time the LM head on every position."""
    asked = []
    feeds = step_profile._feeds

    def recording(spec, past, q, **kw):
        asked.append(kw)
        return feeds(spec, past, q, **kw)

    monkeypatch.setattr(step_profile, "_feeds", recording)
    assert step_profile.main(["--engine", str(tiny_scatter_engine_dir), "--past", "8", "--q", "4", "--repeats", "1",
                              "--threads", "1", "--last-logits"]) == 0
    assert asked and all(kw.get("last_logits") is True for kw in asked)
    asked.clear()
    assert step_profile.main(["--engine", str(tiny_scatter_engine_dir), "--past", "8", "--q", "4", "--repeats", "1",
                              "--threads", "1", "--padding-rows", "1"]) == 0
    assert asked and all(kw.get("padding_rows") == 1 and not kw.get("last_logits") for kw in asked)


def test_load_orders_combine_each_engines_figure_across_rotations():
    """--against runs once per rotation of the load order; each engine's figure is the geometric mean of its own
    medians, mapped back from the position it was loaded in."""
    runs = [([0, 1], [{"past": 8, "q": 1, "ms": [40.0, 30.0]}]),   # engine 0 loaded first
            ([1, 0], [{"past": 8, "q": 1, "ms": [36.0, 20.0]}])]   # engine 1 loaded first: ms in load order
    (row,) = step_profile.combine_load_orders(runs)
    assert row["ms_by_load_order"] == [[40.0, 30.0], [20.0, 36.0]]
    assert row["ms"] == [round((40.0 * 20.0) ** 0.5, 2), round((30.0 * 36.0) ** 0.5, 2)]
    with pytest.raises(ValueError, match="different"):
        step_profile.combine_load_orders([runs[0], ([1, 0], [{"past": 8, "q": 2, "ms": [1.0, 1.0]}])])


def test_against_refuses_a_directory_that_is_not_an_engine(tiny_engine_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        step_profile.main(["--engine", str(tiny_engine_dir), "--against", str(tmp_path / "nope"), "--q", "1"])
    assert e.value.code == 2
    assert "not an engine directory (no manifest.json)" in capsys.readouterr().err


def test_against_times_an_engine_with_its_weights_on_base_pages(tiny_engine_dir, tmp_path):
    """--against DIR::small-pages: the same graph loaded without huge pages, timed beside the engine as loaded."""
    import subprocess
    import sys

    from benchmarks.evalsets import ROOT, child_env

    out = tmp_path / "pages.json"
    small = f"{tiny_engine_dir}::small-pages"
    r = subprocess.run([sys.executable, "-m", "benchmarks.step_profile", "--engine", str(tiny_engine_dir), "--against",
                        small, "--past", "8", "--q", "1", "--repeats", "2", "--threads", "1", "--load-orders", "given",
                        "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=str(ROOT),
                       env=child_env())
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    assert rep["engines"] == [str(tiny_engine_dir), small]
    assert len(rep["rows"]) == 1 and len(rep["rows"][0]["ms"]) == 2 and min(rep["rows"][0]["ms"]) > 0
