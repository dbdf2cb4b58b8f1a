"""The machine matters: CPU features recorded with the engine and its measurements, the load warning when
they were made on another CPU, and the u8·s8 saturation probe that replaces the AVX2 assumption."""
import json
import platform
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from dspark_runtime.engine_dir.manifest import load_manifest, parse_manifest
from dspark_runtime.machine.sysinfo import OtherCpuWarning, cpu_difference, cpu_features

# Captured /proc/cpuinfo (two logical CPUs each; the AMD one without AVX-512 or VNNI)
XEON_AMX = """processor	: 0
vendor_id	: GenuineIntel
cpu family	: 6
model		: 143
model name	: Intel(R) Xeon(R) Platinum 8480+
stepping	: 8
microcode	: 0x2b000461
cpu MHz		: 2000.000
cache size	: 107520 KB
physical id	: 0
siblings	: 2
core id		: 0
cpu cores	: 1
fpu		: yes
fpu_exception	: yes
cpuid level	: 31
wp		: yes
flags		: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ss ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm abm 3dnowprefetch invpcid_single ssbd ibrs ibpb stibp ibrs_enhanced fsgsbase tsc_adjust bmi1 hle avx2 smep bmi2 erms invpcid rtm avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves avx_vnni avx512_bf16 arat avx512vbmi umip pku ospke waitpkg avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq rdpid cldemote movdiri movdir64b fsrm md_clear serialize tsxldtrk amx_bf16 avx512_fp16 amx_tile amx_int8 flush_l1d arch_capabilities
bugs		: spectre_v1 spectre_v2 spec_store_bypass swapgs eibrs_pbrsb
bogomips	: 4000.00
clflush size	: 64
cache_alignment	: 64
address sizes	: 46 bits physical, 48 bits virtual
power management:

processor	: 1
vendor_id	: GenuineIntel
cpu family	: 6
model		: 143
model name	: Intel(R) Xeon(R) Platinum 8480+
flags		: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ss ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm abm 3dnowprefetch invpcid_single ssbd ibrs ibpb stibp ibrs_enhanced fsgsbase tsc_adjust bmi1 hle avx2 smep bmi2 erms invpcid rtm avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves avx_vnni avx512_bf16 arat avx512vbmi umip pku ospke waitpkg avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq rdpid cldemote movdiri movdir64b fsrm md_clear serialize tsxldtrk amx_bf16 avx512_fp16 amx_tile amx_int8 flush_l1d arch_capabilities

"""

EPYC_AVX2 = """processor	: 0
vendor_id	: AuthenticAMD
cpu family	: 25
model		: 1
model name	: AMD EPYC 7763 64-Core Processor
stepping	: 1
microcode	: 0xa0011d1
cpu MHz		: 2445.406
cache size	: 512 KB
physical id	: 0
siblings	: 2
core id		: 0
cpu cores	: 1
fpu		: yes
fpu_exception	: yes
cpuid level	: 16
wp		: yes
flags		: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid extd_apicid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw topoext invpcid_single vmmcall fsgsbase bmi1 avx2 smep bmi2 erms invpcid rdseed adx smap clflushopt clwb sha_ni xsaveopt xsavec xgetbv1 xsaves clzero xsaveerptr rdpru arat npt nrip_save umip pku ospke vaes vpclmulqdq rdpid fsrm
bugs		: sysret_ss_attrs null_seg spectre_v1 spectre_v2 spec_store_bypass srso
bogomips	: 4890.81
TLB size	: 2560 4K pages
clflush size	: 64
cache_alignment	: 64
address sizes	: 48 bits physical, 48 bits virtual
power management:

processor	: 1
vendor_id	: AuthenticAMD
cpu family	: 25
model		: 1
model name	: AMD EPYC 7763 64-Core Processor
flags		: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid extd_apicid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw topoext invpcid_single vmmcall fsgsbase bmi1 avx2 smep bmi2 erms invpcid rdseed adx smap clflushopt clwb sha_ni xsaveopt xsavec xgetbv1 xsaves clzero xsaveerptr rdpru arat npt nrip_save umip pku ospke vaes vpclmulqdq rdpid fsrm

"""

