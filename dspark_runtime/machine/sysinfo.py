"""The machine, as recorded with every measurement: a one-line description (:func:`machine_description`) and the
CPU's model and ISA features (:func:`cpu_features`: the manifest's ``build_machine``, the ``cpu`` of
``speculation.row_invariance`` and ``speculation.cost_table``). ONNX Runtime's CPU kernels pick their code path by
ISA at run time (the INT8 u8·s8 GEMM saturates on AVX2 and is exact on VNNI; fp32 GEMMs block differently on AVX2
and AVX-512), so row-count invariance and round costs measured on one CPU do not transfer to another:
:func:`cpu_difference` says whether two records describe the same CPU.

Thread defaults: :func:`usable_cpus` (affinity mask and cgroup CPU quota), :data:`DEFAULT_THREADS` per ONNX Runtime
session, and :func:`shared_pool_default` (whether the CLI and the server share ONNX Runtime's process-wide pool).
"""
from __future__ import annotations

import math
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


#: where the cgroup file systems are mounted, and this process's cgroup membership (lines ``id:controllers:path``)
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
#: the cgroup v1 ``cpu`` controller's mount directory names under :data:`CGROUP_ROOT`
_V1_CPU_DIRS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


class OtherCpuWarning(UserWarning):
    """A measurement stored in the engine (row padding probe, cost table) was made on another CPU."""


