"""EAGLE-3 drafters (issue 48): DeepSpec's checkpoint layout loaded by :mod:`dspark_export.drafter.eagle3`, and
parity of our torch model with DeepSpec's own decoding path.

The fixture (``tests/fixtures/data/deepspec_parity/eagle3/``, made by ``make_eagle3_fixtures.py`` beside it; its
README.md gives the DeepSpec commit and versions) is a tiny random-weight ``Qwen3Eagle3Model`` (hidden 32, one
layer, 4 heads / 2 KV heads of 8, vocab 97, five target layers fused, ``ttt_length`` 3) saved as DeepSpec's trainer
writes it (bf16), and ``reference.npz``: DeepSpec's evaluator steps (``_init_context``, ``_propose``, ``_update``;
fp32, sdpa, greedy) over two rounds on one draft cache — prompt positions 0..5 prefill the cache, round 1 drafts
from position 6, two drafts are accepted plus a bonus token (positions 6..8 extend the cache), round 2 drafts from
position 9. Recorded per round: the draft states the logits come from, the logits, the greedy drafts.

``python tests/export/drafter/test_eagle3.py`` prints the parity table.
"""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark_export.drafter.config import DraftConfigError
from dspark_export.drafter.eagle3 import Eagle3Cache, load_eagle3_checkpoint

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "data" / "deepspec_parity" / "eagle3"
# fp32 bounds. Observed: draft states <= 7.7e-6, logits <= 3.9e-6 (max |logit| ~17); DeepSpec's own eager run
# differs from its sdpa one by the same amounts.
TOL_HIDDEN, TOL_LOGITS = 2e-5, 5e-5


def reference():
    with np.load(FIXTURE / "reference.npz") as z:
        return {k: z[k] for k in z.files}


@torch.no_grad()
def torch_rounds(ref: dict) -> list:
    """Our model through the same decoding path: prefill, greedy round, extend by the verified positions, round."""
    m = load_eagle3_checkpoint(FIXTURE).eval()
    feats = torch.from_numpy(ref["features"])
    prompt = torch.from_numpy(ref["prompt"])[None]
    p, accept, bonus = prompt.shape[1], int(ref["accept"]), int(ref["bonus"])
    cache = Eagle3Cache()
    # the state at position i goes with token i + 1: the prompt's tokens 1.. and the target's first token
    ids = torch.cat([prompt[:, 1:], torch.tensor([[int(ref["first_token"])]])], dim=1)
    state = m.extend(feats[:, :p], ids, torch.arange(p)[None], cache)
    out, start = [], p
    for r in range(2):
        assert start == int(ref[f"r{r}_start"])
        h, lg, tok = m.greedy_draft(state, start, cache)
        out.append({"hidden": h[0].numpy(), "logits": lg[0].numpy(), "tokens": tok[0].numpy(),
                    "cache_len": len(cache)})
        committed = torch.cat([tok[:, :accept], torch.tensor([[bonus]])], dim=1)
        n = committed.shape[1]
        state = m.extend(feats[:, start:start + n], committed, torch.arange(start, start + n)[None], cache)
        start += n
    return out


def parity_rows(ref, ours) -> list:
    rows = []
    for r, o in enumerate(ours):
        rows.append((r, float(np.abs(o["hidden"] - ref[f"r{r}_hidden"]).max()),
                     float(np.abs(o["logits"] - ref[f"r{r}_logits"]).max()),
                     float(np.abs(ref[f"r{r}_logits"]).max()), o["tokens"].tolist(), ref[f"r{r}_tokens"].tolist()))
    return rows


def test_fixture_is_small_and_from_deepspec():
    total = sum(f.stat().st_size for f in FIXTURE.iterdir())
    assert total < 150_000
    meta = json.loads(str(reference()["meta"]))
    assert meta["transformers"] == "5.10.2" and meta["attn_implementation"] == "sdpa"


def test_strict_load_of_deepspec_checkpoint():
    m = load_eagle3_checkpoint(FIXTURE)
    c = m.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.vocab_size, c.ttt_length) == (32, 1, 4, 2, 8, 97, 3)
    assert c.target_layer_ids == [1, 2, 4, 5, 6] and m.fc.weight.shape == (32, 160)
    assert all(t.dtype == torch.float32 for t in m.state_dict().values())
    assert load_eagle3_checkpoint(FIXTURE, dtype=torch.bfloat16).lm_head.weight.dtype == torch.bfloat16


