"""scripts/step_profile.py groups ONNX Runtime's node profile of a real (tiny) engine graph."""
import json

from script_loader import load_script


def test_step_profile_groups_the_nodes_of_one_step(tiny_engine_dir, tmp_path):
    sp = load_script("step_profile", "step_profile")
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
