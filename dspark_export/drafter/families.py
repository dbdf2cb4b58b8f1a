"""The DSpark drafter's layer families and the ``config.json`` fields of each: read (:data:`USED_FIELDS`), accepted
only with the values the layer implements (:data:`CONDITIONAL_FIELDS`), accepted and ignored with the reason
(:data:`IGNORED_FIELDS`, :data:`IGNORED_BY_LAYER`), plus the RoPE types each family implements or refuses.

Tables only; :mod:`dspark_export.drafter.config` validates a config against them and refuses any field they do not
name. ``draft_vocab_size``, ``frozen_from_target`` and :data:`MOE_FIELDS` are our extensions beside DeepSpec's fields.
"""
from __future__ import annotations

# DSpark fields of a DeepSpec draft config.json (the rest is a copy of the target's config).
DSPARK_FIELDS = ("block_size", "target_layer_ids", "mask_token_id", "num_hidden_layers", "markov_rank",
                 "markov_head_type", "enable_confidence_head", "confidence_head_with_markov", "num_anchors",
                 "num_target_layers")
REQUIRED_FIELDS = ("block_size", "target_layer_ids", "mask_token_id", "num_hidden_layers", "markov_rank",
                   "enable_confidence_head", "hidden_size", "intermediate_size", "num_attention_heads",
                   "num_key_value_heads", "vocab_size", "rms_norm_eps")
MARKOV_TYPES = ("vanilla", "gated", "rnn")
# Our extension (not DeepSpec's): a Mixture-of-Experts FFN in every draft layer. Prefixed with ``draft_`` so they
# never collide with a MoE *target's* own fields (num_experts, num_experts_per_tok, moe_intermediate_size, ...)
# copied into the same config.json. Absent (or draft_moe_experts 0) = the dense SwiGLU MLP.
MOE_FIELDS = ("draft_moe_experts", "draft_moe_top_k", "draft_moe_intermediate_size")

QWEN3 = "Qwen3DSparkModel"
GEMMA4 = "Gemma4DSparkModel"
ARCHITECTURES = (QWEN3, GEMMA4)
# model_type values each layer family accepts (DeepSpec copies the target's; our own drafters for Qwen2/Llama/
# Mistral targets use DeepSpec's Qwen3 layer).
MODEL_TYPES = {QWEN3: ("qwen3", "qwen2", "llama", "mistral"), GEMMA4: ("gemma4_text", "gemma4_unified_text")}
REQUIRED_BY_LAYER = {QWEN3: (), GEMMA4: ("global_head_dim", "hidden_activation", "rope_parameters", "attention_k_eq_v")}

# RoPE types implemented (inv_freq and attention scaling from transformers' own rotary embedding of the
# family), the keys each may carry besides rope_type/rope_theta, and the types refused with the reason.
ROPE_TYPES = {QWEN3: ("default", "linear", "yarn", "llama3"), GEMMA4: ("default", "proportional")}
ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "proportional": ("factor", "partial_rotary_factor"),
}
ROPE_REFUSED = {
    "dynamic": "dynamic NTK recomputes the frequencies from the current sequence length at every call, so keys "
               "cached in earlier rounds would carry other frequencies than the new ones; a fixed ONNX graph with "
               "a reused context cache cannot reproduce that faithfully",
    "longrope": "LongRoPE switches between its short and long factors by the current sequence length, which a "
                "fixed ONNX graph with a reused context cache cannot reproduce faithfully",
}

# config.json fields read by the drafter, per layer family.
_COMMON_USED = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "vocab_size", "rms_norm_eps", "attention_bias",
                "rope_parameters", "max_position_embeddings", "layer_types", "tie_word_embeddings", "block_size",
                "target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type", "enable_confidence_head",
                "confidence_head_with_markov", "num_target_layers", "draft_vocab_size",
                "frozen_from_target") + MOE_FIELDS
