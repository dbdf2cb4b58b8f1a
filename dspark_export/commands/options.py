"""Options shared by several ``dspark-export`` commands (``build`` and ``quantize``)."""
from __future__ import annotations

import click

# `build` and `quantize`: who writes fp8 graphs (dspark_export.precision.fp8.choose_fp8_writer)
FP8_WRITER_OPTION = click.option(
    "--fp8-writer", type=click.Choice(["auto", "modelopt", "stream"]), default="auto", show_default=True,
    help="Who writes fp8 graphs: modelopt (NVIDIA ModelOpt, own venv; peaks at ~7.5x the fp32 weights), stream "
         "(memory-bounded QDQ writer; FP8 weights stored quantized, peak ~ the graph structure plus one weight), or "
         "auto (ModelOpt when installed and 8x the fp32 weights fit in the available memory, else stream).")

# `build` and `quantize`: how an int4 graph's LM head is read (dspark_export.precision.nbits_head.resolve_lm_head)
LM_HEAD_OPTION = click.option(
    "--lm-head", "lm_head", type=click.Choice(["auto", "screened", "full"]), default=None,
    help="The int4 LM head: screened (a 2-bit copy scores the vocabulary, the 256 best tokens of each position are "
         "rescored from the exact 8-bit head: about a quarter of the head's bytes per step), full (the head as the int4 "
         "source encodes it), auto (default: screened where the source keeps an 8-bit head, i.e. gguf and "
         "gguf-compact; full otherwise).")

# `build` and `quantize`: where int4 weights come from (dspark_export.precision.quantizers.resolve_int4_source)
INT4_SOURCE_OPTION = click.option(
    "--int4-source", default=None, metavar="auto|gguf|gguf-compact|gguf-kernel|rtn|hqq",
    help="int4 weights, for all graphs or per graph ('target=gguf,draft=rtn'): gguf (re-pack the GGUF the model was "
         "fetched from exactly: the weights llama.cpp runs), gguf-compact (the same blocks in fewer bytes per step: "
         "the block minimum in 8 bits, 6-bit blocks re-fitted in 4 bits, the LM head exact), gguf-kernel (the GGUF's "
         "Q4_K/Q6_K blocks as they are, run by DSpark's own kernel: needs a C++ compiler to build), rtn / hqq (ONNX "
         "Runtime's quantizer on the float weights), auto (default: gguf-compact for a target fetched from a GGUF, rtn "
         "otherwise).")