GRAVITON3 = """processor	: 0
BogoMIPS	: 2100.00
Features	: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng
CPU implementer	: 0x41
CPU architecture: 8
CPU variant	: 0x1
CPU part	: 0xd40
CPU revision	: 1

"""

XEON_FLAGS = ["amx_bf16", "amx_int8", "amx_tile", "avx", "avx2", "avx512_bf16", "avx512_fp16", "avx512_vbmi2",
              "avx512_vnni", "avx512bw", "avx512cd", "avx512dq", "avx512f", "avx512vbmi", "avx512vl", "avx_vnni",
              "f16c", "fma", "sse4_1", "sse4_2", "ssse3"]
EPYC_FLAGS = ["avx", "avx2", "f16c", "fma", "sse4_1", "sse4_2", "ssse3"]


def test_cpu_features_of_an_amx_xeon():
    assert cpu_features(XEON_AMX) == {"model": "Intel(R) Xeon(R) Platinum 8480+", "vendor": "GenuineIntel",
                                      "flags": XEON_FLAGS, "cores": 2, "family": "6/143"}


def test_cpu_features_of_an_avx2_only_epyc():
    assert cpu_features(EPYC_AVX2) == {"model": "AMD EPYC 7763 64-Core Processor", "vendor": "AuthenticAMD",
                                       "flags": EPYC_FLAGS, "cores": 2, "family": "25/1"}


def test_cpu_features_of_an_arm_server():
    assert cpu_features(GRAVITON3) == {"model": "ARM part 0xd40", "vendor": "ARM", "cores": 1, "flags": [
        "asimd", "asimddp", "asimdhp", "bf16", "fphp", "i8mm", "sve", "svebf16", "svei8mm"]}


def test_cpu_features_of_this_machine():
    import os

    f = cpu_features()
    assert set(f) - {"family"} == {"model", "vendor", "flags", "cores"} and f["cores"] == os.cpu_count()
    assert f["flags"] == sorted(f["flags"]) and isinstance(f["model"], str) and f["model"]
    if Path("/proc/cpuinfo").is_file() and platform.machine() in ("x86_64", "AMD64"):
        text = Path("/proc/cpuinfo").read_text()
        flags = next(line for line in text.splitlines() if line.startswith("flags")).split(":", 1)[1].split()
        assert ("avx2" in f["flags"]) == ("avx2" in flags) and "sse4_2" in f["flags"]
        assert f["vendor"] in ("GenuineIntel", "AuthenticAMD") and f == cpu_features(text) | {"cores": f["cores"]}
    json.dumps(f)  # goes into manifest.json as it is


def test_cpu_difference():
    xeon, epyc = cpu_features(XEON_AMX), cpu_features(EPYC_AVX2)
    assert cpu_difference(xeon, xeon) is None
    assert cpu_difference(xeon, dict(xeon, cores=96)) is None  # cores are not the ISA
    d = cpu_difference(xeon, epyc)  # recorded on the Xeon, running on the EPYC
    assert d.startswith("recorded on 'Intel(R) Xeon(R) Platinum 8480+', this machine is "
                        "'AMD EPYC 7763 64-Core Processor'")
    assert "this machine lacks amx_bf16, amx_int8, amx_tile, avx512_bf16" in d and "adds" not in d and "\n" not in d
    d = cpu_difference(epyc, xeon)
    assert "this machine adds amx_bf16, amx_int8" in d and "avx512_vnni" in d and "lacks" not in d
    # same model, other flags (a VM that hides AVX-512)
    d = cpu_difference(xeon, dict(xeon, flags=EPYC_FLAGS))
    assert d.startswith("same model 'Intel(R) Xeon(R) Platinum 8480+' but other ISA flags; this machine lacks amx_bf16")
    # other model, same flags
    assert cpu_difference(epyc, dict(epyc, model="AMD EPYC 7B13")) == (
        "recorded on 'AMD EPYC 7763 64-Core Processor', this machine is 'AMD EPYC 7B13'; same ISA flags")
    # a record without flags (no /proc/cpuinfo there): the models alone
    assert cpu_difference(dict(epyc, flags=[]), epyc) is None
    # one name and one set of flags, another generation (a VM naming both "AMD EPYC"): the family numbers tell
    zen4, zen5 = dict(epyc, model="AMD EPYC", family="25/17"), dict(epyc, model="AMD EPYC", family="26/2")
    assert cpu_difference(zen4, zen5) == ("recorded on 'AMD EPYC (family 25/17)', this machine is "
                                          "'AMD EPYC (family 26/2)'; same ISA flags")
    # a record made before the family numbers were kept: not compared
    assert cpu_difference({k: v for k, v in zen4.items() if k != "family"}, zen5) is None
    assert "not compared" in cpu_difference({"model": "arm"}, epyc)


