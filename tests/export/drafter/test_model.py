"""The DSpark drafter in torch: DeepSpec-layout checkpoints, config validation, masks, and the loss."""
import json

import numpy as np
import pytest
import torch

from dspark_export.drafter.config import DraftConfigError, DSparkConfig
from dspark_export.drafter.checkpoint import expected_shapes, load_checkpoint, load_weights_into, save_checkpoint
from dspark_export.drafter.model import DSparkDraftModel, block_mask

# A hand-specified DeepSpec config: a (tiny) copy of a Qwen3 target config plus the DSpark fields.
DEEPSPEC_CONFIG = {
    "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "attention_dropout": 0.0,
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 32, "head_dim": 8,
    "intermediate_size": 48, "max_position_embeddings": 4096, "num_attention_heads": 4,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "vocab_size": 97,
    "torch_dtype": "bfloat16", "use_cache": True, "layer_types": ["full_attention", "full_attention"],
    # DSpark fields
    "num_hidden_layers": 2, "num_target_layers": 6, "block_size": 7, "target_layer_ids": [0, 2, 4],
    "mask_token_id": 96, "num_anchors": 512, "markov_rank": 16, "markov_head_type": "gated",
    "enable_confidence_head": True, "confidence_head_with_markov": True,
}


def _random_model(cfg: dict, seed=0) -> DSparkDraftModel:
    torch.manual_seed(seed)
    m = DSparkDraftModel(DSparkConfig.from_dict(cfg))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return m


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_deepspec_checkpoint_round_trip_is_bit_exact(tmp_path, kind):
    cfg = dict(DEEPSPEC_CONFIG, markov_head_type=kind)
    m = _random_model(cfg)
    # DeepSpec stores the frozen embedding/LM head too; fp32 storage makes the round trip bit-exact
    save_checkpoint(m, tmp_path, dtype=torch.float32, include_frozen=True)
    names = set(json.loads((tmp_path / "config.json").read_text()))
    assert {"block_size", "target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type",
            "enable_confidence_head", "confidence_head_with_markov", "layer_types", "torch_dtype"} <= names
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "fc.weight" in keys and "hidden_norm.weight" in keys and "markov_head.markov_w1.weight" in keys
    assert "layers.1.self_attn.k_norm.weight" in keys and "confidence_head.proj.weight" in keys
    assert ("markov_head.gate_proj.weight" in keys) == (kind == "gated")
    assert ("markov_head.joint_proj.weight" in keys) == (kind == "rnn")
    back = load_checkpoint(tmp_path)
    a, b = m.state_dict(), back.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # copied target fields survive the round trip unchanged
    cfg2 = json.loads((tmp_path / "config.json").read_text())
    for k, v in DEEPSPEC_CONFIG.items():
        if k != "markov_head_type":
            assert cfg2[k] == v, k


def test_checkpoint_without_frozen_copies_needs_the_target(tmp_path):
    m = _random_model(DEEPSPEC_CONFIG)
    save_checkpoint(m, tmp_path, dtype=torch.float32)  # omits embed_tokens / lm_head
    with pytest.raises(DraftConfigError, match="omits the frozen"):
        load_checkpoint(tmp_path)
    back = load_checkpoint(tmp_path, target_embed=m.embed_tokens.weight.detach(),
                           target_lm_head=m.lm_head.weight.detach())
    assert torch.equal(back.fc.weight, m.fc.weight)


def test_sharded_checkpoint_round_trips_and_replaces_an_earlier_save(tmp_path):
    """shard_bytes splits the weights into Hugging Face shards no larger than asked (but a bigger tensor, alone),
    removes the unsharded file of an earlier save, and loads back bit-exact; a missing shard or a stale extra file
    is refused by name."""
    m = _random_model(DEEPSPEC_CONFIG)
    save_checkpoint(m, tmp_path, dtype=torch.float32, include_frozen=True)
    assert (tmp_path / "model.safetensors").is_file()
    save_checkpoint(m, tmp_path, dtype=torch.float32, include_frozen=True, shard_bytes=8192)
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    assert (tmp_path / "model.safetensors.index.json").is_file()
    biggest = max(p.numel() * 4 for p in m.state_dict().values())
    for f in shards:
        assert f.stat().st_size <= max(8192, biggest) + 4096, f.name  # + the safetensors header
    back = load_checkpoint(tmp_path)
    for k, v in m.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    import shutil
    stale = tmp_path / "stale"
    shutil.copytree(tmp_path, stale)
    shutil.copy(shards[0], stale / "model.safetensors")
    with pytest.raises(DraftConfigError, match="is in both"):
        load_checkpoint(stale)
    shards[-1].unlink()
    with pytest.raises(DraftConfigError, match=f"{shards[-1].name}.*are missing"):
        load_checkpoint(tmp_path)


