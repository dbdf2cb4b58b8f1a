"""Device graphs for ONNX Runtime's CUDA provider (``dspark-export build-cuda``): for each decoder graph of an
engine directory, its capacity KV-layout variant (:func:`dspark_export.graphs.capacity.to_capacity_layout`: the cache
as fixed-size buffers written in place by the runtime, an ``argmax`` output) and optionally a 16-bit copy
(:func:`dspark_export.graphs.capacity.to_half`), recorded in the manifest's ``device_graphs`` with the buffer sizes they
are run at. The same graphs TensorRT engines are built from (:mod:`dspark_export.engine_dir.trt_build`), without the engine build:
``dspark_runtime.backends.ort_cuda.OrtDeviceDecoder`` runs them on ONNX Runtime's CUDA provider.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from dspark_runtime.backends.trt.profiles import ProfileSettings
from dspark_runtime.engine_dir.graphspec import KV_LAYOUT_CAPACITY, KV_LAYOUT_GROWING, GraphSpec
from dspark_runtime.engine_dir.manifest import DeviceGraphEntry, FileEntry, Manifest, load_manifest
from dspark_runtime.errors import DSparkError

from dspark_export.engine_dir.commit import commit_manifest
from dspark_export.engine_dir.transaction import engine_transaction
from dspark_export.graphs.capacity import HALF_TYPES, run_rewrite, to_capacity_layout, to_half
from dspark_export.graphs.fusions import fuse_file


def derive_capacity_graph(stage: Path, key: str, source_file: str, spec: GraphSpec, half: str | None, run,
                          log=print, half_cache: bool = False) -> tuple[str, GraphSpec, list]:
    """Write ``<key>.capacity.onnx`` (sharing ``source_file``'s weights) and, with ``half``, its 16-bit copy
    ``<key>.capacity.<half>.onnx`` (+ ``.data``) into ``stage`` (an engine transaction's stage, the source linked
    in). ``run(fn, *args)`` runs a conversion (in a fresh process or not). ``half_cache``: with ``half`` "fp16", the
    K/V cache inputs and new-K/V outputs become float16 too (no per-step casts, half the cache memory). Returns (the
    file to run, its GraphSpec, the FileEntry list of the files written). Raises DSparkError for a graph this
    surgery does not know."""
    rel = f"{key}.capacity.onnx"
    cap_spec = to_capacity_layout(stage / source_file, stage / rel, spec)
    files = [FileEntry.of(stage, rel)]
    if half:
        half_rel = rel.removesuffix(".onnx") + f".{half}.onnx"
        log(f"[{key}] converting {rel} to {half} -> {half_rel}")
        cache_io = half_cache and half == "fp16"
        run(to_half, stage / rel, stage / half_rel, half, *((CACHE_PREFIXES,) if cache_io else ()))
        if cache_io:
            cap_spec = _cache_dtype(cap_spec, "float16")
        files += [FileEntry.of(stage, half_rel), FileEntry.of(stage, half_rel + ".data")]
        rel = half_rel
    return rel, cap_spec, files


CACHE_PREFIXES = "past.,new."  # the capacity layout's cache inputs and new-K/V outputs


def _cache_dtype(spec: GraphSpec, dtype: str) -> GraphSpec:
    """``spec`` with the cache tensors (``past.*``, ``new.*``) of ``dtype``."""
    def cast(ts):
        return tuple(replace(t, dtype=dtype) if t.name.startswith(("past.", "new.")) else t for t in ts)
    return replace(spec, inputs=cast(spec.inputs), outputs=cast(spec.outputs))


def build_cuda(engine_dir: Path, profile: ProfileSettings, half: str | None = "fp16", graphs: tuple = (),
               isolate: bool = True, log=print, fuse: bool = True) -> Manifest:
    """Add device graphs of ``graphs`` (default: the target) of the built ``engine_dir`` to its manifest
    (``device_graphs[key]``, replacing an earlier one) for buffers of ``profile`` (max_batch rows, decode_q and
    prefill_chunk call lengths, capacity positions, min_bucket). ``half``: "fp16" (default: the GPU's tensor
    cores, half the weight bytes read per step), "bf16", or None (the source's float32 arithmetic).

    A transaction: the files are recorded only when every graph was written; on any failure the directory is left
    as it was. Raises DSparkError for an unknown key, a graph that is not a growing-layout causal_lm graph (int4
    and scatter-layout CPU engines included: build a growing fp32 engine for the GPU), or bad settings.
    """
    profile.validate()
    if half is not None and half not in HALF_TYPES:
        raise DSparkError(f"--half {half!r}: choose one of {', '.join(HALF_TYPES)} or none")
    engine_dir = Path(engine_dir)
    manifest = load_manifest(engine_dir)
    keys = tuple(graphs) or ("target",)
    for key in keys:
        g = manifest.graphs.get(key)
        if g is None:
            raise DSparkError(f"{engine_dir} has no graph {key!r} (graphs: {', '.join(manifest.graphs)})")
        if g.spec.kind != "causal_lm" or g.spec.kv_layout != KV_LAYOUT_GROWING or g.precision != "fp32":
            raise DSparkError(f"graph {key!r} is a {g.precision} {g.spec.kind} graph with the {g.spec.kv_layout} KV "
                              "layout; device graphs are made from fp32 causal_lm graphs with the growing layout: "
                              "build an engine for the GPU with `dspark-export build RECIPE --precision fp32 "
                              "--kv-layout growing`")
    with engine_transaction(engine_dir) as txn:
        for key in keys:
            g = manifest.graphs[key]
            for f in g.files:
                txn.link(f.path)
            log(f"[{key}] capacity layout{f', {half}' if half else ''} for {profile.max_batch} rows, "
                f"{profile.capacity} positions")
            rel, spec, files = derive_capacity_graph(txn.stage, key, g.model_file, g.spec, half,
                                                     lambda fn, *a: run_rewrite(fn, isolate, *a), log, half_cache=True)
            if fuse:  # the projections are merged only where the graph owns its weight file (a 16-bit copy)
                done = fuse_file(txn.stage / rel, profile.capacity, merge=bool(half))
                log(f"[{key}] {done['rotary']} rotary embeddings fused into RotaryEmbedding, {done['shapes']} cache "
                    f"shape reads shared, {done['merged']} projection groups merged")
                files = [FileEntry.of(txn.stage, f.path) for f in files]
            manifest.device_graphs[key] = DeviceGraphEntry(
                graph=key, kv_layout=KV_LAYOUT_CAPACITY, onnx=rel, files=files, precision=half or "fp32",
                profile_settings=profile.to_json(), spec=spec)
        commit_manifest(txn, manifest)
    return manifest
