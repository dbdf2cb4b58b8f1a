"""Tiny random-weight models with a real byte-level BPE tokenizer, for fast end-to-end tests."""
from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "for i in range(10):\n    print(i * i)\n",
    "Write a function that sorts a list of numbers.",
]


def make_tokenizer(folder: Path, vocab_size: int = 320) -> int:
    """Train a small byte-level BPE tokenizer; save tokenizer.json + config. Returns vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None}))
    return tok.get_vocab_size()


def make_pair(root: Path, noise: float = 0.03, seed: int = 0, family: str = "qwen2"):
    """Save a tiny target and a noisy-copy draft (same tokenizer) under ``root``; return both paths."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    tdir, ddir = root / "tiny-target", root / "tiny-draft"
    vocab = make_tokenizer(tdir)
    make_tokenizer(ddir)
    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
              eos_token_id=2, bos_token_id=None, tie_word_embeddings=False)
    Cfg, Model = (Qwen2Config, Qwen2ForCausalLM) if family == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    target = Model(Cfg(**kw)).eval()
    # Random init is too flat for interesting argmaxes: sharpen the LM head.
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
    target.save_pretrained(tdir)
    draft = Model(Cfg(**kw)).eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * noise * p.std())
    draft.save_pretrained(ddir)
    return tdir, ddir


def add_tiny_dspark(engine_dir: Path, target_dir: Path, block_size: int = 4, precision: str = "fp32",
                    isolate: bool = False) -> Path:
    """Add an untrained tiny DSpark drafter (1 layer, block ``block_size``, Markov rank 16, the target's
    embedding and LM head) to the built tiny ``engine_dir`` as graph ``dspark`` beside its draft LM
    (``dspark-export add-draft``); the target must output features of layers (-1, 0). Untrained drafts are
    mostly rejected, which is all exactness checks and engine builds need. Returns the checkpoint folder."""
    import torch

    from dspark_export.engine_dir.add_draft import add_dspark_draft
    from dspark_export.drafter.graph import target_frozen_weights
    from dspark_export.drafter.checkpoint import save_checkpoint
    from dspark_export.drafter.model import DSparkDraftModel, qwen2_draft_config

    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    c = qwen2_draft_config(cfg, mask_token_id=cfg["vocab_size"] - 1, num_layers=1, intermediate_size=64,
                           block_size=block_size, target_layer_ids=(-1, 0), markov_rank=16)
    torch.manual_seed(0)
    model = DSparkDraftModel(c)
    model.init_from_target(*target_frozen_weights(target_dir))
    ckpt = save_checkpoint(model, Path(engine_dir).parent / f"{Path(engine_dir).name}-dspark-ckpt",
                           dtype=torch.float32)
    add_dspark_draft(engine_dir, ckpt, str(target_dir), isolate=isolate, log=lambda *a: None, precision=precision)
    return ckpt
