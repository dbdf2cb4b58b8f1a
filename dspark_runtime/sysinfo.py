"""The machine, as recorded with every measurement: a one-line description (benchmarks, cost tables) and
the CPU's model and ISA features (:func:`cpu_features`; the manifest's ``build_machine``, the ``cpu`` of
``speculation.row_invariance`` and ``speculation.cost_table``).

ONNX Runtime's CPU kernels (MLAS) pick their code path by ISA at run time: the u8·s8 integer GEMM of
INT8 graphs runs VPMADDUBSW on AVX2 (whose int16 pair sums saturate), VPDPBUSD on AVX-VNNI /
AVX-512 VNNI (exact) or AMX tiles; fp32 GEMMs have AVX2/FMA and AVX-512 variants with different
blockings. Row-count invariance and round costs measured on one CPU therefore do not transfer to another;
:func:`cpu_difference` says whether two records describe the same CPU.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path

#: /proc/cpuinfo ``flags`` (x86) that select ONNX Runtime CPU kernels: SSE/AVX/FMA float paths, the AVX-512
#: family, the VNNI dot products of the integer GEMMs, bf16/fp16 and AMX tiles
X86_FLAGS = frozenset({
    "ssse3", "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c",
    "avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl", "avx512vbmi", "avx512_vbmi2",
    "avx512_vnni", "avx_vnni", "avx_vnni_int8", "avx_ne_convert", "avx512_bf16", "avx512_fp16",
    "amx_tile", "amx_int8", "amx_bf16", "amx_fp16",
})
#: /proc/cpuinfo ``Features`` (aarch64) that select kernels: NEON, dot product, int8 matrix multiply, fp16,
#: bf16, SVE/SME
ARM_FLAGS = frozenset({
    "asimd", "asimdhp", "asimddp", "fphp", "i8mm", "bf16", "sve", "sve2", "svei8mm", "svebf16", "sme",
})
#: ``CPU implementer`` codes of /proc/cpuinfo on aarch64 (it has no vendor string)
ARM_IMPLEMENTERS = {"0x41": "ARM", "0x42": "Broadcom", "0x46": "Fujitsu", "0x48": "HiSilicon", "0x4e": "NVIDIA",
                    "0x51": "Qualcomm", "0x61": "Apple", "0xc0": "Ampere"}


class OtherCpuWarning(UserWarning):
    """A measurement stored in the engine (row padding probe, cost table) was made on another CPU."""


def machine_description() -> str:
    """CPU model, cores, RAM and OS of this machine."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(next(l for l in Path("/proc/meminfo").read_text().splitlines() if l.startswith("MemTotal")).split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        pass
    return f"{cpu}, {os.cpu_count()} cores{mem}, {platform.system()} {platform.release()}"


def cpu_features(text: str | None = None) -> dict:
    """The CPU of this machine, from /proc/cpuinfo (or from ``text``, a captured /proc/cpuinfo):
    ``{"model", "vendor", "flags", "cores"}``. ``flags``: the sorted ISA flags of :data:`X86_FLAGS` /
    :data:`ARM_FLAGS` the (first) processor reports. ``cores``: ``os.cpu_count()``, or for ``text`` the
    number of processor entries in it. Where /proc/cpuinfo cannot be read (not Linux) the model is
    ``platform.processor()`` and ``flags`` is empty (unknown)."""
    cores = os.cpu_count()
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            text = ""
    else:
        cores = sum(1 for line in text.splitlines() if line.split(":", 1)[0].strip() == "processor"
                    and line.split(":", 1)[-1].strip().isdigit()) or None
    fields: dict = {}
    for line in text.splitlines():
        if not line.strip():
            if "flags" in fields or "Features" in fields:
                break  # the first processor's entry is enough (a trailing system block may follow on arm)
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    if not fields:  # no /proc/cpuinfo (macOS, Windows): model only, flags unknown
        return {"model": platform.processor() or platform.machine(), "vendor": "", "flags": [], "cores": cores}
    if "flags" in fields:
        flags, known = fields["flags"].split(), X86_FLAGS
    else:
        flags, known = fields.get("Features", "").split(), ARM_FLAGS
    vendor = fields.get("vendor_id") or ARM_IMPLEMENTERS.get(fields.get("CPU implementer", "").lower(),
                                                             fields.get("CPU implementer", ""))
    model = fields.get("model name") or fields.get("Model name") or fields.get("Hardware") or ""
    if not model and "CPU part" in fields:
        model = f"{vendor or 'unknown implementer'} part {fields['CPU part']}"
    return {"model": model or platform.processor() or platform.machine(), "vendor": vendor,
            "flags": sorted(set(flags) & known), "cores": cores}


def cpu_difference(recorded: dict, current: dict) -> str | None:
    """None when ``recorded`` and ``current`` (:func:`cpu_features` dicts) have the same model and the same
    flags; else one line naming both models and the flags this machine (``current``) has that the recorded
    one had not, and those it lacks. Flags are compared only when both records list some (a record from a
    machine without /proc/cpuinfo has none)."""
    model_a, model_b = str(recorded.get("model", "")), str(current.get("model", ""))
    flags_a, flags_b = set(recorded.get("flags") or ()), set(current.get("flags") or ())
    gained, lost = (sorted(flags_b - flags_a), sorted(flags_a - flags_b)) if flags_a and flags_b else ([], [])
    if model_a == model_b and not gained and not lost:
        return None
    parts = [f"recorded on {model_a or 'an unnamed CPU'!r}, this machine is {model_b or 'an unnamed CPU'!r}"
             if model_a != model_b else f"same model {model_a!r} but other ISA flags"]
    if gained:
        parts.append("this machine adds " + ", ".join(gained))
    if lost:
        parts.append("this machine lacks " + ", ".join(lost))
    if model_a != model_b and not gained and not lost:
        parts.append("same ISA flags" if flags_a and flags_b else "ISA flags not compared (one record lists none)")
    return "; ".join(parts)
