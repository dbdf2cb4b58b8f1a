"""Export parity: the ONNX decoder graph vs the torch model, on tiny random Qwen2 and Llama."""
import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_export_matches_torch_with_dynamic_axes(family, tmp_path):
    from tests.fixtures.tiny_models import make_pair

    from dspark_export.graphs.decoder import decoder_dims, export_decoder, load_hf_model, torch_reference, validate_decoder
    from dspark_runtime.backends.ort import OrtDecoder
    from dspark_runtime.runners.kvcache import causal_mask

    tdir, _ = make_pair(tmp_path, family=family)
    model = load_hf_model(tdir)
    dims = decoder_dims(model.config, (-1, 0))
    spec = export_decoder(model, dims, tmp_path / "g.onnx")
    # names and dynamic axes come from the declaration
    proto = onnx.load(str(tmp_path / "g.onnx"), load_external_data=False)
    assert [i.name for i in proto.graph.input] == spec.input_names
    assert [o.name for o in proto.graph.output] == spec.output_names
    mask_dims = [d.dim_param or d.dim_value for d in proto.graph.input[2].type.tensor_type.shape.dim]
    assert mask_dims == ["batch", 1, "q_len", "total_len"]
    rep = validate_decoder(torch_reference(model, dims, list(range(5, 25))), dims, tmp_path / "g.onnx")
    assert rep.prefill_max_abs_logit_diff < 1e-4 and rep.verify_max_abs_logit_diff < 1e-4
    assert rep.prefill_argmax_agreement == 1.0 and rep.verify_argmax_agreement == 1.0
    assert rep.features_max_abs_diff is not None and rep.features_max_abs_diff < 1e-4

    # batch 3 with a ragged (left-padded) row, past 0 then q=1 decode: sizes never seen in tracing
    dec = OrtDecoder(tmp_path / "g.onnx", spec).activate()
    ids = np.array([[11, 12, 13, 14], [21, 22, 23, 24], [0, 0, 31, 32]], dtype=np.int64)
    mask = np.repeat(causal_mask(4, 0), 3, axis=0).copy()
    mask[2, :, :, :2] = False  # padding keys invisible to row 2
    mask[2, 0, 0, 0] = mask[2, 0, 1, 1] = True  # pad queries see themselves (avoid all -inf rows)
    pos = np.array([[0, 1, 2, 3], [0, 1, 2, 3], [0, 0, 0, 1]], dtype=np.int64)
    out = dec.step(ids, pos, mask, dec.empty_kv(3))
    with torch.no_grad():
        ref0 = model(torch.tensor(ids[:1])).logits[0].numpy()
        ref2 = model(torch.tensor(ids[2:, 2:])).logits[0].numpy()
    assert np.abs(out.logits[0] - ref0).max() < 1e-4
    assert np.abs(out.logits[2, 2:] - ref2).max() < 1e-4
    step_mask = np.ones((3, 1, 1, 5), dtype=bool)
    step_mask[2, 0, 0, :2] = False  # row 2 still ignores its padding
    step = dec.step(np.array([[15], [25], [33]]), np.array([[4], [4], [2]]), step_mask, out.kv)
    with torch.no_grad():
        ref_next = model(torch.tensor([[31, 32, 33]])).logits[0, -1].numpy()
    assert np.abs(step.logits[2, 0] - ref_next).max() < 1e-4
    assert step.kv[0][0].shape == (3, dims.num_kv_heads, 5, dims.head_dim)
    # grouped-query attention: the cache's KV heads are never repeated (no Expand in the graph)
    assert not [n for n in proto.graph.node if n.op_type == "Expand"]
    # every RMSNorm is one fused node after ONNX Runtime's graph optimizations (2 per layer + the final norm)
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(str(tmp_path / "g.onnx"), so)
    fused = onnx.load(str(tmp_path / "opt.onnx"), load_external_data=False).graph.node
    assert sum(n.op_type == "SimplifiedLayerNormalization" for n in fused) == 2 * dims.num_layers + 1
    assert not [n for n in fused if n.op_type in ("Reciprocal", "Pow")]


