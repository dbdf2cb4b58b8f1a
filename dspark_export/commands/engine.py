"""``dspark-export build``, ``build-trt``, ``build-cuda``, ``add-draft``, ``add-prompt-graph`` and ``pack``: writing an engine
directory (ONNX graphs, TensorRT engines, device graphs, the DSpark drafter) and packing it for publication.
"""
from __future__ import annotations

from pathlib import Path

import click

from dspark_runtime.backends.trt.loader import import_tensorrt
from dspark_runtime.backends.trt.profiles import ProfileSettings
from dspark_runtime.cli import engine_path_callback
from dspark_runtime.engine_dir.artifact import pack as pack_engine
from dspark_runtime.engine_dir.manifest import load_manifest
from dspark_runtime.errors import DSparkError

from dspark_export.commands.options import FP8_WRITER_OPTION, INT4_SOURCE_OPTION, LM_HEAD_OPTION
from dspark_export.engine_dir.add_draft import add_dspark_draft, dspark_checkpoint
from dspark_export.engine_dir.add_eagle3 import add_eagle3_draft, is_eagle3_checkpoint
from dspark_export.engine_dir.add_prompt_graph import add_prompt_graph
from dspark_export.precision.prompt_graph import OUTLIER_RATIO
from dspark_export.engine_dir.build import Recipe, build_engine
from dspark_export.engine_dir.trt_build import TrtBuildSettings, build_trt
from dspark_export.graphs.device import build_cuda
from dspark_export.paths import recipe_names, resolve_recipe


@click.command()
@click.argument("recipe", required=False)
@click.option("--target", help="Target model: a fetched name or a Hugging Face folder (instead of a recipe).")
@click.option("--draft", help="Draft: a draft LM (fetched name or folder, same tokenizer) or "
              "'dspark:<checkpoint folder>' (a DSpark drafter, DeepSpec layout).")
@click.option("--name", help="Engine name (default: the recipe's or the target's).")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), help="Engine directory (default engines/<name>).")
@click.option("--precision", default=None,
              help="fp32 | int4 (MatMulNBits weight-only for ONNX Runtime CPU; weights: --int4-source) | "
                   "int8 (static QDQ for ONNX Runtime CPU) | int8-trt (S8S8 QDQ for TensorRT) | int8-dynamic | "
                   "fp8 (E4M3 QDQ for TensorRT; writer: --fp8-writer), "
                   "for all graphs or per graph: 'target=int8,draft=fp32'.")
@click.option("--calibration-prompts", type=int, default=None,
              help="Calibration-split prompts for int8/int8-trt/fp8 (default 16).")
@click.option("--feature-layers", default=None, help="Target layers whose hidden states the graph outputs, e.g. 1,13,25.")
@click.option("--draft-length", type=int, default=None, help="Default draft tokens per round (gamma).")
@FP8_WRITER_OPTION
@INT4_SOURCE_OPTION
@LM_HEAD_OPTION
@click.option("--kv-layout", "kv_layout", type=click.Choice(["auto", "growing", "scatter"]), default=None,
              help="KV layout of the decoder graphs (default auto: scatter for int4 / int8-dynamic engines, growing "
                   "otherwise). scatter: one batch row per request, so `dspark serve` gives each request exactly its "
                   "solo output (fp32 / int4 / int8-dynamic); growing: what `quantize`, static int8, fp8 and "
                   "TensorRT start from.")
@click.option("--in-process", is_flag=True, help="Export in this process instead of one subprocess per graph.")
@click.option("--engine-format", type=click.Choice(["onnx", "trt", "both"]), default="onnx", show_default=True,
              help="onnx: ONNX graphs only. trt / both: the ONNX graphs (the CPU backend and the engines' source) plus "
                   "TensorRT engines built from them (options as `build-trt`, with its defaults).")
