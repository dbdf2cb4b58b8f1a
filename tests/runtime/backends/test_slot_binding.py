"""The kept IOBinding of a scatter graph with slot outputs (dspark_runtime/backends/slot_binding.py): results equal to
the same graph run without slot outputs, no output shared between calls, buffers rebound when the caller passes other
memory, and the new entries read back from the written buffers."""
from dataclasses import replace

import numpy as np
import pytest


@pytest.fixture(scope="module")
def scatter(tmp_path_factory):
    """A tiny Qwen2 target in the scatter layout with slot outputs: (in place, copying) OrtDecoders of it, the
    copying one over the same graph file with the slot outputs left out of its spec (the runner writes back)."""
    from tests.fixtures.tiny_models import make_pair

    from dspark_export.graphs.decoder import decoder_dims, export_decoder, load_hf_model
    from dspark_runtime.backends.ort import OrtDecoder
    from dspark_runtime.engine_dir.graphspec import slot_names

    root = tmp_path_factory.mktemp("slot_binding")
    target, _ = make_pair(root)
    model = load_hf_model(target)
    spec = export_decoder(model, decoder_dims(model.config, (0,)), root / "s.onnx", kv_layout="scatter")
    slots = {n for pair in slot_names(spec.dims.num_layers) for n in pair}
    copying = replace(spec, outputs=tuple(t for t in spec.outputs if t.name not in slots))
    return (OrtDecoder(root / "s.onnx", spec, threads=1).activate(),
            OrtDecoder(root / "s.onnx", copying, threads=1).activate())


def _buffers(dec, rows: int, slots: int, seed: int) -> list:
    d = dec.spec.dims
    r = np.random.default_rng(seed)
    return [tuple(r.standard_normal((rows, d.num_kv_heads, slots, d.head_dim)).astype(np.float32) for _ in "kv")
            for _ in range(d.num_layers)]


def _call(dec, kv, ids, pos):
    slots = kv[0][0].shape[2]
    mask = np.arange(slots)[None, None, None, :] <= pos[:, None, :, None]
    return dec.step(np.asarray(ids, np.int64), np.asarray(pos, np.int64), mask, kv)


def test_kept_binding_matches_the_copying_graph_and_shares_no_output(scatter):
    """Three calls on the same buffers (the binding kept), then one on other buffers (rebound): logits, features and
    new entries equal the copying graph's bit for bit, the caller's buffers hold the new entries at their positions,
    an earlier call's logits are not overwritten by a later call, and the first buffers are untouched by the last."""
    in_place, copying = scatter
    kv_a, ref_a = _buffers(in_place, 2, 16, 0), _buffers(in_place, 2, 16, 0)
    kv_b, ref_b = _buffers(in_place, 2, 16, 1), _buffers(in_place, 2, 16, 1)
    calls = [(kv_a, ref_a, [[5, 6], [7, 8]], [[3, 4], [9, 10]]), (kv_a, ref_a, [[9, 1], [2, 3]], [[5, 6], [11, 12]]),
             (kv_a, ref_a, [[4, 4], [5, 5]], [[7, 8], [0, 1]]), (kv_b, ref_b, [[6, 2], [1, 9]], [[2, 3], [4, 5]])]
    kept = []
    for kv, ref, ids, pos in calls:
        pos = np.asarray(pos)
        got, want = _call(in_place, kv, ids, pos), _call(copying, ref, ids, pos)
        assert got.kv_written and not want.kv_written
        np.testing.assert_array_equal(got.logits, want.logits)
        np.testing.assert_array_equal(got.features, want.features)
        assert len(got.kv) == len(want.kv) == in_place.spec.dims.num_layers
        for layer, ((k, v), (nk, nv), (gk, gv)) in enumerate(zip(kv, want.kv, got.kv)):
            np.testing.assert_array_equal(gk, nk)
            np.testing.assert_array_equal(gv, nv)
            for row in range(2):  # the runner's write-back, done by hand on the reference buffers
                ref[layer][0][row][:, pos[row]] = nk[row]
                ref[layer][1][row][:, pos[row]] = nv[row]
            np.testing.assert_array_equal(k, ref[layer][0])
            np.testing.assert_array_equal(v, ref[layer][1])
        kept.append((got.logits, want.logits.copy()))
    np.testing.assert_array_equal(got.kv[-1][0], want.kv[-1][0])
    for logits, first_seen in kept:
        np.testing.assert_array_equal(logits, first_seen)  # a negative index reads the last layer


def test_a_non_contiguous_buffer_is_written_into_a_copy(scatter):
    """A past array that is not C-contiguous is bound as a copy: the caller's array is unchanged, kv_written is False,
    and the new entries still come back (read from the copy)."""
    in_place, copying = scatter
    kv = _buffers(in_place, 4, 16, 2)
    views = [(k[::2], v[::2]) for k, v in kv]  # rows 0 and 2: strided, not contiguous
    before = [(k.copy(), v.copy()) for k, v in kv]
    pos = np.array([[1, 2], [6, 7]])
    got = _call(in_place, views, [[3, 4], [5, 6]], pos)
    want = _call(copying, [(np.ascontiguousarray(k), np.ascontiguousarray(v)) for k, v in views], [[3, 4], [5, 6]], pos)
    assert not got.kv_written
    np.testing.assert_array_equal(got.logits, want.logits)
    for (k, v), (bk, bv), (gk, _), (nk, _) in zip(kv, before, got.kv, want.kv):
        np.testing.assert_array_equal(k, bk)
        np.testing.assert_array_equal(v, bv)
        np.testing.assert_array_equal(gk, nk)


def test_a_call_that_finds_the_binding_busy_runs_on_its_own(scatter):
    """While another thread holds the kept binding, a call runs on a binding of its own, writing in place all the
    same, with the results of the copying graph."""
    in_place, copying = scatter
    kv, ref = _buffers(in_place, 1, 16, 3), _buffers(in_place, 1, 16, 3)
    first = _call(in_place, kv, [[1]], np.array([[0]]))  # makes the kept binding
    for (k, v), (nk, nv) in zip(ref, _call(copying, ref, [[1]], np.array([[0]])).kv):
        k[:, :, :1], v[:, :, :1] = nk, nv
    assert first.kv_written
    binding = in_place._slot_binding
    with binding._lock:
        got = _call(in_place, kv, [[2]], np.array([[1]]))
    want = _call(copying, ref, [[2]], np.array([[1]]))
    assert got.kv_written and in_place._slot_binding is binding
    np.testing.assert_array_equal(got.logits, want.logits)
    np.testing.assert_array_equal(kv[0][0][:, :, 1], want.kv[0][0][:, :, 0])
