"""Block-coded embedding tables (dspark_runtime/drafting/embedding_rows.py): rows decoded from codes, scales and
offsets in a file, as the int4 target graph decodes its GGUF-coded table; the manifest entry that names them."""
import numpy as np
import pytest

from dspark_runtime.drafting.embedding_rows import EmbeddingRows
from dspark_runtime.errors import DSparkError


def _write(path, arrays):
    """Write ``arrays`` one after another with 64 bytes of padding before each; returns their offsets."""
    offsets = []
    with open(path, "wb") as f:
        for a in arrays:
            f.write(b"\xff" * 64)
            offsets.append(f.tell())
            f.write(np.ascontiguousarray(a).tobytes())
    return offsets


@pytest.mark.parametrize("bits,size,zero_point,affine", [(4, 32, 0, True), (8, 16, 32, False), (4, 32, 8, False)])
def test_block_coded_rows_decode_code_minus_zero_point_times_scale_minus_offset(tmp_path, bits, size, zero_point,
                                                                                affine):
    rng = np.random.default_rng(bits + size)
    vocab, hidden = 37, 64
    codes = rng.integers(0, 1 << bits, (vocab, hidden)).astype(np.uint8)
    scales = rng.uniform(1e-4, 1e-2, (vocab, hidden // size)).astype(np.float32)
    offsets = rng.uniform(0, 1e-2, (vocab, hidden // size)).astype(np.float32) if affine else None
    stored = codes[:, 0::2] | (codes[:, 1::2] << 4) if bits == 4 else codes  # two codes a byte, the even one low
    at = _write(tmp_path / "t.bin", [stored, scales] + ([offsets] if affine else []))
    entry = {"file": "t.bin", "offset": at[0], "dtype": "blocks", "shape": [vocab, hidden],
             "blocks": {"bits": bits, "size": size, "zero_point": zero_point, "scales_offset": at[1],
                        "offsets_offset": at[2] if affine else None}}
    table = EmbeddingRows.from_manifest(tmp_path, entry)
    want = np.empty((vocab, hidden), np.float32)  # element by element, in float32
    for v in range(vocab):
        for j in range(hidden):
            x = np.float32(int(codes[v, j]) - zero_point) * scales[v, j // size]
            want[v, j] = x - offsets[v, j // size] if affine else x
    np.testing.assert_array_equal(table.table(), want)
    ids = np.array([[3, 0], [36, 3]])
    np.testing.assert_array_equal(table.rows(ids), want[ids])
    with pytest.raises(DSparkError, match="outside"):
        table.rows(np.array([vocab]))
    with pytest.raises(DSparkError, match="shorter than"):
        EmbeddingRows(tmp_path / "t.bin", at[0], "blocks", (vocab * 4, hidden), entry["blocks"])
    with pytest.raises(DSparkError, match="not a layout this runtime reads"):
        EmbeddingRows(tmp_path / "t.bin", at[0], "blocks", (vocab, hidden), {**entry["blocks"], "bits": 3})


def test_the_manifest_checks_a_block_coded_embedding_entry():
    from dspark_runtime.engine_dir.speculation import _CHECKS

    ok = _CHECKS["embedding"][1]
    entry = {"file": "target.onnx.data", "offset": 4096, "dtype": "blocks", "shape": [10, 64],
             "blocks": {"bits": 4, "size": 32, "zero_point": 0, "scales_offset": 8192, "offsets_offset": None}}
    assert ok(entry) and ok({**entry, "dtype": "float32", "blocks": None})
    assert not ok({**entry, "blocks": None})  # blocks without their layout
    assert not ok({**entry, "blocks": {**entry["blocks"], "bits": 2}})
    assert not ok({**entry, "blocks": {**entry["blocks"], "scales_offset": -1}})