def test_manifest_round_trip_with_and_without_build_machine(tiny_engine_dir, tmp_path):
    m = load_manifest(tiny_engine_dir)
    assert m.build_machine == cpu_features()  # written by build_engine on this machine
    d = m.to_json()
    assert d["build_machine"] == cpu_features()
    back = parse_manifest(json.loads(json.dumps(d)))
    assert back.build_machine == m.build_machine and back.to_json() == d
    # an engine built before build_machine was recorded: loads, and is written back without one
    old = tmp_path / "old"
    shutil.copytree(tiny_engine_dir, old)
    raw = json.loads((old / "manifest.json").read_text())
    del raw["build_machine"]
    (old / "manifest.json").write_text(json.dumps(raw))
    m2 = load_manifest(old)  # files still check: manifest.json is not among them
    assert m2.build_machine == {} and m2.schema_version == 1 and "build_machine" not in m2.to_json()
    m2.write(old)
    assert "build_machine" not in json.loads((old / "manifest.json").read_text())
    # _write_manifest (build, add-dspark, quantize) records this machine when the manifest has none
    from dspark_export.engine_dir.commit import write_manifest as _write_manifest

    _write_manifest(m2, old)
    assert json.loads((old / "manifest.json").read_text())["build_machine"] == cpu_features()
    assert load_manifest(old, rehash=True).build_machine == cpu_features()
    # a foreign build machine is kept as recorded
    m2.build_machine = cpu_features(XEON_AMX)
    _write_manifest(m2, old)
    assert load_manifest(old).build_machine["model"] == "Intel(R) Xeon(R) Platinum 8480+"


def _engine_with(tiny_engine_dir, tmp_path, probe_cpu=None, table_cpu=None, **probe_extra):
    d = tmp_path / "e"
    if not d.exists():
        shutil.copytree(tiny_engine_dir, d)
    raw = json.loads((d / "manifest.json").read_text())
    sha = raw["graphs"]["target"]["files"][0]["sha256"]
    probe = {"row_multiple": 2, "backend": "ort", "target_sha256": sha, "threads": 1, **probe_extra}
    table = {"tokens": [1, 2, 4], "seconds": [0.01, 0.012, 0.015], "t_draft": 0.002,
             "t_verify": [0.008, 0.01, 0.013], "machine": "x", "threads": 1}
    if probe_cpu is not None:
        probe["cpu"] = probe_cpu
    if table_cpu is not None:
        table["cpu"] = table_cpu
    raw["speculation"].update(row_invariance=probe, cost_table=table)
    (d / "manifest.json").write_text(json.dumps(raw))
    return d


def _load_warnings(d, **kw):
    from dspark_runtime import Engine

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng = Engine.load(d, threads=1, **kw)
    return eng, [str(w.message) for w in caught if issubclass(w.category, OtherCpuWarning)], caught