USED_FIELDS = {
    QWEN3: _COMMON_USED + ("head_dim", "hidden_act", "rope_theta", "rope_scaling", "original_max_position_embeddings"),
    GEMMA4: _COMMON_USED + ("global_head_dim", "num_global_key_value_heads", "attention_k_eq_v", "hidden_activation",
                            "final_logit_softcapping"),
}
# Fields accepted only with the values the drafter implements (checked in DSparkConfig.from_dict).
CONDITIONAL_FIELDS = {
    QWEN3: {
        "mlp_bias": "must be false (DeepSpec's Qwen3 MLP has no biases)",
        "use_sliding_window": "ignored when layer_types is given (DeepSpec's layer reads layer_types); must be "
                              "false otherwise",
        "sliding_window": "ignored: it applies only to 'sliding_attention' layers, which are refused",
        "max_window_layers": "ignored: it only derives layer_types when those are absent (use_sliding_window false)",
    },
    GEMMA4: {
        "enable_moe_block": "must be false (DeepSpec's Gemma-4 DSpark layer refuses MoE blocks)",
        "hidden_size_per_layer_input": "must be 0 or null (per-layer inputs; DeepSpec's Gemma-4 DSpark layer "
                                       "refuses them)",
        "use_double_wide_mlp": "must be false when num_kv_shared_layers > 0 (the MLP width of KV-shared layers "
                               "then depends on the transformers version's sharing layout)",
        "num_kv_shared_layers": "ignored when use_double_wide_mlp is false: DeepSpec's drafter attention never "
                                "shares keys/values between layers",
        "per_layer_config": "(transformers' newer layout) accepted only when every entry repeats global_head_dim "
                            "and the KV head count",
        "sliding_window": "ignored: it applies only to 'sliding_attention' layers, which are refused",
    },
}
# Fields accepted and not read, with why that is safe.
IGNORED_FIELDS = {
    "attention_dropout": "dropout, off at inference (DeepSpec evaluates with it off)",
    "initializer_range": "weight initialisation only",
    "bos_token_id": "tokenizer id; the drafter never reads it",
    "eos_token_id": "tokenizer id; the drafter never reads it",
    "pad_token_id": "tokenizer id; in DeepSpec only nn.Embedding's padding_idx, which changes gradients, not outputs",
    "use_cache": "generation flag of the target",
    "torch_dtype": "storage dtype; each tensor's own dtype is read and cast to load_checkpoint(dtype=...)",
    "dtype": "storage dtype; each tensor's own dtype is read and cast to load_checkpoint(dtype=...)",
    "transformers_version": "provenance",
    "_name_or_path": "provenance",
    "_model_name_or_path": "provenance (the GGUF a target was converted from)",
    "num_anchors": "training only (anchors sampled per sequence)",
    "_attn_implementation": "attention kernel choice (eager/sdpa/flex): the same function",
    "pretraining_tp": "Llama's tensor-parallel split of the target's matmuls (the same function); the drafter "
                      "layer never reads it",
    "id2label": "Hugging Face bookkeeping (classification heads)",
    "label2id": "Hugging Face bookkeeping (classification heads)",
    "problem_type": "Hugging Face bookkeeping (classification heads)",
    "output_attentions": "Hugging Face output flag",
    "output_hidden_states": "Hugging Face output flag",
    "return_dict": "Hugging Face output flag",
    "chunk_size_feed_forward": "Hugging Face bookkeeping; DeepSpec's layers do not read it",
    "is_encoder_decoder": "Hugging Face bookkeeping; DeepSpec's layers do not read it",
    "tokenizer_class": "tokenizer bookkeeping",
}
IGNORED_BY_LAYER = {
    QWEN3: {},
    GEMMA4: {
        "head_dim": "the sliding-attention head size; every draft layer is full attention with global_head_dim",
        "use_bidirectional_attention": "the target's causal switch; the DSpark block mask sets the drafter's "
                                       "attention",
        "vocab_size_per_layer_input": "per-layer input embeddings, off (hidden_size_per_layer_input = 0)",
        "num_experts": "MoE, off (enable_moe_block false)",
        "top_k_experts": "MoE, off (enable_moe_block false)",
        "moe_intermediate_size": "MoE, off (enable_moe_block false)",
        "target_model_type": "provenance DeepSpec records",
        "target_text_model_type": "provenance DeepSpec records",
    },
}
