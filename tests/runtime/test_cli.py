"""Issue 18: CLI messages that say what happened — an --engine / ENGINE_DIR that is a file, what `dspark info`
says `--draft auto` runs and whether the engine has a cost table and router priors, and skip reasons in the
test summary."""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(main, argv, capsys):
    """Run a console entry point in this process: (exit status, stdout, stderr)."""
    try:
        main(argv)
        rc = 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture()
def a_file(tmp_path):
    f = tmp_path / "README.md"
    f.write_text("# not an engine\n")
    return f


@pytest.mark.parametrize("argv", [["generate", "--prompt", "hi", "--engine"], ["info", "--engine"],
                                  ["verify", "--engine"], ["serve", "--engine"]])
def test_dspark_engine_that_is_a_file(argv, a_file, capsys):
    from dspark_runtime.cli import main

    rc, _, err = _run(main, argv + [str(a_file)], capsys)
    assert rc == 2, err
    assert "is a file, not an engine directory" in err and "does not exist" not in err, err
    assert "Traceback" not in err and "dspark-export build" in err  # says how to get an engine directory


@pytest.mark.parametrize("argv", [["build-trt"], ["add-draft", "{f}", "{f}", "--target", "x"], ["calibrate"],
                                  ["profile"], ["pack"], ["quantize", "-o", "{tmp}/q", "--precision", "int8"],
                                  ["calibrate-quant", "-o", "{tmp}/t.json"], ["compare", "{f}", "{f}"]])
def test_dspark_export_engine_dir_that_is_a_file(argv, a_file, tmp_path, capsys):
    from dspark_export.cli import main

    args = [a.format(f=a_file, tmp=tmp_path) for a in argv]
    if "{f}" not in argv:
        args.insert(1, str(a_file))
    rc, _, err = _run(main, args, capsys)
    assert rc == 2, err
    assert "is a file, not an engine directory" in err and "does not exist" not in err, err


def test_engine_that_is_a_recipe_or_a_tarball(tmp_path, capsys):
    """A recipe keeps its hint (build it); a tarball given where a directory is needed says `dspark unpack`;
    `generate` still takes a tarball (it unpacks it itself)."""
    from dspark_runtime.cli import main

    recipe = tmp_path / "r.json"
    recipe.write_text("{}")
    rc, _, err = _run(main, ["info", "--engine", str(recipe)], capsys)
    assert rc == 2 and "is a file" in err and "a build recipe?" in err and f"dspark-export build {recipe}" in err
    tar = tmp_path / "e.tar.gz"
    tar.write_bytes(b"not a tarball")
    rc, _, err = _run(main, ["info", "--engine", str(tar)], capsys)
    assert rc == 2 and "engine tarball" in err and "dspark unpack" in err, err
    rc, _, err = _run(main, ["generate", "--engine", str(tar), "--prompt", "hi"], capsys)
    assert rc == 2 and "is a file, not an engine directory" not in err, err


def _manifest_variant(src: Path, dst: Path, edit) -> Path:
    """``dst`` holding only a copy of ``src``'s manifest.json, edited by ``edit(dict)`` (info reads no graph file)."""
    m = json.loads((src / "manifest.json").read_text())
    edit(m)
    dst.mkdir(parents=True)
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def test_info_says_what_auto_runs_lm_engine(tiny_engine_dir, capsys):
    """The tiny engine has a draft LM: auto = the LM at the manifest's draft length (as Engine.auto_draft);
    no router priors, no cost table — said so."""
    from dspark_runtime.cli import main
    from dspark_runtime.engine import Engine

    assert Engine.load(tiny_engine_dir).auto_draft() == "lm"
    rc, out, err = _run(main, ["info", "--engine", str(tiny_engine_dir)], capsys)
    assert rc == 0, err
    auto = next(l for l in out.splitlines() if "--draft auto" in l)
    assert "draft LM" in auto and "default draft length 4" in auto, out
    assert "router priors: none" in out and "cost table: none" in out, out


