"""The manifest's ``speculation`` section as a typed schema (dspark_runtime.engine_dir.manifest.Speculation, DSparkSection):
round trips (existing manifests unchanged, unknown keys kept), validation errors naming the key and the fix, and
the writers' attribute access (profile, quantize, build)."""
import copy
import json
from pathlib import Path

import pytest

from dspark_runtime.errors import ManifestError
from dspark_runtime.engine_dir.manifest import parse_manifest
from dspark_runtime.engine_dir.speculation import DSparkSection, Speculation

ROOT = Path(__file__).resolve().parents[3]

# the speculation section of engines/qwen2.5-coder-1.5b (router and tables shortened): a draft LM ("draft") with
# a DSpark drafter beside it ("dspark"), router priors, a cost table and a row padding probe
QWEN = {
    "draft_graph": "draft", "draft_length": 3,
    "router": {"ngram": {"edges": [1, 2, 3, 4, 8, 16], "hits": [[141.0, 68.0]], "tries": [[654.0, 139.0]],
                         "anchors": 2048, "matched": 1281},
               "inner": {"dspark": {"hits": [[360.0, 77.0]], "tries": [[1487.0, 360.0]]}},
               "fitted_on": "calibration split", "sequences": 16, "gamma": 7},
    "dspark": {"graph": "dspark", "heads_file": "dspark_heads.npz", "markov_rank": 64, "markov_head_type": "vanilla",
               "confidence_head": True, "confidence_head_with_markov": True, "block_size": 7,
               "mask_token_id": 151648, "target_layer_ids": [1, 13, 25], "draft_vocab_size": 16384,
               "sts_temperatures": [0.985, 0.847, 0.59, 1.643, 0.822, 0.05, 0.058]},
    "cost_table": {"tokens": [1, 2, 3], "seconds": [0.1, 0.11, 0.12], "t_draft": 0.016, "drafter": "dspark",
                   "cpu": {"model": "AMD EPYC", "flags": ["avx2"]}, "threads": 2},
    "row_invariance": {"row_multiple": 2, "backend": "ort", "target_sha256": "deb5", "threads": 2},
}

# a freshly built DSpark-only engine before calibration: nulls where the build had no value
BUILT = {"draft_graph": "draft", "draft_length": 4, "draft_kind": "dspark",
         "dspark": {"graph": "draft", "heads_file": "dspark_heads.npz", "markov_rank": 16,
                    "markov_head_type": "vanilla", "confidence_head": True, "confidence_head_with_markov": False,
                    "block_size": 4, "mask_token_id": 199, "target_layer_ids": [-1, 0], "draft_vocab_size": None,
                    "sts_temperatures": None}}


def dumped(d) -> str:
    return json.dumps(d, indent=2)


@pytest.mark.parametrize("d", [QWEN, BUILT, {}, {"draft_graph": None, "draft_length": 5}], ids=["qwen", "built",
                                                                                                  "empty", "no-draft"])
def test_round_trip_is_unchanged(d):
    """Read and written back: the same dict, keys in the same order (the manifest's text does not change)."""
    s = Speculation.from_json(copy.deepcopy(d))
    assert s.to_json() == d and dumped(s.to_json()) == dumped(d)
    assert Speculation.from_json(s.to_json()) == s


def test_typed_fields():
    s = Speculation.from_json(copy.deepcopy(QWEN))
    assert (s.draft_graph, s.draft_kind, s.draft_length) == ("draft", None, 3)
    assert isinstance(s.dspark, DSparkSection) and s.dspark.graph == "dspark" and s.dspark.block_size == 7
    assert s.dspark.target_layer_ids == [1, 13, 25] and s.dspark.markov_rank == 64
    assert s.dspark.confidence_head is True and s.dspark.calibration is None and s.dspark.extra == {}
    assert s.router["sequences"] == 16 and s.cost_table["threads"] == 2 and s.row_invariance["row_multiple"] == 2
    assert s.extra == {}


@pytest.mark.parametrize("name", ["qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-int4", "qwen2.5-coder-1.5b-fp32",
                                  "qwen2.5-coder-1.5b-growing", "qwen2.5-coder-1.5b-int4rtn"])
