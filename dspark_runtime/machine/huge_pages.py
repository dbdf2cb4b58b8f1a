"""Transparent huge pages (THP) for the weights ONNX Runtime holds. A decoding step streams every prepacked weight
(~1 GB for the int4 1.5B target) from memory ONNX Runtime allocated with ``malloc``; where the kernel gives huge pages
only to memory that asks for them (``/sys/kernel/mm/transparent_hugepage/enabled`` = ``madvise``, the usual
default), those weights sit on 4 KiB pages and the step pays TLB misses (measured in docs/precision.md, "Huge pages
for the weights").

Two ways to ask, one per kind of caller:

- :func:`HugePagesForNewMemory`: around the creation of an ONNX Runtime session, advises huge pages for the
  anonymous memory that appeared meanwhile (``madvise(MADV_HUGEPAGE)``) and collapses it into huge pages at once
  (``MADV_COLLAPSE``, Linux >= 6.1: a copy, ~2 s per GB). What :class:`~dspark_runtime.backends.ort.OrtDecoder`
  does, so an embedding application gets it too.
- :func:`exec_with_huge_page_malloc`: the ``dspark`` command starts itself again with glibc's
  ``glibc.malloc.hugetlb=1`` tunable (glibc >= 2.35), so ``malloc`` asks for huge pages when it maps memory and
  nothing needs collapsing (session creation is faster too).

``DSPARK_HUGE_PAGES=0`` turns both off. Neither does anything where THP is ``always`` (every large mapping already
gets huge pages), ``never``, or absent (not Linux). Failures (an old kernel without ``MADV_COLLAPSE``, no free huge
page) leave the memory as it was: never an error.
"""
from __future__ import annotations

import ctypes
import os
import platform
import sys
from pathlib import Path

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
PROC_SELF_MAPS = Path("/proc/self/maps")
HUGE_PAGE = 2 << 20  # bytes; x86-64 and arm64 with 4 KiB base pages
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
#: glibc's tunable that makes malloc madvise the memory it maps (glibc >= 2.35)
MALLOC_TUNABLE = "glibc.malloc.hugetlb=1"
ENV_SWITCH = "DSPARK_HUGE_PAGES"


def thp_mode() -> str | None:
    """The kernel's THP mode for anonymous memory: "always", "madvise" or "never"; None where there is no THP."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def wanted() -> bool:
    """Whether asking for huge pages can change anything here: THP in ``madvise`` mode and not turned off with
    ``DSPARK_HUGE_PAGES=0``."""
    return os.environ.get(ENV_SWITCH, "1") != "0" and thp_mode() == "madvise"


def _writable_anonymous_ranges() -> set:
    """(start, end) addresses of this process's writable anonymous mappings and its heap."""
    out = set()
    for line in PROC_SELF_MAPS.read_text().splitlines():
        parts = line.split()
        if len(parts) < 5 or "w" not in parts[1] or (len(parts) > 5 and parts[5] != "[heap]"):
            continue
        lo, hi = parts[0].split("-")
        out.add((int(lo, 16), int(hi, 16)))
    return out


class HugePagesForNewMemory:
    """Context manager: on exit, the writable anonymous memory mapped inside the block (whole huge pages of it) is
    advised to use huge pages and collapsed into them. ``advised_bytes`` / ``collapsed_bytes``: how much, after exit
    (0 where :func:`wanted` is False or ``enabled`` is False: then it does nothing)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.advised_bytes = self.collapsed_bytes = 0
        self._before = None

    def __enter__(self) -> HugePagesForNewMemory:
        if self.enabled and wanted():
            self._before = _writable_anonymous_ranges()
        return self

    def __exit__(self, *exc) -> bool:
        if self._before is None or exc[0] is not None:
            return False
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        for lo, hi in sorted(_writable_anonymous_ranges() - self._before):
            start, end = -(-lo // HUGE_PAGE) * HUGE_PAGE, hi // HUGE_PAGE * HUGE_PAGE
            if end - start < HUGE_PAGE or libc.madvise(start, end - start, MADV_HUGEPAGE) != 0:
                continue
            self.advised_bytes += end - start
            if libc.madvise(start, end - start, MADV_COLLAPSE) == 0:
                self.collapsed_bytes += end - start
        return False


def malloc_asks_for_huge_pages() -> bool:
    """Whether this process started with glibc's :data:`MALLOC_TUNABLE`."""
    return MALLOC_TUNABLE in os.environ.get("GLIBC_TUNABLES", "").split(":")


def exec_with_huge_page_malloc() -> None:
    """Start this process's command again (``sys.orig_argv``, same environment) with :data:`MALLOC_TUNABLE` added
    to ``GLIBC_TUNABLES``, where it can help (:func:`wanted`, glibc >= 2.35) and is not set yet. Returns only where it
    does not (or the exec fails); otherwise never returns. Call it first thing in a command's entry point."""
    libc, version = platform.libc_ver()
    if libc != "glibc" or malloc_asks_for_huge_pages() or not wanted():
        return
    try:
        if tuple(int(x) for x in version.split(".")[:2]) < (2, 35):
            return
    except ValueError:
        return
    argv = list(getattr(sys, "orig_argv", []))
    if not argv:
        return
    env = dict(os.environ)
    env["GLIBC_TUNABLES"] = ":".join(t for t in (env.get("GLIBC_TUNABLES"), MALLOC_TUNABLE) if t)
    try:
        os.execve(sys.executable, [sys.executable, *argv[1:]], env)
    except OSError:
        return
