"""Training an EAGLE-3 drafter on the DSpark feature cache (issue 48): the training-time-test forward sees at step
k exactly what decoding computes k steps into a round (fed the true tokens), and a short run on the tiny target's
features raises held-out acceptance and leaves a checkpoint the strict loader reads back."""
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dspark_export.drafter.eagle3 import (Eagle3Cache, Eagle3DraftModel, eagle3_config_for,  # noqa: E402
                                          load_eagle3_checkpoint)
from dspark_export.drafter.eagle3_train import ttt_steps  # noqa: E402

TARGET = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=256, rope_theta=10000.0)


def fp16(t):
    """``t`` as written to a checkpoint and read back: floating tensors through fp16."""
    return t.half().to(t.dtype) if t.is_floating_point() else t


@torch.no_grad()
def test_ttt_steps_equal_the_decoding_path():
    torch.manual_seed(0)
    model = Eagle3DraftModel(eagle3_config_for(TARGET, [0, 2], ttt_length=3)).eval()
    for p in model.parameters():
        p.add_(0.1 * torch.randn_like(p))
    T = 12
    ids = torch.randint(0, 50, (1, T))
    feats = torch.randn(1, T, 64)
    steps = {k: s for k, _, s in ttt_steps(model, ids, feats, 3)}
    for P in (1, 5, 8):  # a round whose last committed position is P - 1
        cache = Eagle3Cache()
        state = model.extend(feats[:, :P], ids[:, 1:P + 1], torch.arange(P)[None], cache)
        for k in range(3):  # step k fed token P + k (position P - 1 + k's successor) at RoPE position P - 1 + k
            if P + k > T - 1:
                break
            np.testing.assert_allclose(state[0, 0].numpy(), steps[k][0, P - 1].numpy(), atol=2e-5, rtol=1e-4,
                                       err_msg=f"P={P} k={k}")
            if P + k + 1 <= T - 1:
                state = model(state, ids[:, P + k + 1:P + k + 2], torch.tensor([[P + k]]), cache)


def test_training_raises_heldout_acceptance_and_loads_back(tiny_pair, tiny_feature_store, tmp_path):
    from dspark_export.drafter.eagle3_train import Eagle3Objective, train_eagle3
    from dspark_export.drafter.graph import target_frozen_weights
    from dspark_export.drafter.train import TrainSettings
    from dspark_runtime.drafting.eagle3 import feature_columns

    t = json.loads((tiny_pair[0] / "config.json").read_text())
    torch.manual_seed(0)
    model = Eagle3DraftModel(eagle3_config_for(t, [0], ttt_length=3))
    emb, head = target_frozen_weights(tiny_pair[0])
    model.init_from_target(emb, head)
    s = TrainSettings(lr=1e-2, max_steps=300, eval_every=10 ** 6, eval_seqs=6, warmup_steps=10)
    cols = feature_columns((-1, 0), [0], t["hidden_size"])
    store = tiny_feature_store
    before = Eagle3Objective(model, head, s, store, cols).heldout(model, store, range(len(store) - 6, len(store)))
    rep = train_eagle3(store, model, head, tmp_path / "ckpt", s, columns=cols, log=lambda *a: None)
    assert rep["finished"] and rep["steps"] == 300
    assert rep["heldout_acc_pos"][0] > before["heldout_acc_pos"][0] + 0.2, (before, rep)
    assert rep["heldout_tau_greedy"] > before["heldout_tau_greedy"]
    back = load_eagle3_checkpoint(tmp_path / "ckpt")
    assert back.config.target_layer_ids == [0] and back.config.ttt_length == 3
    for name, p in model.state_dict().items():  # written fp16, as the DSpark drafter's checkpoints
        assert torch.equal(back.state_dict()[name], fp16(p)), name
    assert torch.equal(back.embed_tokens.weight, fp16(emb))  # frozen copies of the target's


def test_a_reduced_vocabulary_drafter_trains_and_round_trips_in_specforges_layout(tiny_pair, tiny_feature_store,
                                                                                 tmp_path):
    """A drafter whose head covers the 96 most frequent tokens (trained towards the target's distribution over them)
    is written as SpecForge writes one (d2t / t2d, no embed_tokens) and loads back strictly, equal."""
    import dataclasses

    from dspark_export.drafter.eagle3 import Eagle3Config
    from dspark_export.drafter.eagle3_specforge import specforge_config_for
    from dspark_export.drafter.eagle3_train import train_eagle3
    from dspark_export.drafter.features import choose_draft_vocab
    from dspark_export.drafter.graph import target_frozen_weights
    from dspark_export.drafter.train import TrainSettings
    from dspark_runtime.drafting.eagle3 import feature_columns
    from safetensors import safe_open

    t = json.loads((tiny_pair[0] / "config.json").read_text())
    store = tiny_feature_store
    vocab = choose_draft_vocab(store.token_counts(t["vocab_size"]), 96)
    c = Eagle3Config.from_dict(specforge_config_for(t, [0], len(vocab)), target_num_layers=t["num_hidden_layers"])
    torch.manual_seed(0)
    model = Eagle3DraftModel(dataclasses.replace(c, ttt_length=3))
    model.draft_vocab_ids = torch.as_tensor(vocab)
    emb, head = target_frozen_weights(tiny_pair[0])
    model.init_from_target(emb, head)
    assert torch.equal(model.lm_head.weight, head[torch.as_tensor(vocab)])
    rep = train_eagle3(store, model, head, tmp_path / "ckpt",
                       TrainSettings(lr=1e-2, max_steps=200, eval_every=10 ** 6, eval_seqs=6, warmup_steps=10),
                       columns=feature_columns((-1, 0), [0], t["hidden_size"]), log=lambda *a: None)
    assert rep["finished"] and rep["heldout_acc_pos"][0] > 0.1
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"d2t", "t2d", "midlayer.self_attn.q_proj.weight"} <= names and "embed_tokens.weight" not in names
    back = load_eagle3_checkpoint(tmp_path / "ckpt", target_embed=emb)
    assert back.draft_vocab_ids.tolist() == vocab.tolist() and back.config.qk_norm is False
    for name, p in model.state_dict().items():
        want = p if name == "embed_tokens.weight" else fp16(p)  # the target's table, not from the checkpoint
        assert torch.equal(back.state_dict()[name], want), name
