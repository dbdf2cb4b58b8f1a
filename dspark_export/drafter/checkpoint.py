"""DSpark drafter checkpoints in DeepSpec's layout: ``config.json`` (:mod:`dspark_export.drafter.config`) plus
``model.safetensors`` with DeepSpec's parameter names.

Loading is strict: every checkpoint tensor is consumed and every model tensor filled, each with the shape the
config implies, or :class:`~dspark_export.drafter.config.DraftConfigError` names the tensor and what would describe
it. A checkpoint may omit the frozen copies of the target's embedding and LM head (``frozen_from_target``); they are
then taken from the target at load time.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file

from dspark_export.drafter.config import GEMMA4, DraftConfigError, DSparkConfig, load_config
from dspark_export.drafter.model import DSparkDraftModel

INDEX_NAME = "model.safetensors.index.json"  # a sharded checkpoint's tensor -> file map


def expected_shapes(c: DSparkConfig, include_frozen: bool = True) -> dict:
    """Every tensor name of a DeepSpec-layout checkpoint for ``c`` -> its shape."""
    d, hd = c.hidden_size, c.head_dim
    s = {"fc.weight": (d, c.feature_size), "hidden_norm.weight": (d,), "norm.weight": (d,)}
    if include_frozen:
        s["embed_tokens.weight"] = (c.vocab_size, d)
        s["lm_head.weight"] = (c.out_vocab, d)
    projs = {"q_proj": c.num_attention_heads * hd, "k_proj": c.num_key_value_heads * hd}
    if not c.attention_k_eq_v:
        projs["v_proj"] = c.num_key_value_heads * hd
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        for name, rows in projs.items():
            s[p + f"self_attn.{name}.weight"] = (rows, d)
            if c.attention_bias:
                s[p + f"self_attn.{name}.bias"] = (rows,)
        s[p + "self_attn.o_proj.weight"] = (d, c.num_attention_heads * hd)
        if c.attention_bias:
            s[p + "self_attn.o_proj.bias"] = (d,)
        s[p + "self_attn.q_norm.weight"] = (hd,)
        s[p + "self_attn.k_norm.weight"] = (hd,)
        if c.moe:  # our MoE FFN option (Mixtral-like names)
            w = c.draft_moe_intermediate_size
            s[p + "mlp.gate.weight"] = (c.draft_moe_experts, d)
            for j in range(c.draft_moe_experts):
                s[p + f"mlp.experts.{j}.gate_proj.weight"] = (w, d)
                s[p + f"mlp.experts.{j}.up_proj.weight"] = (w, d)
                s[p + f"mlp.experts.{j}.down_proj.weight"] = (d, w)
        else:
            s[p + "mlp.gate_proj.weight"] = (c.intermediate_size, d)
            s[p + "mlp.up_proj.weight"] = (c.intermediate_size, d)
            s[p + "mlp.down_proj.weight"] = (d, c.intermediate_size)
        s[p + "input_layernorm.weight"] = (d,)
        s[p + "post_attention_layernorm.weight"] = (d,)
        if c.gemma:
            s[p + "pre_feedforward_layernorm.weight"] = (d,)
            s[p + "post_feedforward_layernorm.weight"] = (d,)
            s[p + "layer_scalar"] = (1,)
    r = c.markov_rank
    if r > 0:
        s["markov_head.markov_w1.weight"] = (c.draft_vocab_size + 1 if c.draft_vocab_size else c.vocab_size, r)
        s["markov_head.markov_w2.weight"] = (c.out_vocab, r)
        if c.markov_head_type == "gated":
            s["markov_head.gate_proj.weight"] = (r, d + r)
            s["markov_head.gate_proj.bias"] = (r,)
        elif c.markov_head_type == "rnn":
            s["markov_head.joint_proj.weight"] = (3 * r, 2 * r + d)
            s["markov_head.joint_proj.bias"] = (3 * r,)
    if c.enable_confidence_head:
        s["confidence_head.proj.weight"] = (1, d + (r if c.confidence_head_with_markov else 0))
        s["confidence_head.proj.bias"] = (1,)
    if c.draft_vocab_size:
        s["draft_vocab_ids"] = (c.draft_vocab_size,)
    return s


def _unexpected_hint(names: list, c: DSparkConfig) -> str:
    """What would make the config describe the unexpected tensors ``names``."""
    hints = []
    if any(n.endswith("_proj.bias") and ".self_attn." in n for n in names) and not c.attention_bias:
        hints.append("q/k/v/o biases need attention_bias: true")
    if any(n.endswith("self_attn.v_proj.weight") for n in names) and c.attention_k_eq_v:
        hints.append("a v_proj means attention_k_eq_v: false (with it true, keys double as values)")
    gemma_only = ("pre_feedforward_layernorm", "post_feedforward_layernorm", "layer_scalar")
    if any(g in n for n in names for g in gemma_only) and not c.gemma:
        hints.append(f"{'/'.join(gemma_only)} belong to DeepSpec's Gemma-4 layer: its config says architectures "
                     f"[{GEMMA4!r}] with model_type gemma4_text")
    if any(".mlp." in n and n.endswith(".bias") for n in names):
        hints.append("MLP biases are not implemented (DeepSpec's DSpark MLPs have none)")
    if any(".mlp.experts." in n or n.endswith(".mlp.gate.weight") for n in names):
        if not c.moe:
            hints.append("mlp.gate / mlp.experts.N.* are the MoE FFN option: its config.json needs "
                         "draft_moe_experts, draft_moe_top_k and draft_moe_intermediate_size (our extension)")
        else:
            hints.append(f"the config gives draft_moe_experts {c.draft_moe_experts}; does the checkpoint hold more "
                         "experts?")
    if c.moe and any(n.split(".mlp.")[-1] in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
                     for n in names):
        hints.append("mlp.{gate,up,down}_proj are the dense MLP's: the checkpoint was saved dense, so remove "
                     "draft_moe_experts / draft_moe_top_k / draft_moe_intermediate_size from config.json")
    if any(n.startswith("markov_head.") for n in names) and c.markov_rank == 0:
        hints.append("markov_head.* is the Markov head, which markov_rank 0 (DFlash) leaves out: its config.json "
                     "needs markov_rank (the head's rank) and markov_head_type")
    if any(n.startswith("confidence_head.") for n in names) and not c.enable_confidence_head:
        hints.append("confidence_head.* is the confidence head, which enable_confidence_head false (DFlash) leaves "
                     "out: its config.json needs enable_confidence_head true and confidence_head_with_markov")
    if not hints:
        hints.append("no layer this loader implements has them; supporting them needs dspark_export/drafter/model.py "
                     "to implement the module they belong to")
    return "; ".join(hints)


def save_checkpoint(model: DSparkDraftModel, out_dir: Path, *, dtype=torch.float16, include_frozen: bool = False,
                    shard_bytes: int | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in the DeepSpec layout; returns the folder.

    ``include_frozen=False`` omits the frozen copies of the target's embedding and LM head (recorded as
    ``frozen_from_target``; loading then needs the target). Floating tensors are stored as ``dtype``.
    ``shard_bytes``: Hugging Face shards of at most that many bytes (:func:`write_weights`), e.g. to bring a
    checkpoint back from a machine that returns small files only.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    c = model.config
    c.frozen_from_target = not include_frozen
    names = expected_shapes(c, include_frozen)
    state = model.state_dict()
    tensors = {}
    for n in names:
        t = state[n].detach().cpu().contiguous()
        tensors[n] = t.to(dtype) if t.is_floating_point() else t
    write_weights(tensors, out_dir, shard_bytes)
    (out_dir / "config.json").write_text(json.dumps(c.to_dict(), indent=2) + "\n")
    return out_dir


def write_weights(tensors: dict, out_dir: Path, shard_bytes: int | None = None) -> None:
    """Write a checkpoint's ``tensors`` (name -> CPU tensor) into ``out_dir``: one ``model.safetensors``, or with
    ``shard_bytes`` Hugging Face shards of at most that many bytes (``model-0000i-of-0000n.safetensors`` +
    ``model.safetensors.index.json``; a larger tensor alone in its file), after removing the weight files of an
    earlier save (huggingface_hub ``save_torch_state_dict``). Every drafter family's checkpoint is written here."""
    save_torch_state_dict(tensors, out_dir, max_shard_size=int(shard_bytes) if shard_bytes else "100GB",
                          metadata={"format": "pt"})