def build(recipe, target, draft, name, out_dir, precision, calibration_prompts, feature_layers, draft_length,
          fp8_writer, int4_source, lm_head, kv_layout, in_process, engine_format):
    """Export, validate and describe an engine: RECIPE (a packaged recipe's name, e.g. qwen2.5-coder-1.5b, or a
    recipe file) or --target/--draft."""
    if recipe is not None:
        path = resolve_recipe(recipe)
        if str(path) != recipe:
            click.echo(f"recipe: {path}")
        r = Recipe.from_file(path)
    elif target:
        r = Recipe(name=name or Path(target).name, target=target)
    else:
        raise DSparkError(f"give a recipe (a packaged one: {', '.join(recipe_names())}; or a recipe file) "
                          "or --target MODEL")
    if target and recipe is not None:
        r.target = target
    if draft:
        r.draft = draft
    if name:
        r.name = name
    if precision:
        r.precision = precision
    if int4_source is not None:
        r.int4_source = int4_source
    if lm_head is not None:
        r.lm_head = lm_head
    if kv_layout is not None:
        r.kv_layout = kv_layout
    if calibration_prompts is not None:
        r.calibration_prompts = calibration_prompts
    if draft_length is not None:
        r.draft_length = draft_length
    if feature_layers is not None:
        try:
            r.target_feature_layers = [int(x) for x in feature_layers.split(",") if x.strip()]
        except ValueError:
            raise DSparkError(f"--feature-layers must be comma-separated integers, got {feature_layers!r}")
    out = out_dir or Path("engines") / r.name
    if engine_format != "onnx":  # fail before a long export when TensorRT is missing
        import_tensorrt()
        if r.kv_layout == "auto":  # TensorRT engines are built from growing graphs
            r.kv_layout = "growing"
    build_engine(r, out, isolate=not in_process, log=click.echo, fp8_writer=fp8_writer)
    if engine_format != "onnx":
        build_trt(out, TrtBuildSettings(profile=ProfileSettings(decode_q=r.draft_length + 1)),
                  isolate=not in_process, log=click.echo)


def _csv(value: str, what: str) -> tuple:
    items = tuple(x.strip() for x in value.split(",") if x.strip())
    if not items:
        raise click.BadParameter(f"expected a comma-separated list, got {value!r}", param_hint=what)
    return items


@click.command("build-trt")
@click.argument("engine_dir", type=click.Path(path_type=Path), callback=engine_path_callback())
@click.option("--flavour", type=click.Choice(["auto", "rtx", "enterprise"]), default="auto", show_default=True,
              help="TensorRT for RTX (tensorrt_rtx_bindings: builds without a GPU) or enterprise tensorrt "
                   "(Hopper / datacenter Blackwell; builds on the GPU it targets). auto: RTX if installed.")
@click.option("--compute-capabilities", default=None,
              help="Target GPUs (TensorRT-RTX), e.g. 8.6,8.9. Default 8.0,8.6,8.9,12.0 (FP8 graphs: 8.9,12.0). "
                   "7.5 (Turing) only alone and only for non-fp32 graphs.")
@click.option("--graphs", default=None, help="Graph keys to build (default: every causal_lm graph (target, draft LM) "
                                              "and the DSpark drafter graph, which must be fp32, not int4).")
@click.option("--kv-layout", "kv_layouts", default="capacity", show_default=True,
              help="capacity (fixed-shape cache buffers, CUDA graphs) and/or growing (ONNX Runtime's layout).")
@click.option("--max-batch", type=int, default=1, show_default=True, help="Most sequences per call.")
@click.option("--decode-q", type=int, default=None,
              help="Most tokens per decode/verify call, gamma + 1 (default: the manifest's draft_length + 1).")
@click.option("--prefill-chunk", type=int, default=256, show_default=True, help="Most tokens per prefill call.")
@click.option("--capacity", type=int, default=4096, show_default=True, help="KV positions per sequence.")
@click.option("--min-bucket", type=int, default=256, show_default=True, help="Smallest capacity bucket.")
@click.option("--opt-level", type=click.IntRange(0, 5), default=None, help="TensorRT builder optimisation level.")
@click.option("--half", type=click.Choice(["bf16", "fp16"]), default=None,
              help="Build from 16-bit copies of the graphs (RoPE kept float32; half the weight memory in the build "
                   "and the engine). bf16 keeps float32's range; fp16 is the only 16-bit type Turing (7.5) runs.")