def test_real_engine_manifests_round_trip(name):
    p = ROOT / "engines" / name / "manifest.json"
    if not p.is_file():
        pytest.skip(f"{p} not built here")
    d = json.loads(p.read_text())
    s = Speculation.from_json(copy.deepcopy(d["speculation"]))
    assert s.to_json() == d["speculation"] and dumped(s.to_json()) == dumped(d["speculation"])
    m = parse_manifest(copy.deepcopy(d), str(p))
    assert m.to_json()["speculation"] == d["speculation"]


def test_unknown_keys_are_kept_in_extra_and_written_back():
    d = copy.deepcopy(BUILT)
    d["future_drafter"] = {"kind": "eagle", "layers": [3]}
    d["dspark"]["tree_width"] = 4
    d["dspark"]["calibration"] = {"rounds": 12, "ece": [{"position": 1, "ece_before": 0.2, "ece_after": 0.1}]}
    s = Speculation.from_json(copy.deepcopy(d))
    assert s.extra == {"future_drafter": {"kind": "eagle", "layers": [3]}}
    assert s.dspark.extra == {"tree_width": 4} and s.dspark.calibration["rounds"] == 12
    assert s.to_json() == d and dumped(s.to_json()) == dumped(d)
    s.cost_table = {"tokens": [1], "seconds": [0.1]}  # a writer adds a key: the unknown ones stay
    out = s.to_json()
    assert out["future_drafter"] == d["future_drafter"] and out["dspark"]["tree_width"] == 4
    assert list(out)[-1] == "cost_table"  # new keys after the ones read


def test_to_json_writes_only_what_is_set():
    assert Speculation().to_json() == {}
    s = Speculation(draft_graph=None, draft_length=5)
    assert s.to_json() == {"draft_length": 5}
    ds = DSparkSection(graph="draft", heads_file="h.npz", block_size=4, mask_token_id=1, target_layer_ids=[0])
    s.dspark = ds
    assert s.to_json()["dspark"] == {"graph": "draft", "heads_file": "h.npz", "block_size": 4, "mask_token_id": 1,
                                     "target_layer_ids": [0]}
    ds.sts_temperatures = [1.0, 0.5]
    assert s.to_json()["dspark"]["sts_temperatures"] == [1.0, 0.5]


def test_clearing_a_field_drops_its_key():
    """quantize drops the profile's records (measured on the source graphs) by setting them to None."""
    s = Speculation.from_json(copy.deepcopy(QWEN))
    s.cost_table = s.row_invariance = None
    out = s.to_json()
    assert "cost_table" not in out and "row_invariance" not in out and out["router"] == QWEN["router"]
    # a key that was null when read stays null (the file keeps its shape); one set on the object is written
    b = Speculation.from_json(copy.deepcopy(BUILT))
    assert b.to_json()["dspark"]["sts_temperatures"] is None
    b.dspark.sts_temperatures = [1.0] * 4
    assert b.to_json()["dspark"]["sts_temperatures"] == [1.0] * 4


BAD = [
    ({"draft_length": "x"}, "speculation.draft_length must be a positive integer, got 'x'"),
    ({"draft_length": 0}, "speculation.draft_length must be a positive integer, got 0"),
    ({"draft_length": True}, "speculation.draft_length must be a positive integer, got True"),
    ({"draft_length": 2.5}, "speculation.draft_length must be a positive integer"),
    ({"draft_graph": 3}, "speculation.draft_graph must be a non-empty string, got 3"),
    ({"draft_kind": "eagle"}, "speculation.draft_kind must be 'dspark' or 'lm', got 'eagle'"),
    ({"router": [1, 2]}, "speculation.router must be an object"),
    ({"cost_table": "fast"}, "speculation.cost_table must be an object"),
    ({"row_invariance": 2}, "speculation.row_invariance must be an object"),
    ({"dspark": "draft"}, "speculation.dspark must be an object"),
]


def _without(key):
    d = copy.deepcopy(BUILT)
    del d["dspark"][key]
    return d


def _with(key, value):
    d = copy.deepcopy(BUILT)
    d["dspark"][key] = value
    return d