def test_load_warns_when_probe_and_cost_table_come_from_another_cpu(tiny_engine_dir, tmp_path):
    here = cpu_features()
    other = cpu_features(XEON_AMX) if here["model"] != "Intel(R) Xeon(R) Platinum 8480+" else cpu_features(EPYC_AVX2)
    d = _engine_with(tiny_engine_dir, tmp_path, probe_cpu=other, table_cpu=other)
    eng, msgs, _ = _load_warnings(d)
    assert eng.row_multiple == 2  # the probe is still applied; the warning says to re-probe
    assert len(msgs) == 1, msgs  # one warning for the engine, naming both records
    msg = msgs[0]
    assert msg.startswith(f"{d}: the row padding probe and the cost table were measured on another CPU ("
                          f"{cpu_difference(other, here)})")
    assert f"recorded on {other['model']!r}, this machine is {here['model']!r}" in msg
    assert f"run `dspark-export profile {d}` on this machine" in msg
    # only the cost table from elsewhere
    d = _engine_with(tiny_engine_dir, tmp_path, probe_cpu=here, table_cpu=other)
    _, msgs, _ = _load_warnings(d)
    assert len(msgs) == 1 and "the cost table (speculation.cost_table) was measured on another CPU" in msgs[0]
    assert "row padding probe" not in msgs[0]
    # only the probe from elsewhere; passing row_multiple explicitly leaves the probe unused: no warning
    d = _engine_with(tiny_engine_dir, tmp_path, probe_cpu=other, table_cpu=here)
    _, msgs, _ = _load_warnings(d)
    assert len(msgs) == 1 and "the row padding probe (speculation.row_invariance) was measured" in msgs[0]
    _, msgs, _ = _load_warnings(d, row_multiple=1)
    assert msgs == []


def test_load_does_not_warn_on_this_cpu_or_for_older_records(tiny_engine_dir, tmp_path):
    here = cpu_features()
    for probe_cpu, table_cpu in [(here, here), (None, None), (dict(here, cores=(here["cores"] or 1) + 64), None)]:
        d = _engine_with(tiny_engine_dir, tmp_path, probe_cpu=probe_cpu, table_cpu=table_cpu)
        eng, msgs, caught = _load_warnings(d)
        assert eng.row_multiple == 2 and msgs == [] and caught == [], [str(w.message) for w in caught]


