"""Engine tarballs: `dspark-export pack`, `dspark unpack`, `Engine.load("x.tar.gz")`, checksum refusals."""
import io
import shutil
import tarfile

import pytest

from dspark_runtime.errors import ManifestError


def _retar(src, dst, change=None, extra=None):
    """Copy tarball ``src`` to ``dst``; ``change(name, bytes) -> bytes`` edits members, ``extra`` adds one."""
    with tarfile.open(src, "r:gz") as a, tarfile.open(dst, "w:gz") as b:
        for m in a.getmembers():
            data = a.extractfile(m).read() if m.isfile() else None
            if data is not None and change is not None:
                data = change(m.name, data)
                m.size = len(data)
            b.addfile(m, io.BytesIO(data) if data is not None else None)
        if extra is not None:
            name, data = extra
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            b.addfile(ti, io.BytesIO(data))


@pytest.fixture(scope="module")
def packed(tiny_engine_dir, tmp_path_factory):
    from dspark_runtime.engine_dir.artifact import pack

    out = tmp_path_factory.mktemp("pack") / "tiny.tar.gz"
    return pack(tiny_engine_dir, out), out


def test_pack_unpack_round_trip_and_load(packed, tiny_engine_dir, tmp_path, monkeypatch):
    from dspark_runtime import Engine
    from dspark_runtime.engine_dir.artifact import unpack
    from dspark_runtime.engine_dir.manifest import load_manifest, sha256_file

    info, out = packed
    m = load_manifest(tiny_engine_dir)
    assert info["files"] == 1 + len(m.all_files()) and info["sha256"] == sha256_file(out)
    assert (out.parent / "tiny.tar.gz.sha256").read_text() == f"{info['sha256']}  tiny.tar.gz\n"
    with tarfile.open(out) as t:
        names = t.getnames()
    assert names[0] == "tiny/manifest.json" and ".dspark-verified.json" not in " ".join(names)
    d = unpack(out, tmp_path / "u")
    assert d == tmp_path / "u" / "tiny"
    for f in m.all_files():
        assert (d / f.path).read_bytes() == (tiny_engine_dir / f.path).read_bytes()
    assert [p.name for p in (tmp_path / "u").iterdir()] == ["tiny"]  # no temporary folder left behind
    # Engine.load unpacks into the cache once and generates the same tokens as the directory
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    a = Engine.load(out, threads=1).generate("def add(a, b):", max_new_tokens=12, draft=None)
    b = Engine.load(tiny_engine_dir, threads=1).generate("def add(a, b):", max_new_tokens=12, draft=None)
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0
    assert len(list((tmp_path / "cache" / "engines").iterdir())) == 1
    Engine.load(out, threads=1)  # second load reuses the unpacked copy
    assert len(list((tmp_path / "cache" / "engines").iterdir())) == 1


def test_unpack_refuses_a_corrupted_member(packed, tmp_path):
    from dspark_runtime.engine_dir.artifact import unpack

    _, out = packed
    bad = tmp_path / "bad.tar.gz"
    _retar(out, bad, change=lambda n, b: (b[:-1] + bytes([b[-1] ^ 1])) if n.endswith("target.onnx.data") else b)
    with pytest.raises(ManifestError, match=r"target.onnx.data is corrupted: sha256 .* does not match"):
        unpack(bad, tmp_path / "u")
    assert list((tmp_path / "u").iterdir()) == []  # nothing half-unpacked remains


def test_unpack_refuses_unlisted_members_and_bad_sidecar(packed, tmp_path):
    from dspark_runtime.engine_dir.artifact import unpack

    _, out = packed
    evil = tmp_path / "evil.tar.gz"
    _retar(out, evil, extra=("tiny/../../escape.txt", b"x"))
    with pytest.raises(ManifestError, match="is not a file the manifest lists"):
        unpack(evil, tmp_path / "u")
    assert not (tmp_path / "escape.txt").exists()
    copy = tmp_path / "copy.tar.gz"
    shutil.copy(out, copy)
    (tmp_path / "copy.tar.gz.sha256").write_text("0" * 64 + "  copy.tar.gz\n")
    with pytest.raises(ManifestError, match="does not match its checksum file copy.tar.gz.sha256"):
        unpack(copy, tmp_path / "u2")
    (tmp_path / "junk.tar.gz").write_bytes(b"not gzip")
    with pytest.raises(ManifestError, match="not a readable gzip tarball"):
        unpack(tmp_path / "junk.tar.gz", tmp_path / "u3")


def test_pack_refuses_a_corrupted_engine(tiny_engine_dir, tmp_path):
    from dspark_runtime.engine_dir.artifact import pack

    d = tmp_path / "e"
    shutil.copytree(tiny_engine_dir, d)
    p = d / "draft.onnx.data"
    raw = bytearray(p.read_bytes())
    raw[10] ^= 0xFF
    p.write_bytes(bytes(raw))
    with pytest.raises(ManifestError, match="draft.onnx.data is corrupted"):
        pack(d, tmp_path / "x.tar.gz")
    assert not (tmp_path / "x.tar.gz").exists()
    with pytest.raises(ManifestError, match=r"name the tarball \*.tar.gz"):
        pack(tiny_engine_dir, tmp_path / "x.zip")


def test_pack_and_unpack_clis(tiny_engine_dir, tmp_path):
    from click.testing import CliRunner

    from dspark_export.cli import cli as export_cli
    from dspark_runtime.cli import cli as runtime_cli

    r = CliRunner().invoke(export_cli, ["pack", str(tiny_engine_dir), "-o", str(tmp_path / "t.tgz")])
    assert r.exit_code == 0, r.output
    assert "t.tgz: " in r.output and "sha256" in r.output
    r = CliRunner().invoke(runtime_cli, ["unpack", str(tmp_path / "t.tgz"), "-o", str(tmp_path / "u")])
    assert r.exit_code == 0, r.output
    assert "unpacked and verified" in r.output and (tmp_path / "u" / "tiny" / "manifest.json").is_file()
