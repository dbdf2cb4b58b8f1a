"""The model the GPU peers are timed on: a Qwen2.5-1.5B-architecture Hugging Face folder with random weights
(``QWEN25_1P5B``: the one definition of that architecture, which ``benchmarks.gpu.prepare_cuda`` imports to build
DSpark's graph), or ``TINY`` to test on a CPU.

    python -m benchmarks.peers.gpu_peers make-model OUT [--tiny] [--device cuda|cpu]
"""
from __future__ import annotations

import json
import time
from pathlib import Path

QWEN25_1P5B = dict(
    vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
    num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
    rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643,
    rope_theta=1e6, initializer_range=0.02, hidden_act="silu", use_sliding_window=False,
    sliding_window=32768, max_window_layers=21,
)
TINY = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
    rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=319, eos_token_id=319,
    rope_theta=1e6, initializer_range=0.02, hidden_act="silu", use_sliding_window=False,
    sliding_window=32768, max_window_layers=2,
)
EOS_TEXT = "<|endoftext|>"


def write_tokenizer(out: Path, vocab_size: int, eos: int, max_len: int):
    """A WordLevel tokenizer over the whole vocabulary (token i is ``<t{i}>``, the EOS id is
    ``<|endoftext|>``), saved with transformers so AutoTokenizer loads it offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"<t{i}>": i for i in range(vocab_size) if i != eos}
    vocab[EOS_TEXT] = eos
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<t0>" if eos != 0 else "<t1>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TEXT, pad_token=EOS_TEXT,
                                     unk_token="<t0>" if eos != 0 else "<t1>", model_max_length=max_len)
    hf_tok.save_pretrained(str(out))


def cmd_make_model(a) -> int:
    """make-model: a random-weight Hugging Face folder.

    Writes a Hugging Face folder: a ``Qwen2ForCausalLM`` of the Qwen2.5-1.5B config (hidden 1536,
    28 layers, 12 heads, 2 KV heads, intermediate 8960, vocab 151936, tied embeddings, rope_theta 1e6)
    initialised by transformers' own init (normal, std 0.02) after ``torch.manual_seed(0)``, saved as
    fp16 safetensors; built on the GPU when CUDA is there (the same seed gives other numbers on the
    CPU: the device is recorded in ``peers_model.json``). ``--tiny``: the same architecture at hidden 64,
    2 layers, 4 heads, 2 KV heads, intermediate 128, vocab 320, to test this script on a CPU. A
    minimal offline tokenizer (a ``tokenizers`` WordLevel over the vocabulary, ``<|endoftext|>`` at
    the EOS id) is written too because the GenAI model builder loads one; only token ids are used.
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
    spec = dict(TINY if a.tiny else QWEN25_1P5B)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cfg = Qwen2Config(**spec)
    cfg.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(a.seed)
    if device == "cuda":
        torch.cuda.manual_seed_all(a.seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)  # transformers' init: normal(0, initializer_range), norms 1
    model = model.to(torch.float16).eval()
    model.config.dtype = torch.float16
    model.generation_config = GenerationConfig(bos_token_id=spec["bos_token_id"],
                                               eos_token_id=spec["eos_token_id"],
                                               pad_token_id=spec["eos_token_id"], do_sample=False)
    t_init = time.perf_counter() - t0
    model.save_pretrained(str(out))
    write_tokenizer(out, spec["vocab_size"], spec["eos_token_id"], spec["max_position_embeddings"])
    n_params = sum(p.numel() for p in model.parameters())
    w = model.model.layers[0].mlp.up_proj.weight.detach().float()
    rec = {"config": "tiny" if a.tiny else "qwen2.5-1.5b", "seed": a.seed, "init_device": device,
           "init": "transformers default (normal std 0.02, norms 1), fp16 after init",
           "params": int(n_params), "torch": torch.__version__,
           "layer0_up_proj_std": round(float(w.std()), 5),
           "init_s": round(t_init, 2), "total_s": round(time.perf_counter() - t0, 2)}
    (out / "peers_model.json").write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps(rec))
    return 0