def test_load_weights_into_continues_an_earlier_drafter_and_refuses_another(tmp_path):
    """An earlier run's checkpoint fills a drafter of the same config and draft vocabulary; another width or
    vocabulary is refused naming it."""
    cfg = dict(DEEPSPEC_CONFIG, draft_vocab_size=40)
    m = _random_model(cfg, seed=1)
    target_head = torch.randn(97, 32)  # the target's LM head; the drafter's holds its draft vocabulary's rows
    with torch.no_grad():
        m.draft_vocab_ids.copy_(torch.arange(40) * 2)
        m.lm_head.weight.copy_(target_head[m.draft_vocab_ids])
    save_checkpoint(m, tmp_path / "a", dtype=torch.float32)
    frozen = dict(target_embed=m.embed_tokens.weight.detach(), target_lm_head=target_head)
    fresh = _random_model(cfg, seed=2)
    with torch.no_grad():
        fresh.draft_vocab_ids.copy_(m.draft_vocab_ids)
    assert not torch.equal(fresh.fc.weight, m.fc.weight)
    load_weights_into(fresh, tmp_path / "a", **frozen)
    for k, v in m.state_dict().items():
        assert torch.equal(v, fresh.state_dict()[k]), k
    wider = _random_model(dict(cfg, intermediate_size=64))
    with pytest.raises(DraftConfigError, match="intermediate_size"):
        load_weights_into(wider, tmp_path / "a", **frozen)
    other_vocab = _random_model(cfg)  # draft_vocab_ids 0..39
    with pytest.raises(DraftConfigError, match="draft vocabulary"):
        load_weights_into(other_vocab, tmp_path / "a", **frozen)


@pytest.mark.parametrize("field,value,msg", [
    ("block_size", None, "missing"),
    ("target_layer_ids", [2, 1], "strictly increasing"),
    ("target_layer_ids", [0, 9], "exceed num_target_layers"),
    ("markov_head_type", "lstm", "markov_head_type"),
    ("mask_token_id", 500, "outside the vocabulary"),
    ("markov_rank", -1, "markov_rank"),
    ("enable_confidence_head", "yes", "true or false"),
])
def test_malformed_dspark_fields_are_named(field, value, msg):
    cfg = dict(DEEPSPEC_CONFIG)
    if value is None:
        del cfg[field]
    else:
        cfg[field] = value
    with pytest.raises(DraftConfigError, match=msg):
        DSparkConfig.from_dict(cfg)


def test_misshaped_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file
    m = _random_model(DEEPSPEC_CONFIG)
    save_checkpoint(m, tmp_path, dtype=torch.float32, include_frozen=True)
    t = load_file(str(tmp_path / "model.safetensors"))
    t["fc.weight"] = t["fc.weight"][:, :-1].contiguous()
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(DraftConfigError, match="'fc.weight' has shape"):
        load_checkpoint(tmp_path)
    del t["fc.weight"]
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(DraftConfigError, match="lacks tensor"):
        load_checkpoint(tmp_path)


def test_reduced_vocabulary_shapes_and_mapping():
    cfg = dict(DEEPSPEC_CONFIG, draft_vocab_size=10)
    c = DSparkConfig.from_dict(cfg)
    s = expected_shapes(c)
    assert s["lm_head.weight"] == (10, 32) and s["markov_head.markov_w1.weight"] == (11, 16)
    m = DSparkDraftModel(c)
    m.draft_vocab_ids.copy_(torch.tensor([2, 5, 7, 11, 13, 17, 19, 23, 29, 96]))
    m._t2d = None
    t2d = m.target_to_draft()
    assert t2d[5] == 1 and t2d[96] == 9 and t2d[3] == 10  # 10 = outside the draft vocabulary


def test_block_mask_matches_deepspec_rule():
    anchors = torch.tensor([[1, 4]])
    keep = torch.tensor([[True, True]])
    m = block_mask(anchors, keep, seq_len=6, gamma=2)[0, 0]
    # block 0 (anchor 1): context positions < 1, and its own 2 slots (kv 6, 7)
    assert m[0].tolist() == [True, False, False, False, False, False, True, True, False, False]
    # block 1 (anchor 4): context < 4 and kv 8, 9
    assert m[3].tolist() == [True, True, True, True, False, False, False, False, True, True]