@click.option("--in-process", is_flag=True, help="Build in this process (peak RSS then includes this process).")
def build_trt_cmd(engine_dir, flavour, compute_capabilities, graphs, kv_layouts, max_batch, decode_q, prefill_chunk,
                  capacity, min_bucket, opt_level, half, in_process):
    """Build TensorRT engines from the ONNX graphs already in ENGINE_DIR and record them (sha256, flavour and
    version, profiles, compute capabilities, precision, build time, peak memory) in its manifest."""
    if decode_q is None:
        decode_q = (load_manifest(engine_dir, verify=False).speculation.draft_length or 7) + 1
    ccs = None if compute_capabilities is None else _csv(compute_capabilities, "--compute-capabilities")
    s = TrtBuildSettings(flavour=flavour, compute_capabilities=ccs,
                         profile=ProfileSettings(max_batch=max_batch, decode_q=decode_q, prefill_chunk=prefill_chunk,
                                                 capacity=capacity, min_bucket=min_bucket),
                         kv_layouts=_csv(kv_layouts, "--kv-layout"),
                         graphs=None if graphs is None else _csv(graphs, "--graphs"),
                         builder_optimization_level=opt_level, half=half)
    m = build_trt(engine_dir, s, isolate=not in_process, log=click.echo)
    click.echo(f"{engine_dir}: TensorRT engines {', '.join(m.trt_engines)}")


@click.command("build-cuda")
@click.argument("engine_dir", type=click.Path(path_type=Path), callback=engine_path_callback())
@click.option("--graphs", default="target", show_default=True,
              help="Decoder graph keys (target, draft) to make device graphs of.")
@click.option("--half", type=click.Choice(["fp16", "bf16", "none"]), default="fp16", show_default=True,
              help="16-bit arithmetic (RoPE kept float32; inputs and outputs stay float32) or none (float32).")
@click.option("--max-batch", type=int, default=8, show_default=True, help="Most requests decoded at once.")
@click.option("--decode-q", type=int, default=None,
              help="Tokens per decode/verify call, gamma + 1 (default: the manifest's draft_length + 1).")
@click.option("--prefill-chunk", type=int, default=128, show_default=True, help="Tokens per prefill call.")
@click.option("--capacity", type=int, default=4096, show_default=True, help="KV positions per request.")
@click.option("--min-bucket", type=int, default=256, show_default=True, help="Smallest capacity bucket.")
@click.option("--no-fuse", is_flag=True, help="Keep the exported rotary embeddings (default: fused into ONNX Runtime's "
                                             "RotaryEmbedding, 7 kernels a query/key fewer).")
@click.option("--in-process", is_flag=True, help="Convert in this process.")
def build_cuda_cmd(engine_dir, graphs, half, max_batch, decode_q, prefill_chunk, capacity, min_bucket, no_fuse,
                   in_process):
    """Add device graphs for ONNX Runtime's CUDA provider to the built ENGINE_DIR (an fp32 engine with the growing
    KV layout): the capacity KV layout (cache buffers resident on the GPU, CUDA graphs), fp16 by default; run them
    with `dspark generate --placement target=cuda`."""
    if decode_q is None:
        decode_q = (load_manifest(engine_dir, verify=False).speculation.draft_length or 7) + 1
    profile = ProfileSettings(max_batch=max_batch, decode_q=decode_q, prefill_chunk=prefill_chunk, capacity=capacity,
                              min_bucket=min_bucket)
    m = build_cuda(engine_dir, profile, None if half == "none" else half, _csv(graphs, "--graphs"),
                   isolate=not in_process, log=click.echo, fuse=not no_fuse)
    click.echo(f"{engine_dir}: device graphs {', '.join(f'{k} ({e.onnx})' for k, e in m.device_graphs.items())}")


@click.command("add-draft")
@click.argument("engine_dir", type=click.Path(path_type=Path), callback=engine_path_callback())
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("--target", default=None, help="The engine's target model (fetched name or folder): its frozen "
              "embedding and LM head complete a DSpark checkpoint that omits them (required for DSpark checkpoints; "
              "an EAGLE-3 checkpoint holds its own).")
@click.option("--in-process", is_flag=True, help="Export in this process.")
@click.option("--precision", type=click.Choice(["auto", "fp32", "int4", "int8-dynamic"]), default="auto",
              show_default=True, help="The drafter graph's weights (auto: int4 beside an int4 target, else fp32).")
