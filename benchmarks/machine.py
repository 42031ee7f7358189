"""The machine a benchmark ran on, in one line: the CPU's model name and the vector extensions that decide its
float32 and bfloat16 speed, since "x86_64, 2 CPU cores" fits machines 1.6x apart (an AMD EPYC with AVX2 only
and an Intel Xeon with AVX-512 and AMX both read so)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

EXTENSIONS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
"""The /proc/cpuinfo flags named in the line, when the CPU has them."""


def describe(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """e.g. 'Intel(R) Xeon(R) Processor (x86_64; avx2, avx512f, amx_bf16), 2 CPU cores'; where there is no
    cpuinfo (not Linux), what the platform module knows."""
    name, flags = platform.processor() or platform.machine(), ""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        text = ""
    first = text.split("\n\n")[0]  # the first processor's block
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first.splitlines() if ":" in line)}
    if fields.get("model name"):
        have = set(fields.get("flags", "").split())
        flags = ", ".join(f for f in EXTENSIONS if f in have)
        name = f"{fields['model name']} ({platform.machine()}{'; ' + flags if flags else ''})"
    return f"{name}, {os.cpu_count()} CPU cores"
