"""Manifest checks and the CLIs' handling of bad input: clear one-line errors, exit 2, no traceback."""
import json
import shutil
import subprocess
import sys

import pytest

from dspark_runtime.errors import ManifestError
from dspark_runtime.engine_dir.manifest import VERIFIED_NAME, load_manifest

pytest.importorskip("torch")


def run_cli(module, *args):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300)


@pytest.fixture()
def engine_copy(tiny_engine_dir, tmp_path):
    dst = tmp_path / "eng"
    shutil.copytree(tiny_engine_dir, dst)
    return dst


def test_manifest_round_trip_and_specs(tiny_engine_dir):
    m = load_manifest(tiny_engine_dir)
    assert m.schema_version == 1 and set(m.graphs) == {"target", "draft"}
    t = m.graphs["target"]
    assert t.spec.dims.feature_layers == (-1, 0)
    assert t.spec.output_names[:2] == ["logits", "features"]
    assert "features" not in m.graphs["draft"].spec.output_names
    assert t.validation["fp32"]["verify_argmax_agreement"] == 1.0
    assert t.validation["fp32"]["prefill_max_abs_logit_diff"] < 1e-4
    assert m.speculation.to_json() == {"draft_graph": "draft", "draft_length": 4}
    assert m.speculation.draft_graph == "draft" and m.speculation.draft_length == 4 and m.speculation.dspark is None
    assert m.tokenizer["eos_token_ids"] == [2]


def test_corrupted_graph_is_refused(engine_copy):
    data = engine_copy / "target.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF  # same size, different content
    data.write_bytes(bytes(raw))
    # size+mtime trust would skip the hash only if the mtime were unchanged; rehash always checks
    with pytest.raises(ManifestError, match="corrupted: sha256"):
        load_manifest(engine_copy, rehash=True)
    assert not (engine_copy / VERIFIED_NAME).exists()  # trusted hashes live in the user's cache
    with pytest.raises(ManifestError, match="target.onnx.data is corrupted"):
        load_manifest(engine_copy)
    r = run_cli("dspark_runtime.cli", "verify", "--engine", str(engine_copy))
    assert r.returncode == 2 and "corrupted" in r.stderr and "Traceback" not in r.stderr


def test_truncated_graph_is_refused(engine_copy):
    data = engine_copy / "draft.onnx.data"
    data.write_bytes(data.read_bytes()[:-10])
    with pytest.raises(ManifestError, match="truncated or corrupted"):
        load_manifest(engine_copy)


def test_unknown_manifest_version(engine_copy):
    mp = engine_copy / "manifest.json"
    d = json.loads(mp.read_text())
    d["schema_version"] = 99
    mp.write_text(json.dumps(d))
    r = run_cli("dspark_runtime.cli", "generate", "--engine", str(engine_copy), "--prompt", "hi")
    assert r.returncode == 2
    assert "schema_version 99" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args, message", [
    (["--prompt", ""], "prompt is empty"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens must be a positive integer"),
    (["--prompt", "hi", "--temperature", "-0.5"], "temperature"),
    (["--prompt", "hi", "--draft-length", "many"], "--draft-length must be an integer, 'auto' or 'scheduled'"),
])
def test_cli_bad_arguments(tiny_engine_dir, args, message):
    r = run_cli("dspark_runtime.cli", "generate", "--engine", str(tiny_engine_dir), *args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


def test_cli_recipe_instead_of_engine_and_bad_threads(tiny_engine_dir, tmp_path):
    recipe = tmp_path / "r.json"
    recipe.write_text("{}")
    r = run_cli("dspark_runtime.cli", "generate", "--engine", str(recipe), "--prompt", "hi")
    assert r.returncode == 2 and "a build recipe?" in r.stderr and "dspark-export build" in r.stderr
    r = run_cli("dspark_runtime.cli", "generate", "--engine", str(tiny_engine_dir), "--prompt", "hi", "--threads", "0")
    assert r.returncode == 2 and "threads must be a positive integer" in r.stderr


def test_cli_info_is_readable(tiny_engine_dir):
    r = run_cli("dspark_runtime.cli", "info", "--engine", str(tiny_engine_dir))
    assert r.returncode == 0
    assert "validation fp32: max |dlogits| prefill" in r.stdout and "default draft length 4" in r.stdout


def test_cli_info_reads_validation_of_older_manifests(tiny_engine_dir, tmp_path):
    """Engines built before validation was keyed by precision hold one flat report per graph."""
    import json
    import shutil

    d = tmp_path / "old"
    shutil.copytree(tiny_engine_dir, d)
    m = json.loads((d / "manifest.json").read_text())
    m["graphs"]["target"]["validation"] = m["graphs"]["target"]["validation"]["fp32"]
    (d / "manifest.json").write_text(json.dumps(m))
    r = run_cli("dspark_runtime.cli", "info", "--engine", str(d))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("validation fp32: max |dlogits| prefill") == 2  # the flat target report and the draft's


def test_cli_missing_engine_dir(tmp_path):
    r = run_cli("dspark_runtime.cli", "generate", "--engine", str(tmp_path / "nope"), "--prompt", "hi")
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("dspark_runtime.cli", "generate", "--engine", str(tmp_path), "--prompt", "hi")
    assert r.returncode == 2 and "no manifest.json" in r.stderr


def test_cli_generate_json_speculative_equals_target_only(tiny_engine_dir):
    common = ["generate", "--engine", str(tiny_engine_dir), "--prompt", "def add(a, b):",
              "--max-new-tokens", "24", "--json"]
    a = run_cli("dspark_runtime.cli", *common)
    b = run_cli("dspark_runtime.cli", *common, "--no-speculation")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    ja, jb = json.loads(a.stdout), json.loads(b.stdout)
    assert ja["token_ids"] == jb["token_ids"] and len(ja["token_ids"]) > 0
    for key in ("accepted_length_mean", "acceptance_rate", "tokens_per_second", "num_rounds", "ttft_ms", "total_ms"):
        assert key in ja["stats"]
    assert ja["stats"]["accepted_length_mean"] > 1.0
    assert jb["stats"]["num_rounds"] == len(jb["token_ids"]) - 1


def test_export_cli_errors(tmp_path):
    r = run_cli("dspark_export.cli", "build", "--target", str(tmp_path / "missing-model"))
    assert r.returncode == 2 and "neither a model folder nor a known model" in r.stderr
    r = run_cli("dspark_export.cli", "build", str(tmp_path / "nope.json"))
    assert r.returncode == 2 and "recipe" in r.stderr and "Traceback" not in r.stderr


def test_fetch_cli_unknown_model_and_list(tmp_path):
    import os

    env = {**os.environ, "DSPARK_CACHE": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "dspark_export.cli", "fetch", "--force", "no-such-model"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "no-such-model" in r.stderr and "qwen2.5-coder-1.5b-instruct" in r.stderr
    assert "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "dspark_export.cli", "list-models"], capture_output=True, text=True,
                       env=env)
    assert r.returncode == 0 and "smollm2-135m-instruct" in r.stdout and "fetched" not in r.stdout


def test_runtime_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import dspark_runtime, dspark_runtime.engine, dspark_runtime.cli\n"
            "print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