def assign_state(build, sd: dict, path):
    """``build()`` (a drafter module) made on the meta device, its parameters and buffers then the tensors of
    ``sd`` (no throw-away random init). Raises DraftConfigError naming ``path`` when ``sd`` does not fill it
    exactly."""
    with torch.device("meta"):
        model = build()
    try:
        model.load_state_dict(sd, strict=True, assign=True)
    except RuntimeError as e:
        raise DraftConfigError(f"{path}: the checkpoint does not fill the drafter its config describes: {e}") from None
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise DraftConfigError(f"{path}: drafter tensor(s) {left[:6]} were not filled by the checkpoint")
    return model


def read_tensors(path: Path) -> dict:
    """Every tensor of the ``*.safetensors`` files in checkpoint folder ``path`` (name -> torch tensor). Raises
    DraftConfigError when there is none."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise DraftConfigError(f"{path}: no *.safetensors weights next to config.json")
    index = Path(path) / INDEX_NAME
    if index.is_file():  # sharded: every shard the index names must be there
        try:
            named = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, AttributeError) as e:
            raise DraftConfigError(f"{index}: not a safetensors index (a 'weight_map' of tensor -> file): "
                                   f"{e}") from None
        lacking = sorted(named - {f.name for f in files})
        if lacking:
            raise DraftConfigError(f"{path}: shard(s) {lacking} named by {INDEX_NAME} are missing; copy every "
                                   "model-*-of-*.safetensors piece of the checkpoint into the folder")
    tensors, source = {}, {}
    for f in files:
        for name, t in load_file(str(f)).items():
            if name in tensors:
                raise DraftConfigError(f"{path}: tensor {name} is in both {source[name]} and {f.name}; remove the "
                                       "weight files of another save (a checkpoint is model.safetensors or its shards)")
            tensors[name], source[name] = t, f.name
    return tensors


def load_checkpoint(path: Path, *, target_embed=None, target_lm_head=None, dtype=torch.float32) -> DSparkDraftModel:
    """Load a DeepSpec-layout drafter (``config.json`` + ``*.safetensors``), strictly: every checkpoint tensor
    is consumed and every model tensor filled; floating tensors are cast to ``dtype`` (the model's parameters
    and buffers are ``dtype``; RoPE frequencies stay float32, as transformers computes them).

    Args:
        target_embed, target_lm_head: the target's embedding / LM head weights [V, d]; required when the
            checkpoint omits its frozen copies (``frozen_from_target``), ignored otherwise.
    Raises:
        DraftConfigError: a missing, unexpected or mis-shaped tensor, a bad or unsupported config, or missing
            target weights.
    """
    path = Path(path)
    c = load_config(path)
    tensors = read_tensors(path)
    frozen = [n for n in ("embed_tokens.weight", "lm_head.weight") if n in tensors]
    if len(frozen) == 1:
        other = ({"embed_tokens.weight", "lm_head.weight"} - set(frozen)).pop()
        raise DraftConfigError(f"{path}: the checkpoint holds {frozen[0]} but not {other}; DeepSpec checkpoints hold "
                               "both frozen copies, ours (frozen_from_target) neither")
    has_frozen = len(frozen) == 2
    want = expected_shapes(c, include_frozen=has_frozen)
    unexpected = sorted(n for n in tensors if n not in want)
    if unexpected:
        raise DraftConfigError(f"{path}: checkpoint tensor(s) {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''} "
                               f"are not part of the {c.layer} drafter its config.json describes, and loading would "
                               f"drop them: {_unexpected_hint(unexpected, c)}")
    missing = [n for n in want if n not in tensors]
    if missing:
        heads = [(what, says) for prefix, what, says in (("markov_head.", "Markov head", "markov_rank 0"),
                                                         ("confidence_head.", "confidence head",
                                                          "enable_confidence_head false"))
                 if any(n.startswith(prefix) for n in missing)]
        hint = (f"; a checkpoint without the {' and '.join(w for w, _ in heads)} (as DeepSpec's DFlash) has a "
                f"config.json saying {' and '.join(s for _, s in heads)}") if heads else ""
        raise DraftConfigError(f"{path}: checkpoint lacks tensor(s) {missing[:6]}{' ...' if len(missing) > 6 else ''} "
                               f"required by its config.json{hint}")
    for n, shape in want.items():
        if tuple(tensors[n].shape) != tuple(shape):
            raise DraftConfigError(f"{path}: tensor {n!r} has shape {tuple(tensors[n].shape)}, the config implies "
                                   f"{tuple(shape)}")
    sd = {n: (t.to(dtype) if t.is_floating_point() else t) for n, t in tensors.items()}
    if not has_frozen:
        if target_embed is None or target_lm_head is None:
            raise DraftConfigError(f"{path}: the checkpoint omits the frozen embedding/LM head "
                                   "(frozen_from_target); pass the target's weights")
        sd["embed_tokens.weight"] = target_embed.to(dtype)
        lm = target_lm_head.to(dtype)
        sd["lm_head.weight"] = lm if "draft_vocab_ids" not in sd else lm[sd["draft_vocab_ids"]]
        for n in ("embed_tokens.weight", "lm_head.weight"):
            want_shape = expected_shapes(c)[n]
            if tuple(sd[n].shape) != want_shape:
                raise DraftConfigError(f"{path}: the target's {n} has shape {tuple(sd[n].shape)}, the drafter's "
                                       f"config implies {want_shape}")
    model = assign_state(lambda: DSparkDraftModel(c), sd, path)
    model.config.frozen_from_target = not has_frozen
    return model


def load_weights_into(model: DSparkDraftModel, path: Path, *, target_embed=None, target_lm_head=None) -> None:
    """Fill ``model`` with the weights of the drafter checkpoint at ``path`` (:func:`load_checkpoint`), e.g. to
    continue training an earlier run's drafter. Raises DraftConfigError when the checkpoint's config differs from
    ``model``'s (naming the fields) or its draft vocabulary does, or as :func:`load_checkpoint`."""
    check_same_config(model.config, path)
    init = load_checkpoint(path, target_embed=target_embed, target_lm_head=target_lm_head)
    if model.draft_vocab_ids is not None and not torch.equal(init.draft_vocab_ids.cpu(), model.draft_vocab_ids.cpu()):
        raise DraftConfigError(f"{path}: the checkpoint's draft vocabulary (draft_vocab_ids) differs from the "
                               "drafter's")
    model.load_state_dict(init.state_dict(), strict=True)


def check_same_config(config: DSparkConfig, path: Path) -> None:
    """Raise DraftConfigError naming the fields in which the ``config.json`` of the checkpoint at ``path`` differs from
    ``config`` (``frozen_from_target`` aside: how the weights are stored, not what they compute)."""
    want, got = config.to_dict(), load_config(Path(path)).to_dict()
    differ = sorted(k for k in set(want) | set(got) if k != "frozen_from_target" and want.get(k) != got.get(k))
    if differ:
        raise DraftConfigError(f"{path}: the checkpoint's config differs from the drafter's in {differ} (drafter: "
                               f"{ {k: want.get(k) for k in differ[:4]} }, checkpoint: "
                               f"{ {k: got.get(k) for k in differ[:4]} })")