def machine_description() -> str:
    """CPU model (with its x86 family and model numbers, which tell generations apart where a virtual machine names
    the CPU generically, e.g. "AMD EPYC"), cores, RAM and OS of this machine."""
    cpu = platform.processor() or platform.machine()
    try:
        f = cpu_features(Path("/proc/cpuinfo").read_text())
        cpu = f["model"] + (f" (family {f['family']})" if f.get("family") else "")
    except OSError:
        pass
    mem = ""
    try:
        kb = int(next(l for l in Path("/proc/meminfo").read_text().splitlines() if l.startswith("MemTotal")).split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        pass
    return f"{cpu}, {os.cpu_count()} cores{mem}, {platform.system()} {platform.release()}"


def usable_cpus(cgroup_root: str | Path | None = None, proc_cgroup: str | Path | None = None) -> int:
    """How many CPUs this process can keep busy: ``min(affinity, ceil(quota / period))``, at least 1.

    ``affinity``: ``len(os.sched_getaffinity(0))`` where the platform has it (Linux; ``taskset``, ``docker
    --cpuset-cpus`` and Kubernetes' static CPU manager narrow it), else ``os.cpu_count()`` (1 when unknown).
    ``quota / period``: the tightest CPU bandwidth limit of :func:`cgroup_cpu_limit` (``docker --cpus``,
    Kubernetes CPU limits), which ``os.cpu_count()`` and the affinity mask do not show: a container limited
    to 2 CPUs on a 64-core host sees 64 of both. No limit (or no readable cgroup files) leaves the affinity.

    ``cgroup_root`` / ``proc_cgroup``: where the cgroup file systems are mounted and the file listing this
    process's cgroups (default :data:`CGROUP_ROOT`, :data:`PROC_SELF_CGROUP`; tests pass fakes). Never raises:
    unreadable or malformed files count as no limit.
    """
    getaffinity = getattr(os, "sched_getaffinity", None)
    count = None
    if getaffinity is not None:
        try:
            count = len(getaffinity(0))
        except OSError:
            count = None
    if not count:
        count = os.cpu_count() or 1
    limit = cgroup_cpu_limit(cgroup_root, proc_cgroup)
    if limit is not None:
        count = min(count, limit)
    return max(1, count)


def cgroup_cpu_limit(cgroup_root: str | Path | None = None, proc_cgroup: str | Path | None = None) -> int | None:
    """``ceil(quota / period)`` of the tightest cgroup CPU quota over this process, or None for no quota.

    cgroup v2: ``cpu.max`` (``"<quota> <period>"`` in microseconds, quota ``max`` = unlimited). cgroup v1:
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (quota -1 = unlimited) under ``cpu``, ``cpu,cpuacct`` or
    ``cpuacct,cpu``. Each is read at the mount root (a container's own cgroup, with a cgroup namespace or
    a private mount) and, where ``proc_cgroup`` names this process's cgroup and that directory exists, there
    and in every ancestor up to the root (a quota on a parent limits its children too); the smallest limit
    wins. Missing, unreadable or malformed files are skipped. Never raises.

    Args:
        cgroup_root: the cgroup mount point (default :data:`CGROUP_ROOT`, ``/sys/fs/cgroup``).
        proc_cgroup: the membership file (default :data:`PROC_SELF_CGROUP`, ``/proc/self/cgroup``).
    """
    root = Path(CGROUP_ROOT if cgroup_root is None else cgroup_root)
    v2_rel, v1_rel = _own_cgroups(Path(PROC_SELF_CGROUP if proc_cgroup is None else proc_cgroup))
    limits = []
    for d in _cgroup_dirs(root, v2_rel):
        limits.append(_v2_limit(d / "cpu.max"))
    for name in _V1_CPU_DIRS:
        for d in _cgroup_dirs(root / name, v1_rel):
            limits.append(_v1_limit(d / "cpu.cfs_quota_us", d / "cpu.cfs_period_us"))
    limits = [n for n in limits if n is not None]
    return min(limits) if limits else None


def _own_cgroups(
    proc_cgroup: Path,  # /proc/self/cgroup: lines "hierarchy-id:controllers:path"
) -> tuple[str, str]:  # (v2 path, v1 cpu-controller path), relative ("" when unknown)
    v2 = v1 = ""
    try:
        text = proc_cgroup.read_text()
    except (OSError, UnicodeDecodeError):
        return v2, v1
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path.strip("/")
        elif "cpu" in controllers.split(","):
            v1 = path.strip("/")
    return v2, v1


def _cgroup_dirs(
    base: Path,  # a cgroup mount directory
    rel: str,  # this process's cgroup path below it ("" = the root)
) -> list[Path]:  # the process's own cgroup directory (where it exists) and its ancestors, then base
    dirs = []
    parts = [p for p in rel.split("/") if p and p not in (".", "..")]
    own = base.joinpath(*parts) if parts else base
    if parts and own.is_dir():
        for i in range(len(parts), 0, -1):
            dirs.append(base.joinpath(*parts[:i]))
    dirs.append(base)
    return dirs


def _read_words(path: Path) -> list[str] | None:
    try:
        return path.read_text().split()
    except (OSError, UnicodeDecodeError):
        return None


def _ceil_ratio(quota: int, period: int) -> int | None:
    if quota <= 0 or period <= 0:
        return None
    return max(1, math.ceil(quota / period))


def _v2_limit(
    cpu_max: Path,  # cgroup v2 cpu.max: "<quota|max> <period>"
) -> int | None:
    words = _read_words(cpu_max)
    if not words or words[0] == "max":
        return None
    try:
        quota = int(words[0])
        period = int(words[1]) if len(words) > 1 else 100_000
    except ValueError:
        return None
    return _ceil_ratio(quota, period)


def _v1_limit(
    quota_file: Path,  # cgroup v1 cpu.cfs_quota_us (-1 = unlimited)
    period_file: Path,  # cgroup v1 cpu.cfs_period_us
) -> int | None:
    q, p = _read_words(quota_file), _read_words(period_file)
    if not q or not p:
        return None
    try:
        return _ceil_ratio(int(q[0]), int(p[0]))
    except ValueError:
        return None


#: intra-op threads per ONNX Runtime session unless told: the CPUs this process may use (affinity, cgroup quota),
#: at most 8
DEFAULT_THREADS = max(1, min(usable_cpus(), 8))


def shared_pool_default() -> bool:
    """Whether the CLI, the server and the benchmarks run every session on ONNX Runtime's process-wide thread pool
    (:func:`dspark_runtime.backends.ort.enable_shared_thread_pool`): yes unless ``DSPARK_SHARED_THREAD_POOL=0``
    (the test suite sets it, since its process also makes plain ONNX Runtime sessions)."""
    return os.environ.get("DSPARK_SHARED_THREAD_POOL", "1") != "0"


def cpu_features(text: str | None = None) -> dict:
    """The CPU of this machine, from /proc/cpuinfo (or from ``text``, a captured /proc/cpuinfo):
    ``{"model", "vendor", "flags", "cores"}``, on x86 also ``"family"`` (``"<cpu family>/<model>"``, e.g. ``"25/17"``
    for AMD's Zen 4 EPYC, ``"26/2"`` for Zen 5: one generation's 512-bit units differ from the next's behind the
    same model name and flags). ``flags``: the sorted ISA flags of :data:`X86_FLAGS` /
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
    out = {"model": model or platform.processor() or platform.machine(), "vendor": vendor,
           "flags": sorted(set(flags) & known), "cores": cores}
    if fields.get("cpu family") and fields.get("model"):
        out["family"] = f"{fields['cpu family']}/{fields['model']}"
    return out


def cpu_difference(recorded: dict, current: dict) -> str | None:
    """None when ``recorded`` and ``current`` (:func:`cpu_features` dicts) have the same model, the same
    flags and the same x86 family/model numbers; else one line naming both models and the flags this machine
    (``current``) has that the recorded one had not, and those it lacks. Flags are compared only when both
    records list some (a record from a machine without /proc/cpuinfo has none), family numbers only when both
    records have them (records made before they were kept have none)."""
    fam_a, fam_b = recorded.get("family"), current.get("family")
    if fam_a and fam_b and fam_a != fam_b and recorded.get("model") == current.get("model"):  # one name, two CPUs
        recorded, current = (dict(recorded, model=f"{recorded.get('model', '')} (family {fam_a})"),
                             dict(current, model=f"{current.get('model', '')} (family {fam_b})"))
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