def test_info_says_what_auto_runs_dspark_engine(tiny_engine_dir, tmp_path, capsys):
    """An engine whose only drafter is a DSpark drafter: auto = the router, drafting DSpark blocks of block_size
    tokens (not the manifest's draft_length); router priors and cost table reported as present."""
    from dspark_runtime.cli import main

    def dspark_only(m, priors=True, cost=True):
        g = m["graphs"].pop("draft")
        g["spec"]["kind"] = "dspark_draft"
        m["graphs"]["dspark"] = g
        sp = m["speculation"]
        sp.update(draft_graph="dspark", draft_length=4,
                  dspark={"graph": "dspark", "heads_file": "dspark_heads.npz", "block_size": 7, "mask_token_id": 3,
                          "markov_rank": 64, "target_layer_ids": [1]})
        if priors:
            sp["router"] = {"ngram": {"edges": [1, 2], "hits": [[1]], "tries": [[2]]},
                            "inner": {"dspark": {"hits": [3], "tries": [4]}}, "sequences": 12,
                            "fitted_on": "calibration split", "gamma": 7}
        if cost:
            sp["cost_table"] = {"tokens": [1, 2, 8], "t_draft": 0.01, "t_verify": [0.02, 0.02, 0.03],
                                "machine": "test", "threads": 2}

    d = _manifest_variant(tiny_engine_dir, tmp_path / "ds", dspark_only)
    rc, out, err = _run(main, ["info", "--engine", str(d)], capsys)
    assert rc == 0, err
    auto = next(l for l in out.splitlines() if "--draft auto" in l)
    assert "router" in auto and "7" in auto and "default draft length" not in auto, out
    assert "router priors: fitted" in out and "12 sequences" in out, out
    assert "cost table: verify B = 1..8" in out, out

    d2 = _manifest_variant(tiny_engine_dir, tmp_path / "ds2", lambda m: dspark_only(m, priors=False, cost=False))
    rc, out, err = _run(main, ["info", "--engine", str(d2)], capsys)
    assert rc == 0, err
    assert "router priors: none" in out and "dspark-export calibrate" in out, out
    assert "cost table: none" in out, out

    # calibrated (STS temperatures) and profiled: auto schedules the router's verify lengths
    def calibrated(m):
        dspark_only(m)
        m["speculation"]["dspark"]["sts_temperatures"] = [1.0, 1.2, 1.5, 2.0, 2.0, 2.0, 2.0]

    d3 = _manifest_variant(tiny_engine_dir, tmp_path / "ds3", calibrated)
    rc, out, err = _run(main, ["info", "--engine", str(d3)], capsys)
    assert rc == 0, err
    auto = next(l for l in out.splitlines() if "--draft auto" in l)
    assert "router" in auto and "scheduled from the calibrated survivals" in auto, out


def test_auto_prefers_the_router_over_a_calibrated_dspark_drafter():
    """auto_draft_choice: the router over a DSpark drafter that can schedule (calibrated, profiled) comes before a
    draft LM; an uncalibrated DSpark drafter does not (the LM, else the router's fixed blocks); else n-gram."""
    from dspark_runtime.engine_dir.speculation import auto_draft_choice

    assert auto_draft_choice("draft", "dspark", True) == "router"
    assert auto_draft_choice("draft", "dspark", False) == "lm"
    assert auto_draft_choice("draft", None, True) == "lm"
    assert auto_draft_choice(None, "dspark", False) == "router"
    assert auto_draft_choice(None, None, True) == "ngram"


def test_info_no_drafter(tiny_engine_dir, tmp_path, capsys):
    from dspark_runtime.cli import main

    def no_draft(m):
        m["graphs"].pop("draft")
        m["speculation"]["draft_graph"] = None

    d = _manifest_variant(tiny_engine_dir, tmp_path / "nd", no_draft)
    rc, out, err = _run(main, ["info", "--engine", str(d)], capsys)
    assert rc == 0, err
    auto = next(l for l in out.splitlines() if "--draft auto" in l)
    assert "n-gram" in auto, out


def test_pytest_reports_skip_reasons():
    """`pytest -q` (README command 2, .ci/run) lists why each test skipped: -rs in the configured addopts."""
    opts = re.search(r'^addopts\s*=\s*"(.*)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert any(o.startswith("-r") and "s" in o[2:] for o in opts.split()), opts


def test_generate_json_schema_penalties_and_logprobs(tiny_engine_dir, tmp_path, capsys):
    """`dspark generate --json-schema FILE` gives JSON that satisfies the schema, the same with and without
    speculation; --logprobs puts one entry per token in --json; a schema file that is not a JSON object is refused
    by name."""
    pytest.importorskip("llguidance")
    from dspark_runtime.cli import main

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    f = tmp_path / "answer.json"
    f.write_text(json.dumps(schema))
    base = ["generate", "--engine", str(tiny_engine_dir), "--prompt", "hi", "--json-schema", str(f), "--json",
            "--max-new-tokens", "40", "--logprobs", "2", "--presence-penalty", "0.5"]
    outs = []
    for extra in (["--no-speculation"], ["--draft", "lm"]):
        rc, out, err = _run(main, base + extra, capsys)
        assert rc == 0, err
        res = json.loads(out)
        assert set(json.loads(res["text"])) == {"ok", "n"} and res["finish_reason"] == "eos"
        assert len(res["logprobs"]) == len(res["token_ids"]) and all(len(e["top"]) == 2 for e in res["logprobs"])
        outs.append(res["token_ids"])
    assert outs[0] == outs[1]
    f.write_text("[1, 2]")
    rc, out, err = _run(main, base, capsys)
    assert rc != 0 and "a JSON Schema is a JSON object" in err