def add_draft(engine_dir, checkpoint, target, in_process, precision):
    """Compile CHECKPOINT into the built ENGINE_DIR as a drafter: a DSpark / DFlash checkpoint becomes its DSpark
    drafter, a DeepSpec EAGLE-3 checkpoint (config.json architectures Qwen3Eagle3Model) its EAGLE-3 drafter
    (``--draft eagle3``). The target graph is kept and must output the drafter's target_layer_ids features."""
    if is_eagle3_checkpoint(checkpoint):
        add_eagle3_draft(engine_dir, checkpoint, isolate=not in_process, log=click.echo, precision=precision)
        click.echo(f"{engine_dir}: EAGLE-3 drafter is now {checkpoint} (--draft eagle3)")
        return
    if target is None:
        raise click.UsageError("--target is required for a DSpark checkpoint (its frozen embedding and LM head "
                               "may come from the target); pass the engine's target model name or folder")
    add_dspark_draft(engine_dir, dspark_checkpoint(f"dspark:{checkpoint}"), target, isolate=not in_process,
                     log=click.echo, precision=precision)
    click.echo(f"{engine_dir}: drafter is now dspark:{checkpoint}")


@click.command("add-prompt-graph")
@click.argument("engine_dir", type=click.Path(path_type=Path), callback=engine_path_callback())
@click.option("--weight-bits", type=click.Choice(["auto", "7", "8"]), default="auto", show_default=True,
              help="Integer weight bits: auto = 7 where this CPU's u8·s8 kernel saturates (AVX2 without VNNI), else 8. "
                   "A graph with 8-bit weights computes wrong results on a saturating CPU.")
@click.option("--keep-int4", default="", show_default=True,
              help="Module-name regexes (comma-separated) of projections left on the int4 kernel (e.g. "
                   "'mlp\\.down_proj$'), slower prompt chunks for a prompt closer to the target's.")
@click.option("--outlier-ratio", type=click.FloatRange(min=0), default=OUTLIER_RATIO, show_default=True,
              help="Input channels whose maximum over 8 calibration-split prompts exceeds this many times the median "
                   "channel's are computed apart in fp32 (0: none): a per-row scale cannot hold them.")
def add_prompt_graph_cmd(engine_dir, weight_bits, keep_int4, outlier_ratio):
    """Add the integer-GEMM prompt graph of ENGINE_DIR's int4 target: prompt chunks then run on MatMulIntegerToFloat
    (uint8 activations per row, the target's weights in 7/8-bit columns), 2-3.5x faster than the int4 kernels
    (AVX2, AVX-512 VNNI, AMX), in every decoding mode alike (speculative output still equals target-only); decoding
    stays on the target. The prompt's positions are computed less exactly than by the int4 graph (docs/precision.md,
    "Prompt chunks on an integer GEMM": measured top-1 agreement and outputs). Costs 1.3 GiB more on disk (the
    embedding and LM head are read from the target's data file) and ~1.8 GB more memory for a 1.5B model."""
    keep = [k for k in keep_int4.split(",") if k.strip()]
    m = add_prompt_graph(engine_dir, None if weight_bits == "auto" else int(weight_bits), keep=keep,
                         outlier_ratio=outlier_ratio, log=click.echo)
    g, target_files = m.graphs["target_prompt"], {f.path for f in m.graphs["target"].files}
    click.echo(f"{engine_dir}: prompt graph {g.model_file} "
               f"({sum(f.size for f in g.files if f.path not in target_files) / 2**30:.2f} GiB of its own, the rest "
               "read from the target's data file); `dspark generate` / `dspark serve` run prompt chunks on it")


@click.command()
@click.argument("engine_dir", type=click.Path(path_type=Path), callback=engine_path_callback())
@click.option("-o", "--out", type=click.Path(path_type=Path), default=None,
              help="Tarball to write (default: <engine name>.tar.gz here).")
@click.option("--compress-level", type=click.IntRange(1, 9), default=1, show_default=True,
              help="gzip level (weights barely compress; 1 is several times faster than 9).")
def pack(engine_dir, out, compress_level):
    """Write ENGINE_DIR (manifest + every file it lists, each re-hashed against the manifest first) to one
    tarball plus <tarball>.sha256: the prebuilt artifact to publish. Never commit it."""
    out = out or Path(f"{load_manifest(engine_dir, verify=False).name}.tar.gz")
    r = pack_engine(engine_dir, out, compresslevel=compress_level)
    click.echo(f"{r['path']}: {r['files']} files, {r['bytes'] / 2**20:.1f} MiB, sha256 {r['sha256']}")
