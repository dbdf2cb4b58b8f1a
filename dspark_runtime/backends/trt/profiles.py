"""TensorRT optimisation profiles, capacity buckets and KV buffer sizes, derived from the one declaration of graph
axes (:mod:`dspark_runtime.engine_dir.graphspec`). Pure Python (no TensorRT, no GPU): ``dspark-export build-trt``
and the runtime's device backends share it.

Two profiles per graph (one spanning prefill chunks and 1-token decode picks kernels poor for both): ``prefill``,
``q_len`` 1 .. ``prefill_chunk`` (opt the chunk), batch 1 .. ``max_batch`` (opt 1); ``decode``, ``q_len`` 1 ..
``decode_q`` = γ + 1 (opt ``decode_q``), batch 1 .. ``max_batch`` (opt ``max_batch``). The DSpark drafter's
``new_len`` follows ``q_len``'s rules. The cache axis spans 0 .. ``capacity`` (growing layout: ``past_len``, opt half
the capacity; capacity layout: the buckets ``min_bucket .. capacity``, opt the largest); derived axes follow their
parts as :data:`~dspark_runtime.engine_dir.graphspec.DERIVED_AXES` declares.
"""
from __future__ import annotations

from dataclasses import dataclass

from dspark_runtime.errors import DSparkError
from dspark_runtime.engine_dir.graphspec import (BATCH, CAPACITY, KV_LAYOUT_CAPACITY, NEW_LEN, PAST_LEN, Q_LEN, GraphSpec,
                                      resolve_axes)

PROFILE_PREFILL, PROFILE_DECODE = "prefill", "decode"


@dataclass(frozen=True)
class ProfileSettings:
    """What the engine must accept.

    max_batch:     most sequences per call (>= 1).
    decode_q:      most tokens per decode/verify call, γ + 1 (>= 1).
    prefill_chunk: most tokens per prefill call (>= decode_q).
    capacity:      most cached positions per sequence (KV buffer length, tokens; >= prefill_chunk).
    min_bucket:    smallest capacity bucket of the capacity layout (tokens; buckets double up to capacity).
    """

    max_batch: int = 1
    decode_q: int = 8
    prefill_chunk: int = 256
    capacity: int = 4096
    min_bucket: int = 256

    def validate(self) -> None:
        """Raise DSparkError naming the bad field and the fix."""
        for k in ("max_batch", "decode_q", "prefill_chunk", "capacity", "min_bucket"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise DSparkError(f"TensorRT profile setting {k} must be a positive integer, got {v!r}")
        if self.prefill_chunk < self.decode_q:
            raise DSparkError(f"prefill_chunk ({self.prefill_chunk}) must be >= decode_q ({self.decode_q}); "
                              "raise --trt-prefill-chunk or lower the draft length")
        if self.capacity < self.prefill_chunk:
            raise DSparkError(f"capacity ({self.capacity}) must be >= prefill_chunk ({self.prefill_chunk}); "
                              "raise --trt-capacity or lower --trt-prefill-chunk")

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in ("max_batch", "decode_q", "prefill_chunk", "capacity", "min_bucket")}


def capacity_buckets(capacity: int, min_bucket: int = 256) -> list[int]:
    """Capacity buckets (tokens): ``min_bucket``, doubling, capped at and always ending with ``capacity``.

    >>> capacity_buckets(1000, 256)
    [256, 512, 1000]
    """
    if capacity < 1 or min_bucket < 1:
        raise DSparkError(f"capacity ({capacity}) and min_bucket ({min_bucket}) must be positive")
    out, b = [], min(min_bucket, capacity)
    while b < capacity:
        out.append(b)
        b *= 2
    return out + [capacity]


def choose_bucket(needed: int, buckets: list[int]) -> int:
    """The smallest bucket holding ``needed`` positions (cached + this step's). Raises DSparkError when
    even the largest cannot: the sequence has outgrown the engine's capacity."""
    for b in buckets:
        if b >= needed:
            return b
    raise DSparkError(f"the sequence needs {needed} KV positions but the engine's capacity is {buckets[-1]}; "
                      "rebuild the TensorRT engine with a larger --trt-capacity or shorten the request")