def test_info_shows_build_machine_and_measurement_cpus(tiny_engine_dir, tmp_path):
    from click.testing import CliRunner

    from dspark_runtime.cli import cli

    d = _engine_with(tiny_engine_dir, tmp_path, probe_cpu=cpu_features(XEON_AMX), table_cpu=cpu_features())
    r = CliRunner().invoke(cli, ["info", "--engine", str(d)])
    assert r.exit_code == 0, r.output
    here = cpu_features()
    lines = {ln.strip().split(":", 1)[0]: ln.strip() for ln in r.output.splitlines()}
    fam = f", family {here['family']}" if "family" in here else ""  # x86 family/model
    assert lines["build machine"] == (f"build machine: {here['model']} ({here['vendor']}{fam}, {here['cores']} cores; "
                                      f"ISA {' '.join(here['flags'])}) — this machine's CPU")
    assert lines["row probe CPU"].startswith("row probe CPU: Intel(R) Xeon(R) Platinum 8480+ (GenuineIntel, family 6/143, "
                                             "2 cores;")
    assert "NOT this machine's CPU" in lines["row probe CPU"] or here["model"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert lines["cost table"] == "cost table: verify B = 1..4 tokens, measured on x, 1 threads"
    assert lines["cost table CPU"].endswith("— this machine's CPU")


def test_profile_records_the_cpu_and_is_not_warned_by_what_it_replaces(tiny_engine_dir, tmp_path):
    from dspark_export.fit.cost_profile import profile_engine

    d = _engine_with(tiny_engine_dir, tmp_path, probe_cpu=cpu_features(XEON_AMX), table_cpu=cpu_features(EPYC_AVX2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profile_engine(d, max_tokens=2, repeats=1, context=8, threads=1)
    assert not [w for w in caught if issubclass(w.category, OtherCpuWarning)]
    spec = json.loads((d / "manifest.json").read_text())["speculation"]
    assert spec["row_invariance"]["cpu"] == cpu_features() and spec["cost_table"]["cpu"] == cpu_features()
    _, msgs, _ = _load_warnings(d)
    assert msgs == []


def test_u8s8_probe_returns_a_bool_consistent_with_the_arithmetic():
    from dspark_runtime.machine.kernel_probe import PROBE_K, PROBE_M, PROBE_N, u8s8_product, u8s8_saturates

    got, exact = u8s8_product()
    assert got.shape == exact.shape == (PROBE_M, PROBE_N)
    assert (exact == 255 * 127 * PROBE_K).all()  # 2072640: every pair sum 64770 overflows int16
    saturated = (PROBE_K // 2) * 32767  # VPMADDUBSW clips each pair sum to 32767
    assert ((got == exact).all() or (got == saturated).all()), got
    s = u8s8_saturates()
    assert type(s) is bool and s == bool((got != exact).any()) and u8s8_saturates() is s
    if "avx512_vnni" in cpu_features()["flags"] or "avx_vnni" in cpu_features()["flags"]:
        assert s is False  # VPDPBUSD accumulates in int32


def test_the_shipped_probe_graph_is_the_u8s8_product_it_names():
    """The probe's graph ships serialized (the runtime has no onnx): it is MatMulInteger of a uint8 [M, K] input and
    a constant int8 [K, N] weight of 127, as onnx builds it."""
    onnx = pytest.importorskip("onnx")
    from onnx import numpy_helper

    from dspark_runtime.machine.kernel_probe import PROBE_GRAPH, PROBE_K, PROBE_M, PROBE_N

    m = onnx.load(str(PROBE_GRAPH))
    onnx.checker.check_model(m)
    (node,) = m.graph.node
    assert node.op_type == "MatMulInteger" and list(node.input) == ["A", "B"] and node.domain == ""
    (w,) = m.graph.initializer
    b = numpy_helper.to_array(w)
    assert b.dtype == np.int8 and b.shape == (PROBE_K, PROBE_N) and (b == 127).all()
    dims = [[d.dim_value for d in v.type.tensor_type.shape.dim] for v in (m.graph.input[0], m.graph.output[0])]
    assert dims == [[PROBE_M, PROBE_K], [PROBE_M, PROBE_N]]
    assert m.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.UINT8


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("qemu-x86_64") is None,
                    reason="needs qemu-user (qemu-x86_64 >= 7.2, which emulates AVX2 but not VNNI)")
def test_u8s8_probe_sees_avx2_saturation_under_an_emulated_haswell():
    pytest.importorskip("onnx")
    ver = subprocess.run(["qemu-x86_64", "--version"], capture_output=True, text=True).stdout.split()
    major, minor = (int(x) for x in ver[2].split(".")[:2])
    if (major, minor) < (7, 2):
        pytest.skip("qemu before 7.2 does not emulate AVX2")
    code = ("from dspark_runtime.machine.kernel_probe import u8s8_product, u8s8_saturates\n"
            "g, e = u8s8_product(); print(int(g[0, 0]), int(e[0, 0]), u8s8_saturates())")
    r = subprocess.run(["qemu-x86_64", "-cpu", "Haswell", sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=300, cwd=Path(__file__).resolve().parents[3])
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["1048544", "2072640", "True"]  # 32 x 32767: the AVX2 kernel saturated


def test_load_warns_when_8bit_u8s8_weights_meet_a_saturating_kernel(tiny_engine_dir, tmp_path, monkeypatch):
    from dspark_runtime.machine import kernel_probe

    d = _engine_with(tiny_engine_dir, tmp_path)
    raw = json.loads((d / "manifest.json").read_text())
    raw["graphs"]["draft"]["precision"] = "int8"  # as an 8-bit int8 writer run on a VNNI machine records it
    raw["graphs"]["draft"]["quantization"] = {"precision": "int8", "reduce_range": False}
    (d / "manifest.json").write_text(json.dumps(raw))
    monkeypatch.setattr(kernel_probe, "u8s8_saturates", lambda: True)
    _, msgs, _ = _load_warnings(d)
    assert any("draft hold 8-bit U8S8 weights" in m and "saturates" in m for m in msgs), msgs
    monkeypatch.setattr(kernel_probe, "u8s8_saturates", lambda: False)
    _, msgs, _ = _load_warnings(d)
    assert not any("U8S8" in m for m in msgs), msgs