def test_parity_with_deepspec_decoding_path():
    ref = reference()
    ours = torch_rounds(ref)
    for r, dh, dl, scale, toks, ref_toks in parity_rows(ref, ours):
        assert dh <= TOL_HIDDEN, f"round {r}: draft states differ by {dh}"
        assert dl <= TOL_LOGITS, f"round {r}: logits differ by {dl} (scale {scale})"
        assert toks == ref_toks, f"round {r}: greedy drafts {toks} vs DeepSpec's {ref_toks}"
        assert ours[r]["cache_len"] == int(ref[f"r{r}_start"])  # the round's draft entries are dropped


def _copy(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, d)
    (d / "reference.npz").unlink()
    return d


def _add_tensors(d: Path, extra: dict):
    f = d / "model.safetensors"
    t = load_file(str(f))
    t.update(extra)
    save_file(t, str(f), metadata={"format": "pt"})


def test_refuses_the_specforge_vocabulary_map(tmp_path):
    d = _copy(tmp_path)
    _add_tensors(d, {"d2t": torch.zeros(64, dtype=torch.int64), "t2d": torch.ones(97, dtype=torch.bool)})
    with pytest.raises(DraftConfigError, match=r"d2t/t2d vocabulary map present.*full-vocabulary head. Not "
                                               r"supported yet"):
        load_eagle3_checkpoint(d)


def test_refuses_an_unknown_tensor(tmp_path):
    d = _copy(tmp_path)
    _add_tensors(d, {"layers.0.mlp.gate_proj.bias": torch.zeros(48)})
    with pytest.raises(DraftConfigError, match=r"layers\.0\.mlp\.gate_proj\.bias.*not part of"):
        load_eagle3_checkpoint(d)


def test_refuses_a_missing_or_misshaped_tensor(tmp_path):
    d = _copy(tmp_path)
    t = load_file(str(d / "model.safetensors"))
    t["fc.weight"] = t["fc.weight"][:, :96].contiguous()
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(DraftConfigError, match=r"'fc.weight' has shape \(32, 96\)"):
        load_eagle3_checkpoint(d)
    del t["fc.weight"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(DraftConfigError, match=r"lacks tensor\(s\) \['fc.weight'\]"):
        load_eagle3_checkpoint(d)


def _with_config(tmp_path: Path, **change) -> Path:
    d = _copy(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("change, message", [
    ({"eagle_mystery_knob": 3}, r"config field 'eagle_mystery_knob' = 3 .*not implemented"),
    ({"draft_vocab_size": 64}, r"'draft_vocab_size' = 64: a reduced draft vocabulary .*full-vocabulary lm_head"),
    ({"architectures": ["Gemma4Eagle3Model"]}, r"Gemma4Eagle3Model.*not implemented yet"),
    ({"architectures": ["Qwen3DSparkModel"]}, r"not DeepSpec's EAGLE-3 drafter"),
    ({"num_hidden_layers": 2, "draft_num_hidden_layers": 2}, r"num_hidden_layers 2 is not implemented: one draft"),
    ({"target_layer_ids": [1, 2, 4, 5, 7]}, r"below the target's final layer 7"),
    ({"tie_word_embeddings": True}, r"tie_word_embeddings true is not implemented"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}}, r"rope_type 'dynamic' is "
                                                                                       r"refused"),
])
def test_refuses_config_fields_by_name(tmp_path, change, message):
    with pytest.raises(DraftConfigError, match=message):
        load_eagle3_checkpoint(_with_config(tmp_path, **change))


def test_accepted_fields_load(tmp_path):
    """Training-only and provenance fields are accepted (step_loss_decay, target_model_name_or_path)."""
    d = _with_config(tmp_path, step_loss_decay=0.5, target_model_name_or_path="elsewhere")
    assert load_eagle3_checkpoint(d).config.ttt_length == 3


if __name__ == "__main__":
    ref = reference()
    meta = json.loads(str(ref["meta"]))
    print(f"EAGLE-3 parity with DeepSpec (transformers {meta['transformers']}, {meta['attn_implementation']}), fp32")
    print(f"{'round':>5} {'max|Δ| states':>14} {'max|Δ| logits':>14} {'max|logit|':>10}  drafts (ours / DeepSpec)")
    for r, dh, dl, scale, toks, ref_toks in parity_rows(ref, torch_rounds(ref)):
        print(f"{r:>5} {dh:>14.2e} {dl:>14.2e} {scale:>10.2f}  {toks} / {ref_toks}")
