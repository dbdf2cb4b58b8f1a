"""Activation ranges for static QDQ quantization (:func:`calibrate_graph`, ``dspark-export calibrate-quant``): an fp32
decoder graph run over calibration-split prompts in the shapes the runtime runs.

Per prompt: a prefill (past 0), greedy decode steps (q = 1 on the cache) and the same tokens as one verify chunk on
the prompt's cache (a table of verify steps alone misses the prefill's larger activations). For the input of every
weight MatMul the running min and max over all steps are kept (MinMax: ReduceMin/ReduceMax added to a weightless copy
of the graph, which ONNX Runtime runs over the original external weights, so the weights are held once). The result
is a :class:`CalibrationTable` whose ``data_id`` is the sha256 of every token id fed and ``graph_sha256`` the graph it
was measured on. Calibration prompts only (:func:`calibration_token_ids`), never evaluation prompts.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dspark_runtime.engine_dir.integrity import sha256_file
from dspark_runtime.errors import DSparkError

from dspark_export.drafter.data import calibration_prompts
from dspark_export.graphs.onnx_io import peak_rss_gb, quant_targets, session_over_weights

CALIBRATION_METHOD = "minmax"
# where calibration_token_ids' prompts come from (a table's and a manifest's ``prompts`` record)
CALIBRATION_NOTE = ("calibration split (dspark_export/data/prompts/README.md: mbpp lines 181-200, gsm8k 901-1000, "
                    "math500 351-400; mbpp, gsm8k, mbpp, math500 in turn)")


@dataclass
class CalibrationTable:
    """Activation ranges for static quantization of one graph.

    ranges: activation tensor name -> [min, max] (float, over all calibration steps);
    data_id: sha256 (hex) of the token ids fed, in order; steps: [{"kind": "prefill"|"decode"|"verify",
    "q": int, "past": int}] per step; prompts: where the prompts came from; graph_sha256: the fp32 graph
    (``.onnx`` file, not the weights) it was measured on.
    """

    ranges: dict
    data_id: str
    steps: list
    prompts: str
    method: str = CALIBRATION_METHOD
    graph_sha256: str = ""
    seconds: float = 0.0
    peak_rss_gb: float = 0.0
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return dict(self.__dict__)

    def summary(self) -> dict:
        """What the manifest records (no per-tensor ranges)."""
        kinds = {}
        for s in self.steps:
            kinds.setdefault(s["kind"], []).append(s["q"])
        return {"data_id": self.data_id, "method": self.method, "prompts": self.prompts,
                "steps": {k: {"count": len(v), "q_min": min(v), "q_max": max(v)} for k, v in kinds.items()},
                "tensors": len(self.ranges)}

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @staticmethod
    def load(path: Path) -> "CalibrationTable":
        """Read a table written by :meth:`save`; DSparkError if missing or malformed."""
        path = Path(path)
        if not path.is_file():
            raise DSparkError(f"calibration table {path} not found; make one with `dspark-export calibrate-quant`")
        try:
            return CalibrationTable(**json.loads(path.read_text()))
        except (ValueError, TypeError) as e:
            raise DSparkError(f"{path} is not a calibration table ({e}); make one with "
                              "`dspark-export calibrate-quant`") from e


def calibration_token_ids(tokenizer, n_prompts: int, max_len: int = 256) -> list:
    """Token ids of ``n_prompts`` calibration-split prompts (chat-templated when the tokenizer has a
    template), each cut to its first ``max_len`` tokens. Returns a list of int lists."""
    if n_prompts < 1:
        raise DSparkError(f"calibration needs at least one prompt, got {n_prompts}")
    out = []
    for p in calibration_prompts(n_prompts):
        text = tokenizer.apply_chat_template([{"role": "user", "content": p}]) if tokenizer.chat_template else p
        out.append(list(tokenizer.encode(text))[:max_len])
    return out


def calibrate_graph(graph_path: Path, spec, token_lists: list, *, verify_len: int = 8, threads: int = 2,
                    exclude=(), prompts_note: str = "", on_feeds=None, log=print) -> CalibrationTable:
    """Measure the activation ranges of ``graph_path`` (an fp32 ``causal_lm`` graph, growing KV layout).

    Args:
        graph_path: the ``.onnx`` file; its external weights are read in place.
        spec: the graph's :class:`~dspark_runtime.engine_dir.graphspec.GraphSpec`.
        token_lists: prompts as token-id lists (see :func:`calibration_token_ids`); each needs ≥ 2 tokens.
        verify_len: greedy decode steps per prompt (q = 1), then the same tokens as one verify chunk.
        exclude: module-name patterns left fp32 (their inputs are not measured).
        on_feeds: called with each step's input dict (tests replay them through other calibrators).
    Returns a :class:`CalibrationTable`. Raises DSparkError on a bad graph or empty input.
    """
    import onnx
    from onnx import helper

    graph_path = Path(graph_path)
    if not graph_path.is_file():
        raise DSparkError(f"graph {graph_path} not found")
    if not token_lists or any(len(t) < 2 for t in token_lists):
        raise DSparkError("calibration needs prompts of at least 2 tokens each")
    t0 = time.perf_counter()
    proto = onnx.load(str(graph_path), load_external_data=False)
    targets, _ = quant_targets(proto, exclude)
    acts = sorted({q.activation for q in targets})
    if not acts:
        raise DSparkError(f"{graph_path.name} has no MatMul with a weight initializer to calibrate")
    red_outs = []
    for i, a in enumerate(acts):
        for op in ("ReduceMin", "ReduceMax"):
            name = f"__calib_{op}_{i}"
            proto.graph.node.append(helper.make_node(op, [a], [name], keepdims=0, name=name))
            proto.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, []))
            red_outs.append(name)
    sess = session_over_weights(proto, graph_path.parent, threads)
    del proto
    d = spec.dims
    out_names = spec.output_names
    n_main = len(out_names)
    first_kv = 2 if "features" in out_names else 1
    lo = np.full(len(acts), np.inf)
    hi = np.full(len(acts), -np.inf)
    steps, h = [], hashlib.sha256()

    def run(ids: list, past_kv: list, past: int, kind: str):
        q = len(ids)
        feeds = {"input_ids": np.asarray([ids], np.int64),
                 "position_ids": np.arange(past, past + q, dtype=np.int64)[None],
                 "attention_mask": np.tril(np.ones((q, past + q), bool), k=past)[None, None]}
        for i, (k, v) in enumerate(past_kv):
            feeds[f"past.{i}.key"], feeds[f"past.{i}.value"] = np.ascontiguousarray(k), np.ascontiguousarray(v)
        if on_feeds is not None:
            on_feeds(feeds)
        outs = sess.run(out_names + red_outs, feeds)
        r = np.asarray(outs[n_main:], dtype=np.float64)
        np.minimum(lo, r[0::2], out=lo)
        np.maximum(hi, r[1::2], out=hi)
        steps.append({"kind": kind, "q": q, "past": past})
        h.update(json.dumps([kind, past, [int(t) for t in ids]]).encode())
        kv = [(outs[first_kv + 2 * i], outs[first_kv + 2 * i + 1]) for i in range(d.num_layers)]
        return outs[0][0, -1], kv

    empty = np.zeros((1, d.num_kv_heads, 0, d.head_dim), np.float32)
    for j, ids in enumerate(token_lists):
        last, kv = run(list(ids), [(empty, empty)] * d.num_layers, 0, "prefill")
        prompt_kv, n = kv, len(ids)
        cont = []
        for _ in range(verify_len):  # greedy decode, q = 1
            cont.append(int(np.argmax(last)))
            last, kv = run([cont[-1]], kv, n + len(cont) - 1, "decode")
        # the same continuation as one verify chunk on the prompt's cache
        run(cont, prompt_kv, n, "verify")
        log(f"  calibration prompt {j + 1}/{len(token_lists)}: {n} tokens + {verify_len} decoded + verify "
            f"q={verify_len} ({time.perf_counter() - t0:.0f} s)")
    del sess
    ranges = {a: [float(lo[i]), float(hi[i])] for i, a in enumerate(acts)}
    return CalibrationTable(ranges=ranges, data_id=h.hexdigest(), steps=steps, prompts=prompts_note,
                            graph_sha256=sha256_file(graph_path), seconds=round(time.perf_counter() - t0, 1),
                            peak_rss_gb=round(peak_rss_gb(), 2),
                            extra={"verify_len": verify_len, "exclude": list(exclude)})
