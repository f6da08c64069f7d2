"""The import-time warning about XLA settings that protected GEMMs misbehaved under."""

import os
import subprocess
import sys

import pytest

from pimlayers._xla_flags import command_buffer_hazards

CB = "--xla_gpu_enable_command_buffer="


@pytest.mark.parametrize(
    ("flags", "found"),
    [
        ("", ()),
        ("--xla_gpu_enable_command_buffer=+COLLECTIVES", ()),
        ("--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL", ("WHILE", "CONDITIONAL")),
        ("--xla_gpu_enable_command_buffer=fusion,while", ("WHILE",)),
        ("--xla_gpu_enable_command_buffer=+WHILE,-WHILE", ()),
        ("--xla_gpu_enable_command_buffer=", ()),  # command buffers off
        # Settings apply in order: a plain list replaces what came before, +/- change it.
        (f"{CB}+CONDITIONAL --xla_dump_to=/x {CB}FUSION", ()),
        (f"{CB}+WHILE {CB}+CONDITIONAL", ("WHILE", "CONDITIONAL")),
        (f"{CB}+WHILE {CB}", ()),  # an empty list turns command buffers off
        (
            "--xla_gpu_enable_command_buffer=FUSION --xla_gpu_enable_command_buffer=+conditional",
            ("CONDITIONAL",),
        ),
        ("--xla_gpu_graph_min_graph_size=2", ()),
    ],
)
def test_hazardous_command_types_are_read_as_xla_reads_the_flag(flags, found):
    assert command_buffer_hazards(flags) == found


@pytest.mark.parametrize(("flags", "warns"), [("--xla_gpu_enable_command_buffer=+WHILE", True), ("", False)])
def test_importing_pimlayers_warns_once_under_a_hazardous_setting(flags, warns):
    code = "import warnings; warnings.simplefilter('always'); import pimlayers"
    env = dict(os.environ, XLA_FLAGS=flags)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stderr.count("XLA_FLAGS enables command buffers for WHILE") == (1 if warns else 0), out.stderr