def _axis_ranges(spec: GraphSpec, s: ProfileSettings, profile: str) -> dict:
    """(min, opt, max) per base axis name for ``profile``."""
    q_max = s.prefill_chunk if profile == PROFILE_PREFILL else s.decode_q
    q = (1, q_max, q_max)
    batch = (1, 1, s.max_batch) if profile == PROFILE_PREFILL else (1, s.max_batch, s.max_batch)
    if spec.kv_layout == KV_LAYOUT_CAPACITY:
        buckets = capacity_buckets(s.capacity, s.min_bucket)
        cache = (buckets[0], buckets[-1], buckets[-1])
    else:
        cache = (0, s.capacity // 2, s.capacity)
    return {BATCH: batch, Q_LEN: q, NEW_LEN: q, PAST_LEN: cache, CAPACITY: cache}


def derive_profiles(spec: GraphSpec, settings: ProfileSettings) -> list[dict]:
    """The optimisation profiles of ``spec``: ``[{"name": "prefill"|"decode", "shapes": {input name:
    {"min": [...], "opt": [...], "max": [...]}}}]``, every dynamic axis of every input resolved: the base axes by
    the rules of this module, the derived ones (``total_len``, ``kv_len``, the DSpark drafter's ``ctx_len`` and
    ``mask_len = past_len + new_len + block``) by :func:`dspark_runtime.engine_dir.graphspec.resolve_axes`.

    Raises DSparkError when an input has an axis this module cannot size (a graph declaration and this
    code out of step).
    """
    settings.validate()
    out = []
    for name in (PROFILE_PREFILL, PROFILE_DECODE):
        ranges = resolve_axes(spec, _axis_ranges(spec, settings, name))
        shapes = {}
        for t in spec.inputs:
            mom = {}
            for j, key in enumerate(("min", "opt", "max")):
                dims = []
                for ax in t.shape:
                    if isinstance(ax, int):
                        dims.append(ax)
                    elif ax in ranges:
                        dims.append(int(ranges[ax][j]))
                    else:
                        raise DSparkError(f"input {t.name} of the {spec.kind} graph has axis {ax!r} that no "
                                          "TensorRT profile rule sizes; extend dspark_runtime.backends.trt.profiles (base "
                                          "axes) or graphspec.DERIVED_AXES (sums of axes)")
                mom[key] = dims
            shapes[t.name] = mom
        out.append({"name": name, "shapes": shapes})
    return out


def pick_profile(profiles: list[dict], input_shapes: dict) -> int:
    """Index of the first profile whose [min, max] contains every given input shape, preferring the
    ``decode`` profile for shapes both accept (its kernels are tuned for few tokens).

    input_shapes: {input name: tuple of ints}. Raises DSparkError naming the tensor and shape when no
    profile accepts them.
    """
    order = sorted(range(len(profiles)), key=lambda i: profiles[i]["name"] != PROFILE_DECODE)
    for i in order:
        shapes = profiles[i]["shapes"]
        if all(name in shapes and len(shp) == len(shapes[name]["min"]) and
               all(lo <= d <= hi for d, lo, hi in zip(shp, shapes[name]["min"], shapes[name]["max"]))
               for name, shp in input_shapes.items()):
            return i
    bad = []
    for name, shp in input_shapes.items():
        ranges = [(p["shapes"][name]["min"], p["shapes"][name]["max"]) for p in profiles if name in p["shapes"]]
        bad.append(f"{name} {tuple(shp)} (profiles: {'; '.join(f'{lo}..{hi}' for lo, hi in ranges)})")
    raise DSparkError("no TensorRT optimisation profile accepts these input shapes: " + ", ".join(bad) +
                      "; rebuild the engine with larger --trt-max-batch / --trt-prefill-chunk / --trt-capacity")


def kv_buffer_bytes(num_layers: int, num_kv_heads: int, head_dim: int, batch: int, capacity: int,
                    itemsize: int = 4) -> int:
    """Bytes of the static KV buffers: keys and values of every layer, [batch, kv_heads, capacity, head_dim]
    of ``itemsize``-byte elements (float32: 4)."""
    return 2 * num_layers * batch * num_kv_heads * capacity * head_dim * itemsize
