"""Token embedding rows for drafters that take embeddings as inputs (DSpark's anchor, EAGLE-3's tokens):
:class:`EmbeddingRows`, a table [vocab, hidden] kept in a file (the target graph's external data, or a file of the
drafter's own) and memory-mapped read-only, so a lookup reads only the rows it touches and the drafter adds no copy
of the table to the process (0.93 GB fp32 for Qwen2.5-1.5B).

A table is stored raw (``dtype`` "float32" / "float16", row-major) or block-coded (``dtype`` "blocks": the GGUF's
own blocks as the int4 target graph decodes them, :mod:`dspark_export.precision.gguf_embedding`): unsigned codes of
``bits`` 4 (two per byte, the even column in the low nibble) or 8, and per block of ``size`` columns a float32 scale
and, for affine types, a float32 offset; a value is ``(code − zero_point) · scale − offset``, computed in float32 as
the graph computes it, so both give the same rows bit for bit.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from dspark_runtime.errors import DSparkError

RAW_DTYPES = {"float32": np.float32, "float16": np.float16}
BLOCKS = "blocks"  # the dtype of a block-coded table


class EmbeddingRows:
    """Rows of an embedding table [vocab, hidden] in a file, memory-mapped read-only (module docstring).

    Args:
        path: the file; offset: bytes before the table (a block-coded table: before its codes); dtype: "float32",
        "float16" or "blocks"; shape: (vocab, hidden); blocks: for "blocks", {"bits": 4 | 8, "size": columns per
        block, "zero_point": int, "scales_offset": bytes before the float32 scales [vocab, hidden / size],
        "offsets_offset": the same for the float32 offsets, or None}.
    Raises DSparkError when the file is missing or shorter than the table needs (a truncated or foreign file),
    naming the file and the fix, or for a dtype or block layout this runtime does not know.
    """

    def __init__(self, path: str | Path, offset: int, dtype: str, shape, blocks: dict | None = None):
        path = Path(path)
        vocab, hidden = (int(x) for x in shape)
        size = path.stat().st_size if path.is_file() else -1
        self.path, self.shape, self._codes = path, (vocab, hidden), None  # _codes: None for a raw table

        def mapped(at: int, dt, cols: int):
            need = at + vocab * cols * np.dtype(dt).itemsize
            if size < need:
                raise DSparkError(f"the drafter's embedding table {path} is "
                                  f"{'missing' if size < 0 else f'{size} bytes, shorter than the {need} it needs'} "
                                  "(the embedding entry of manifest.json's speculation section); re-run "
                                  "`dspark-export add-draft`")
            return np.memmap(path, dtype=np.dtype(dt).newbyteorder("<"), mode="r", offset=at, shape=(vocab, cols))

        if dtype in RAW_DTYPES:
            self._table = mapped(offset, RAW_DTYPES[dtype], hidden)
            return
        b = blocks or {}
        bits, bsize = b.get("bits"), b.get("size")
        if not (dtype == BLOCKS and bits in (4, 8) and isinstance(bsize, int) and bsize > 0 and hidden % bsize == 0
                and (bits == 8 or hidden % 2 == 0)):
            raise DSparkError(f"embedding table {path}: dtype {dtype!r} with blocks {blocks!r} is not a layout this "
                              "runtime reads (float32, float16, or blocks of 4- or 8-bit codes); update dspark or "
                              "re-run `dspark-export add-draft`")
        n_blocks = hidden // bsize
        self._bits, self._size, self._zero = bits, bsize, float(b.get("zero_point", 0))
        self._codes = mapped(offset, np.uint8, hidden // 2 if bits == 4 else hidden)
        self._scales = mapped(b["scales_offset"], np.float32, n_blocks)
        off = b.get("offsets_offset")
        self._offsets = None if off is None else mapped(off, np.float32, n_blocks)

    @classmethod
    def from_manifest(cls, engine_dir: Path, entry: dict) -> "EmbeddingRows":
        """From an ``embedding`` entry of the manifest's speculation section
        (:class:`~dspark_runtime.engine_dir.speculation.DSparkSection`)."""
        return cls(Path(engine_dir) / entry["file"], entry["offset"], entry["dtype"], entry["shape"],
                   entry.get("blocks"))

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """float32 [*ids.shape, hidden] for int ids of any shape. Raises DSparkError for an id outside the table."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.shape[0]):
            raise DSparkError(f"token id {int(ids.max() if ids.max() >= self.shape[0] else ids.min())} is outside the "
                              f"drafter's embedding table ({self.shape[0]} rows)")
        return self._decode(ids.reshape(-1)).reshape(ids.shape + (self.shape[1],))

    def table(self) -> np.ndarray:
        """The whole table, float32 [vocab, hidden] (in memory: for export-time comparisons, not for decoding)."""
        return self._decode(np.arange(self.shape[0]))

    def _decode(self, ids: np.ndarray) -> np.ndarray:
        if self._codes is None:
            return np.asarray(self._table[ids], dtype=np.float32)
        return decode_blocks(np.asarray(self._codes[ids]), np.asarray(self._scales[ids]),
                             None if self._offsets is None else np.asarray(self._offsets[ids]),
                             self._bits, self._size, self._zero)


def decode_blocks(codes: np.ndarray, scales: np.ndarray, offsets, bits: int, size: int, zero_point) -> np.ndarray:
    """Rows of a block-coded table, float32 [n, hidden]: codes uint8 [n, hidden/2] (4 bits, the even column in the
    low nibble) or [n, hidden] (8 bits); scales, offsets float32 [n, hidden/size] (offsets may be None): ``(code −
    zero_point) · scale − offset`` in float32, one rounding per operation (what the int4 target graph computes,
    :mod:`dspark_export.precision.gguf_embedding`, and gguf-py's dequantization)."""
    n = len(codes)
    c = np.stack([codes & 15, codes >> 4], axis=-1).reshape(n, -1) if bits == 4 else codes
    q = c.astype(np.float32).reshape(n, -1, size)
    if zero_point:
        q = q - np.float32(zero_point)
    w = q * scales[..., None]
    if offsets is not None:
        w = w - offsets[..., None]
    return w.reshape(n, -1)