def test_grouped_attention_equals_eager_attention():
    """The export's grouped form is transformers' eager attention (repeat_kv), to float rounding."""
    from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward

    from dspark_export.graphs.decoder import grouped_query_attention

    g = torch.Generator().manual_seed(0)
    b, h, kv, q, t, d = 2, 6, 2, 3, 7, 16
    query, key, value = (torch.randn(b, n, s, d, generator=g) for n, s in ((h, q), (kv, t), (kv, t)))
    mask = torch.zeros(b, 1, q, t)
    mask[1, :, :, :2] = torch.finfo(torch.float32).min  # row 1: two padding keys
    mask[:, :, 0, -2:] = torch.finfo(torch.float32).min  # causal-style: query 0 cannot see the last 2

    class M(torch.nn.Module):
        num_key_value_groups = h // kv
        training = False

    want, _ = eager_attention_forward(M(), query, key, value, mask, scaling=d ** -0.5)
    got, _ = grouped_query_attention(M(), query, key, value, mask, scaling=d ** -0.5)
    assert got.shape == want.shape == (b, q, h, d)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)
    assert not torch.equal(got[0], got[1])  # the masks mattered


def test_feature_layer_out_of_range_is_a_clear_error(tiny_pair):
    from dspark_export.graphs.decoder import decoder_dims, load_hf_model
    from dspark_runtime.errors import DSparkError

    model = load_hf_model(tiny_pair[0])
    with pytest.raises(DSparkError, match="feature layer 5 out of range"):
        decoder_dims(model.config, (5,))


def test_precision_spec_parsing():
    from dspark_export.engine_dir.build import Recipe
    from dspark_runtime.errors import DSparkError

    r = Recipe(name="x", target="t", precision="target=fp32,draft=int8-dynamic")
    assert r.precision_for("target") == "fp32" and r.precision_for("draft") == "int8-dynamic"
    assert Recipe(name="x", target="t", precision="int8-dynamic").precision_for("target") == "int8-dynamic"
    assert Recipe(name="x", target="t", precision="draft=int8-dynamic").precision_for("target") == "fp32"
    with pytest.raises(DSparkError, match="not supported; choose one of fp32, int4, int8, int8-trt, int8-dynamic, fp8"):
        Recipe(name="x", target="t", precision="int3").validate()
    with pytest.raises(DSparkError, match="role=value pairs such as 'target=int8,draft=fp32'"):
        Recipe(name="x", target="t", precision="verifier=fp32").validate()
    r = Recipe(name="x", target="t", precision="int4", int4_source="target=gguf,draft=rtn")
    assert (r.int4_source_for("target"), r.int4_source_for("draft")) == ("gguf", "rtn")
    assert Recipe(name="x", target="t", int4_source="draft=hqq").int4_source_for("target") == "auto"
    with pytest.raises(DSparkError, match="int4 source 'gptq' is not supported; choose one of auto, gguf, gguf-compact, gguf-kernel, rtn, hqq"):
        Recipe(name="x", target="t", int4_source="gptq").validate()


def test_int8_dynamic_draft_engine_is_exact(tiny_pair, tmp_path):
    """A quantized draft changes only the speed and acceptance, never the output."""
    from dspark_export.engine_dir.build import Recipe, build_engine
    from dspark_runtime import Engine

    tdir, ddir = tiny_pair
    m = build_engine(Recipe(name="q", target=str(tdir), draft=str(ddir), precision="draft=int8-dynamic"),
                     tmp_path / "q", isolate=False, log=lambda *a: None)
    d = m.graphs["draft"]
    assert d.precision == "int8-dynamic" and set(d.validation) == {"fp32", "int8-dynamic"}
    assert d.validation["fp32"]["verify_argmax_agreement"] == 1.0
    assert 0.0 < d.validation["int8-dynamic"]["prefill_max_abs_logit_diff"]  # quantization changed the logits
    assert sorted(p.name for p in (tmp_path / "q").iterdir() if p.name.startswith("draft")) == [
        "draft.onnx", "draft.onnx.data"]  # the fp32 intermediate is gone
    import onnx

    ops = {n.op_type for n in onnx.load(str(tmp_path / "q" / "draft.onnx"), load_external_data=False).graph.node}
    assert "MatMulInteger" in ops or "DynamicQuantizeMatMul" in ops
    eng = Engine.load(tmp_path / "q", threads=1)
    ref = eng.generate("def add(a, b):", max_new_tokens=32, draft=None)
    spec = eng.generate("def add(a, b):", max_new_tokens=32, draft="lm", draft_length=4)
    assert spec.token_ids == ref.token_ids and spec.stats.accepted > 0
