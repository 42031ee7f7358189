"""benchmarks/machine.py: the one line that names the machine in every benchmark's header."""

from __future__ import annotations

from builders import benchmark_module

machine = benchmark_module("machine")

BLOCK = "processor\t: {i}\nvendor_id\t: GenuineIntel\nmodel name\t: {name}\nflags\t\t: fpu sse2 {flags}\n"


def test_names_the_first_processor_and_the_extensions_that_set_its_speed(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(BLOCK.format(i=0, name="Some Xeon", flags="avx2 avx512f amx_bf16 amx_tile") + "\n"
                    + BLOCK.format(i=1, name="Other", flags=""))
    line = machine.describe(info)
    assert line.startswith("Some Xeon (") and "; avx2, avx512f, amx_bf16)" in line and "Other" not in line
    assert "amx_tile" not in line and line.endswith(" CPU cores")


def test_a_cpu_without_the_extensions_or_without_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(BLOCK.format(i=0, name="Plain CPU", flags="sse4_2"))
    assert "Plain CPU (" in machine.describe(info) and ";" not in machine.describe(info)
    assert machine.describe(tmp_path / "missing").endswith(" CPU cores")  # the platform's name instead