BAD_DSPARK = [
    (_without("graph"), "speculation.dspark.graph is missing"),
    (_without("heads_file"), "speculation.dspark.heads_file is missing"),
    (_without("block_size"), "speculation.dspark.block_size is missing"),
    (_without("mask_token_id"), "speculation.dspark.mask_token_id is missing"),
    (_without("target_layer_ids"), "speculation.dspark.target_layer_ids is missing"),
    (_with("graph", None), "speculation.dspark.graph is missing"),
    (_with("block_size", "7"), "speculation.dspark.block_size must be a positive integer, got '7'"),
    (_with("block_size", -1), "speculation.dspark.block_size must be a positive integer, got -1"),
    (_with("heads_file", ""), "speculation.dspark.heads_file must be a non-empty string"),
    (_with("target_layer_ids", "1,13,25"), "speculation.dspark.target_layer_ids must be a list of integers"),
    (_with("target_layer_ids", [1, 1.5]), "speculation.dspark.target_layer_ids must be a list of integers"),
    (_with("mask_token_id", -3), "speculation.dspark.mask_token_id must be a non-negative integer"),
    (_with("markov_rank", "64"), "speculation.dspark.markov_rank must be a non-negative integer"),
    (_with("markov_head_type", 1), "speculation.dspark.markov_head_type must be a string"),
    (_with("confidence_head", 1), "speculation.dspark.confidence_head must be true or false, got 1"),
    (_with("draft_vocab_size", 0), "speculation.dspark.draft_vocab_size must be a positive integer"),
    (_with("sts_temperatures", [1.0, 0.0]), "speculation.dspark.sts_temperatures must be a list of positive numbers"),
    (_with("sts_temperatures", 1.0), "speculation.dspark.sts_temperatures must be a list of positive numbers"),
    (_with("calibration", [1]), "speculation.dspark.calibration must be an object"),
]


@pytest.mark.parametrize("d,msg", BAD + BAD_DSPARK)
def test_validation_names_the_key_and_the_fix(d, msg):
    with pytest.raises(ManifestError) as e:
        Speculation.from_json(d)
    assert msg in str(e.value) and "rebuild the engine or fix manifest.json" in str(e.value)


def test_speculation_must_be_an_object():
    with pytest.raises(ManifestError, match="speculation must be an object, got"):
        Speculation.from_json([1])
    assert Speculation.from_json(None) == Speculation()


def test_parse_manifest_uses_the_schema_and_names_the_file(tiny_engine_dir):
    d = json.loads((tiny_engine_dir / "manifest.json").read_text())
    d["speculation"] = copy.deepcopy(BUILT)
    m = parse_manifest(copy.deepcopy(d), "engines/x/manifest.json")
    assert isinstance(m.speculation, Speculation) and m.speculation.dspark.block_size == 4
    assert m.to_json()["speculation"] == BUILT
    d["speculation"]["draft_length"] = "x"
    with pytest.raises(ManifestError, match=r"^engines/x/manifest.json: speculation.draft_length must be a positive "
                                            r"integer, got 'x'; rebuild the engine or fix manifest.json$"):
        parse_manifest(d, "engines/x/manifest.json")
    del d["speculation"]  # an engine without the section: an empty one
    assert parse_manifest(d).speculation == Speculation()


def test_load_manifest_refuses_a_bad_speculation_section(tiny_engine_dir, tmp_path):
    import shutil

    from dspark_runtime.engine_dir.manifest import load_manifest

    d = tmp_path / "e"
    shutil.copytree(tiny_engine_dir, d)
    raw = json.loads((d / "manifest.json").read_text())
    raw["speculation"]["draft_length"] = "x"
    (d / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ManifestError, match="speculation.draft_length must be a positive integer, got 'x'"):
        load_manifest(d, verify=False)


def test_writers_use_attributes(tiny_engine_dir, tmp_path):
    """profile's _store sets fields by name; the manifest written back keeps every other key."""
    import shutil

    from dspark_export.fit.cost_profile import _store
    from dspark_runtime.engine_dir.manifest import load_manifest

    d = tmp_path / "e"
    shutil.copytree(tiny_engine_dir, d)
    raw = json.loads((d / "manifest.json").read_text())
    raw["speculation"]["future"] = {"x": 1}
    (d / "manifest.json").write_text(json.dumps(raw, indent=2) + "\n")
    _store(d, {"cost_table": {"tokens": [1], "seconds": [0.1]}, "row_invariance": {"row_multiple": 1}})
    m = load_manifest(d, verify=False)
    assert m.speculation.cost_table == {"tokens": [1], "seconds": [0.1]}
    assert m.speculation.row_invariance == {"row_multiple": 1} and m.speculation.extra == {"future": {"x": 1}}
    after = json.loads((d / "manifest.json").read_text())["speculation"]
    assert {k: v for k, v in after.items() if k not in ("cost_table", "row_invariance")} == raw["speculation"]
