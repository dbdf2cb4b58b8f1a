"""``dspark-export calibrate-quant`` and ``quantize``: activation ranges of an fp32 graph, and a quantized copy
of a built engine.
"""
from __future__ import annotations

from pathlib import Path

import click

from dspark_runtime.cli import engine_path_callback
from dspark_runtime.engine_dir.manifest import load_manifest
from dspark_runtime.engine_dir.tokenizer import Tokenizer
from dspark_runtime.errors import DSparkError

from dspark_export.commands.options import FP8_WRITER_OPTION, INT4_SOURCE_OPTION, LM_HEAD_OPTION
from dspark_export.precision.activation_ranges import (CALIBRATION_NOTE, CalibrationTable, calibrate_graph,
                                                       calibration_token_ids)
from dspark_export.precision.quantize import quantize_engine


def _role_option(value, what):
    """'role=path,...' -> {role: path}; one bare path means the target's."""
    if not value:
        return {}
    if "=" not in value:
        return {"target": value}
    out = {}
    for item in value.split(","):
        k, sep, v = item.partition("=")
        if not sep or k.strip() not in ("target", "draft"):
            raise DSparkError(f"{what} {value!r}: write role=path pairs such as 'target=t.json,draft=d.json'")
        out[k.strip()] = v.strip()
    return out


@click.command("calibrate-quant")
@click.argument("engine_dir", type=click.Path(path_type=Path), callback=engine_path_callback())
@click.option("--role", type=click.Choice(["target", "draft"]), default="target", show_default=True,
              help="Which fp32 decoder graph of the engine to calibrate.")
@click.option("-o", "--out", "out_path", type=click.Path(path_type=Path), required=True,
              help="Calibration table to write (JSON: activation ranges, data id, steps).")
@click.option("--prompts", "n_prompts", type=int, default=16, show_default=True,
              help="Calibration-split prompts (never evaluation prompts), each cut to 256 tokens.")
@click.option("--verify-len", type=int, default=8, show_default=True,
              help="Greedy decode steps per prompt, then the same tokens as one verify chunk.")
def calibrate_quant(engine_dir, role, out_path, n_prompts, verify_len):
    """Measure the activation ranges of ENGINE_DIR's fp32 graph ROLE for static INT8 quantization:
    prefill, decode (q=1) and verify (q=verify-len) steps over calibration-split prompts (MinMax), for the
    inputs of every weight MatMul (so the table serves any --exclude).
    The table is reused by `dspark-export quantize --calibration`."""
    m = load_manifest(engine_dir)
    g = m.graphs.get(role)
    if g is None or g.precision != "fp32" or g.spec.kind != "causal_lm":
        raise DSparkError(f"{engine_dir} has no fp32 decoder graph {role!r} to calibrate")
    ids = calibration_token_ids(Tokenizer(Path(engine_dir) / m.tokenizer["dir"]), n_prompts)
    tab = calibrate_graph(Path(engine_dir) / g.model_file, g.spec, ids, verify_len=verify_len,
                          prompts_note=CALIBRATION_NOTE + f"; first {len(ids)}",
                          log=click.echo)
    tab.save(out_path)
    click.echo(f"{out_path}: {len(tab.ranges)} activation ranges, data id {tab.data_id[:16]}..., "
               f"{len(tab.steps)} steps in {tab.seconds:.0f} s, peak RSS {tab.peak_rss_gb:.2f} GiB")


@click.command()
@click.argument("engine_dir", type=click.Path(path_type=Path), callback=engine_path_callback())
@click.option("-o", "--out", "out_dir", type=click.Path(path_type=Path), required=True,
              help="New engine directory (the source engine is not modified; unchanged files are hard-linked).")
@click.option("--precision", required=True,
              help="int4 (MatMulNBits, see --int4-source) | int8 | int8-trt | int8-dynamic | fp8 (E4M3 for TensorRT; "
                   "see --fp8-writer) for all decoder graphs, or per graph: 'target=int4,draft=int4'.")
@click.option("--calibration", default=None,
              help="Tables from `calibrate-quant`: 'target=t.json,draft=d.json' (default: calibrate here).")
@click.option("--calibration-prompts", type=int, default=16, show_default=True)
@click.option("--exclude", default=None,
              help="Comma-separated regular expressions of modules kept fp32 (e.g. 'down_proj,lm_head'); "
                   "default: the built-in list for int8 (dspark_export.precision.qdq.DEFAULT_EXCLUDE), none for fp8. "
                   "'' quantizes all.")
@FP8_WRITER_OPTION
@INT4_SOURCE_OPTION
@LM_HEAD_OPTION
def quantize(engine_dir, out_dir, precision, calibration, calibration_prompts, exclude, fp8_writer, int4_source,
             lm_head):
    """Quantize the fp32 graphs of a built ENGINE_DIR into a new engine directory, without re-exporting."""
    tables = {r: CalibrationTable.load(p) for r, p in _role_option(calibration, "--calibration").items()}
    excl = None if exclude is None else [x for x in exclude.split(",") if x.strip()]
    quantize_engine(engine_dir, out_dir, precision, calibration_prompts=calibration_prompts, tables=tables,
                    exclude=excl, fp8_writer=fp8_writer, int4_source=int4_source or "auto",
                    lm_head=lm_head or "auto", log=click.echo)
