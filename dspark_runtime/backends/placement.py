"""Per-graph placement: which backend / execution provider runs each graph of an engine (e.g. the target on a
TensorRT engine, the draft LM on ONNX Runtime's CUDA provider, the DSpark drafter on the CPU). Pure parsing and
checks; :class:`dspark_runtime.engine.Engine` applies them.

A placement is ``"target=trt,draft=cuda,dspark=cpu"`` (manifest graph key = place; graphs not named run on the CPU)
or one place for all (``"cuda"``; ``"trt"`` puts every graph that has a TensorRT engine on it, the rest on the CPU).
Places: ``cpu`` (ONNX Runtime's CPU provider, the default); ``cuda`` and ``trt-ep`` (ONNX Runtime's CUDA and TensorRT
providers, from the ``onnxruntime-gpu`` package in place of ``onnxruntime``; ``trt-ep`` falls back to CUDA, then the
CPU); ``trt`` (the engine's own TensorRT engine of that graph, ``dspark-export build-trt``:
:class:`~dspark_runtime.backends.trt.decoder.TrtDecoder`, :class:`~dspark_runtime.backends.trt.dspark_graph.TrtDSparkGraph`).
"""
from __future__ import annotations

from dspark_runtime.errors import InputError

PLACES = ("cpu", "cuda", "trt-ep", "trt")
# ONNX Runtime execution providers of each ONNX Runtime place, in the order ONNX Runtime tries them
PROVIDERS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "trt-ep": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
}


def parse_placement(spec: str | dict | None, graphs: dict, trt_graphs=()) -> dict:
    """The place of every graph of an engine.

    Args:
        spec: ``"key=place,..."``, one place for all, a dict {key: place}, or None / "" (every graph on the CPU).
        graphs: {graph key: graph kind} of the engine ("target": "causal_lm", "dspark": "dspark_draft", ...).
        trt_graphs: keys of the graphs that have a TensorRT engine in the manifest.
    Returns:
        {graph key: place} for every key of ``graphs``.
    Raises:
        InputError naming the problem and the fix: a malformed entry, a key the engine has no graph of, a key given
        twice, an unknown place, ``trt`` for a graph without a TensorRT engine (the DSpark drafter's included: its
        engine comes from ``build-trt`` on an fp32 drafter graph).
    """
    trt_graphs = set(trt_graphs)
    if spec is None or spec == "":
        return {k: "cpu" for k in graphs}
    if isinstance(spec, dict):
        pairs = list(spec.items())
    elif "=" not in spec:
        place = _check_place(spec.strip(), "every graph")
        if place == "trt":
            if "target" not in trt_graphs:
                raise InputError("placement 'trt' needs the target's TensorRT engine; build it with "
                                 "`dspark-export build-trt ENGINE`, or place the target on 'cuda' or 'cpu'")
            return {k: "trt" if k in trt_graphs else "cpu" for k in graphs}
        return {k: place for k in graphs}
    else:
        pairs = []
        for item in spec.split(","):
            key, sep, place = item.partition("=")
            if not sep or not key.strip() or not place.strip():
                raise InputError(f"placement entry {item!r} is not key=place (e.g. "
                                 "'target=trt,draft=cuda,dspark=cpu')")
            pairs.append((key.strip(), place.strip()))
    out = {k: "cpu" for k in graphs}
    seen = set()
    for key, place in pairs:
        if key not in graphs:
            raise InputError(f"placement names graph {key!r}, but this engine's graphs are {sorted(graphs)}")
        if key in seen:
            raise InputError(f"placement gives graph {key!r} twice; give each graph one place")
        seen.add(key)
        place = _check_place(place, f"graph {key!r}")
        if place == "trt" and key not in trt_graphs:
            raise InputError(f"graph {key!r} has no TensorRT engine in this engine directory; build one with "
                             f"`dspark-export build-trt ENGINE --graphs {key}`"
                             + (" from an fp32 drafter graph (an int4 one has MatMulNBits, which TensorRT does not "
                                "build)" if graphs[key] == "dspark_draft" else "")
                             + ", or place it on 'cuda' or 'cpu'")
        out[key] = place
    return out


def _check_place(place: str, what: str) -> str:
    if place not in PLACES:
        raise InputError(f"unknown place {place!r} for {what}; choose one of {list(PLACES)} (cpu, cuda: ONNX Runtime "
                         "providers; trt-ep: ONNX Runtime's TensorRT provider; trt: the engine's TensorRT engine)")
    return place


def format_placement(places: dict) -> str:
    """``{"target": "trt", "draft": "cpu"}`` -> ``"target=trt,draft=cpu"`` (the form :func:`parse_placement` reads)."""
    return ",".join(f"{k}={v}" for k, v in places.items())


def trt_engines_run(manifest) -> dict:
    """{graph key: the manifest's TensorRT engine entry the runtime runs for it}, fp32 first when several exist: a
    decoder's capacity-layout engine (``<key>.capacity[.bf16|.fp16]``), the DSpark drafter's growing-layout one
    (``<key>[.bf16|.fp16]``, :class:`~dspark_runtime.backends.trt.dspark_graph.TrtDSparkGraph`). Graph kinds without a
    TensorRT runner (the EAGLE-3 drafter's) have none."""
    engines = manifest.trt_engines
    names = {"causal_lm": ("{}.capacity", "{}.capacity.bf16", "{}.capacity.fp16"),
             "dspark_draft": ("{}", "{}.bf16", "{}.fp16")}
    pick = {key: next((engines[n.format(key)] for n in names.get(g.spec.kind, ()) if n.format(key) in engines
                       and engines[n.format(key)].graph == key), None)
            for key, g in manifest.graphs.items()}
    return {k: e for k, e in pick.items() if e is not None}


def engine_placement(engine_dir, manifest, placement, backend: str, providers) -> dict:
    """{graph key: place} of an engine (``manifest`` of ``engine_dir``) from ``placement`` or the older ``backend``
    ("trt" = every graph with a TensorRT engine on it). Raises InputError for an unknown backend, both given,
    ``providers`` beside a placement, ``backend="trt"`` without a target engine, or a placement
    :func:`parse_placement` refuses."""
    if backend not in ("ort", "trt"):
        raise InputError(f"unknown backend {backend!r}: use 'ort' (ONNX Runtime) or 'trt' (TensorRT)")
    if placement is not None and backend != "ort":
        raise InputError("give either backend='trt' or a placement (placement='trt' is the same), not both")
    if placement is not None and providers:
        raise InputError("give either ONNX Runtime providers (one list for every graph) or a placement, not both")
    kinds = {k: g.spec.kind for k, g in manifest.graphs.items()}
    trt = set(trt_engines_run(manifest))
    if backend == "trt" and "target" not in trt:
        raise InputError(f"{engine_dir} has no TensorRT engine for the target (capacity KV layout); build one with "
                         f"`dspark-export build-trt {engine_dir}` or use backend='ort'")
    return parse_placement("trt" if backend == "trt" else placement, kinds, trt)