def test_block_output_is_invariant_to_other_blocks_and_future_context():
    """A block sees only context before its anchor and its own slots (what inference will see)."""
    m = _random_model(DEEPSPEC_CONFIG).eval()
    c = m.config
    g = torch.Generator().manual_seed(1)
    L = 12
    feats = torch.randn(1, L, c.feature_size, generator=g)
    gamma = c.block_size

    def run(feats, anchors):
        anchors = torch.tensor([anchors])
        keep = torch.ones_like(anchors, dtype=torch.bool)
        kv = m.context_kv(feats, torch.arange(L)[None])
        ids = torch.full((1, anchors.shape[1] * gamma), c.mask_token_id)
        ids[0, ::gamma] = torch.tensor([5] * anchors.shape[1])
        pos = (anchors[:, :, None] + torch.arange(gamma)).view(1, -1)
        return m.block_hidden(ids, pos, kv, block_mask(anchors, keep, L, gamma))

    with torch.no_grad():
        both = run(feats, [3, 8])
        alone = run(feats, [3])
        f2 = feats.clone()
        f2[:, 3:] = torch.randn(1, L - 3, c.feature_size, generator=g)  # change context at/after anchor 3
        changed = run(f2, [3])
    torch.testing.assert_close(both[:, :gamma], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(changed, alone, rtol=1e-5, atol=1e-5)


def test_loss_trains_a_tiny_drafter_toward_the_target():
    """On synthetic data where the next token is a function of the feature, the DeepSpec loss drops and
    teacher-forced acceptance rises."""
    from dspark_export.drafter.train import TrainSettings, block_batch, dspark_loss, sample_anchors

    cfg = dict(DEEPSPEC_CONFIG, num_hidden_layers=1, layer_types=["full_attention"], markov_head_type="vanilla",
               block_size=3)
    torch.manual_seed(0)
    m = DSparkDraftModel(DSparkConfig.from_dict(cfg))
    c = m.config
    rng = np.random.default_rng(0)
    V, d = c.vocab_size, c.hidden_size
    head = torch.randn(V, d) * 0.5
    m.init_from_target(torch.randn(V, d) * 0.5, head)
    # a deterministic "language": token t+1 = (3 t + 1) mod 90; target hidden = scaled head row of the next token
    seqs = []
    for _ in range(8):
        ids = np.empty(40, np.int32)
        ids[0] = rng.integers(0, 90)
        for i in range(1, 40):
            ids[i] = (3 * ids[i - 1] + 1) % 90
        last = (head[torch.as_tensor(np.r_[ids[1:], ids[-1]]).long()] * 4).numpy().astype(np.float16)
        feats = np.tile(last, (1, 3)).astype(np.float16)
        seqs.append((ids, np.ones(40, np.uint8), feats, last))
    s = TrainSettings(lr=3e-3)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=s.lr)
    t2d = m.target_to_draft()
    first = last_m = None
    for step in range(60):
        an = [sample_anchors(q[1], 8, rng) for q in seqs[:4]]
        batch = block_batch([(q[0], q[1], q[2].astype(np.float32), q[3].astype(np.float32)) for q in seqs[:4]],
                            an, c.block_size, c.mask_token_id, t2d)
        loss, met = dspark_loss(m, batch, head, s, c.block_size)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first or met
        last_m = met
    assert last_m["loss"] < 0.5 * first["loss"]
    assert last_m["acc_pos"][0] > 0.9 and last_m["acc_pos"][0] > first["acc_pos"][0]


def test_gemma4_drafter_round_trip_and_bf16_load(tmp_path):
    """A Gemma-4 DSpark drafter (DeepSpec's layer: k=v, sandwich norms, layer_scalar, soft cap) written by
    save_checkpoint loads back bit-exact, and dtype=bfloat16 gives bf16 parameters holding the stored values."""
    from tests.export.drafter.test_deepspec_compat import GEMMA

    m = _random_model(GEMMA)
    with torch.no_grad():
        m.layers[0].layer_scalar.fill_(0.75)
    save_checkpoint(m, tmp_path, dtype=torch.bfloat16, include_frozen=True)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "layers.0.layer_scalar" in keys and "layers.1.pre_feedforward_layernorm.weight" in keys
    assert "layers.0.self_attn.v_proj.weight" not in keys  # attention_k_eq_v: keys double as values
    back = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in back.parameters()} == {torch.bfloat16}
    a, b = m.state_dict(), back.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k].to(torch.bfloat16), b[k]), k
    assert float(back.layers[0].layer_scalar) == 0.75
    cfg2 = json.loads((tmp_path / "config.json").read_text())
    assert cfg2["architectures"] == ["Gemma4DSparkModel"] and cfg2["head_dim"] == 8 and cfg2["global_head_dim"] == 16
