"""A one-line description of the machine, recorded with every measurement (benchmarks, cost tables)."""
from __future__ import annotations

import os
import platform
from pathlib import Path


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
