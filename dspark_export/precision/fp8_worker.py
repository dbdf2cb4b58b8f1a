"""FP8 (E4M3) QDQ quantization with NVIDIA ModelOpt, run by :mod:`dspark_export.precision.fp8` as a subprocess in
ModelOpt's own virtual environment (its onnx extra pins older onnx / onnxruntime-gpu than DSpark's).

Imports only numpy, onnxruntime and modelopt (not DSpark). Usage::

    <modelopt venv>/bin/python fp8_worker.py ARGS.json

ARGS.json: {"src": fp32 .onnx, "dst": output .onnx, "feeds": .npz of calibration steps (keys
"<step>/<input name>"), "nodes": [MatMul node names to quantize], "per_node": bool}.
"""
from __future__ import annotations

import json
import re
import sys


def main(args_path: str) -> int:
    import numpy as np
    from modelopt.onnx.quantization import quantize
    from onnxruntime.quantization import CalibrationDataReader

    a = json.loads(open(args_path).read())
    data = np.load(a["feeds"])
    steps: dict = {}
    for key in data.files:
        step, _, name = key.partition("/")
        steps.setdefault(int(step), {})[name] = data[key]
    feeds = [steps[i] for i in sorted(steps)]

    class Steps(CalibrationDataReader):
        """Replays the prefill / decode / verify steps DSpark recorded on the fp32 graph."""

        def __init__(self):
            self.it = iter(feeds)

        def get_next(self):
            return next(self.it, None)

        def get_first(self):
            return feeds[0]

        def rewind(self):
            self.it = iter(feeds)

    quantize(a["src"], quantize_mode="fp8", calibration_data_reader=Steps(), calibration_method="max",
             calibration_eps=["cpu"], op_types_to_quantize=["MatMul"],
             nodes_to_quantize=["^" + re.escape(n) + "$" for n in a["nodes"]],
             use_external_data_format=True, output_path=a["dst"], high_precision_dtype="fp32",
             disable_mha_qdq=True,
             calibrate_per_node=bool(a.get("per_node", False)), log_level="WARNING")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
