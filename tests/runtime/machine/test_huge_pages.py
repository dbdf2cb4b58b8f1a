"""Huge pages for the weights (dspark_runtime/machine/huge_pages.py): new memory advised and collapsed with its
contents intact, the switch that turns it off, and when the ``dspark`` command starts itself again."""
import sys

import numpy as np
import pytest

from dspark_runtime.machine import huge_pages


def test_thp_mode_reads_the_bracketed_choice(tmp_path, monkeypatch):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "THP_ENABLED", f)
    assert huge_pages.thp_mode() == "madvise"
    f.write_text("[always] madvise never\n")
    assert huge_pages.thp_mode() == "always" and not huge_pages.wanted()
    monkeypatch.setattr(huge_pages, "THP_ENABLED", tmp_path / "absent")
    assert huge_pages.thp_mode() is None and not huge_pages.wanted()


@pytest.mark.skipif(huge_pages.thp_mode() != "madvise", reason="needs Linux THP in madvise mode")
def test_new_memory_is_advised_and_collapsed_with_its_contents_intact(monkeypatch):
    monkeypatch.delenv(huge_pages.ENV_SWITCH, raising=False)
    old = np.arange(1 << 20, dtype=np.int64)  # mapped before the block: not advised
    with huge_pages.HugePagesForNewMemory() as advice:
        new = np.random.default_rng(0).integers(0, 255, 48 << 20, dtype=np.uint8)
    want = new.copy()
    assert 46 << 20 <= advice.advised_bytes < (48 << 20) + (old.nbytes + (64 << 20))
    assert advice.collapsed_bytes <= advice.advised_bytes
    np.testing.assert_array_equal(new, want)
    np.testing.assert_array_equal(old, np.arange(1 << 20, dtype=np.int64))


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV_SWITCH, "0")
    assert not huge_pages.wanted()
    with huge_pages.HugePagesForNewMemory() as advice:
        a = np.ones(8 << 20, np.uint8)
    assert advice.advised_bytes == advice.collapsed_bytes == 0 and a.sum() == 8 << 20


@pytest.fixture
def execs(monkeypatch):
    """os.execve recorded instead of run; THP in madvise mode, glibc 2.36, the switch unset, no tunables."""
    calls = []
    monkeypatch.setattr(huge_pages.os, "execve", lambda path, argv, env: calls.append((path, argv, env)))
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(huge_pages.platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(sys, "orig_argv", ["/usr/bin/python3", "/venv/bin/dspark", "generate", "--engine", "e"])
    monkeypatch.delenv(huge_pages.ENV_SWITCH, raising=False)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    return calls


def test_the_command_starts_again_with_huge_page_malloc(execs):
    huge_pages.exec_with_huge_page_malloc()
    [(path, argv, env)] = execs
    assert path == sys.executable and argv == [sys.executable, "/venv/bin/dspark", "generate", "--engine", "e"]
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"


@pytest.mark.parametrize("case", ["already set", "switched off", "old glibc", "musl", "THP always"])
def test_the_command_is_not_started_again(execs, monkeypatch, case):
    if case == "already set":
        monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    elif case == "switched off":
        monkeypatch.setenv(huge_pages.ENV_SWITCH, "0")
    elif case == "old glibc":
        monkeypatch.setattr(huge_pages.platform, "libc_ver", lambda: ("glibc", "2.31"))
    elif case == "musl":
        monkeypatch.setattr(huge_pages.platform, "libc_ver", lambda: ("", ""))
    else:
        monkeypatch.setattr(huge_pages, "thp_mode", lambda: "always")
    huge_pages.exec_with_huge_page_malloc()
    assert execs == []


def test_dspark_main_with_argv_never_starts_again(execs, capsys):
    from dspark_runtime.cli import main

    main(["--version"])
    assert execs == [] and "version 0." in capsys.readouterr().out


@pytest.mark.parametrize("asked", [True, False])
def test_an_ort_session_asks_for_huge_pages_unless_told_not_to(tiny_engine_dir, monkeypatch, asked):
    """OrtDecoder.activate creates its session inside HugePagesForNewMemory(huge_pages): the advice runs (where THP
    is in madvise mode) only when the decoder was made with huge_pages=True."""
    import dspark_runtime.backends.ort as ort_backend
    from dspark_runtime.engine_dir.manifest import load_manifest

    seen = []

    class Recording(huge_pages.HugePagesForNewMemory):
        def __exit__(self, *exc):
            seen.append(self.enabled)
            return super().__exit__(*exc)

    monkeypatch.setattr(ort_backend, "HugePagesForNewMemory", Recording)
    g = load_manifest(tiny_engine_dir, verify=False).graphs["target"]
    dec = ort_backend.OrtDecoder(tiny_engine_dir / g.model_file, g.spec, threads=1, huge_pages=asked).activate()
    assert dec.session is not None and seen == [asked]
