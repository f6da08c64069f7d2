"""benchmarks.ncu's reading of Nsight Compute's CSV pages (the profiling itself needs a Hopper GPU)."""

import pytest

from benchmarks import ncu

# The SASS page's layout as ncu 2025.3 writes it (columns cut to those read, plus two it skips).
_HEADER = (
    '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_long_sb",'
    '"stall_wait","stall_wait (Not Issued)","Address Space"'
)


def _kernel(rows: list[str]) -> str:
    return '"Kernel Name","entry_mosaic_gpu_kernel",\n' + _HEADER + "\n" + "\n".join(rows) + "\n"


SASS = _kernel(
    [
        '"0x7f00","      LDC R1, c[0x0][0x28]","92","24,576","0","3","1","-"',
        '"0x7f10","@!P1  BRA 0x7fa33b7bfbe0","20874","1,000","20000","0","0","-"',
        '"0x7f20","      HGMMA.64x136x16.F32.BF16 R92, R36, gdesc[UR24].tnspB, R92",'
        '"2210","4259840","0","900","5","-"',
        '"0x7f30","      HGMMA.64x8x16.F32.BF16 R156, R24, gdesc[UR12], R156",'
        '"3413","4259840","0","1000","0","-"',
        '"0x7f40","      FADD R3, R16, R3","10","300","0","0","0","-"',
    ]
) + _kernel(
    [
        '"0x8f00","      HGMMA.64x128x16.F32.BF16 R92, R36, gdesc[UR24].tnspB, R92",'
        '"5000","8519680","0","0","0","-"',
        '"0x8f10","      FADD R3, R16, R3","7","100","0","0","0","-"',
    ]
)


def test_sass_page_is_summed_per_kernel_by_opcode_and_tensor_core_shape():
    k1, k2 = ncu.parse_sass(SASS)
    assert k1["by_opcode"]["BRA"] == [1000, 20874]  # a predicated instruction: the opcode after @!P1
    assert k1["by_opcode"]["HGMMA"] == [2 * 4259840, 2210 + 3413]
    assert k1["by_opcode"]["LDC"] == [24576, 92]  # counts with thousands separators
    assert k1["hgmma"] == {"64x136x16": 4259840, "64x8x16": 4259840}
    assert k1["stalls"] == {"long_sb": 20000, "wait": 1903}  # "(Not Issued)" columns left out
    assert k2["hgmma"] == {"64x128x16": 8519680} and k2["by_opcode"]["FADD"] == [100, 7]


def _details(rows):
    head = '"ID","Process ID","Kernel Name","Grid Size","Section Name","Metric Name","Metric Unit",'
    head += '"Metric Value"'
    return head + "\n" + "\n".join(rows) + "\n"


DETAILS = _details(
    [
        '"0","1","entry","(1, 64, 32)","GPU Speed Of Light Throughput","Duration","ms","1.00"',
        '"0","1","entry","(1, 64, 32)","Launch Statistics","Grid Size","","2,048"',
        '"0","1","entry","(1, 64, 32)","Launch Statistics","Registers Per Thread","register/thread","168"',
        '"0","1","entry","(1, 64, 32)","Instruction Statistics","Executed Instructions","inst","345,122,664"',
        '"0","1","entry","(1, 64, 32)","","","",""',  # a rule's row: no metric
        '"1","1","entry","(1, 64, 32)","GPU Speed Of Light Throughput","Duration","us","926.59"',
        '"1","1","entry","(1, 64, 32)","Launch Statistics","Grid Size","","2,048"',
        '"1","1","entry","(1, 64, 32)","Instruction Statistics","Executed Instructions","inst","286,318,404"',
    ]
)


def test_details_page_gives_each_kernels_time_in_ms_grid_and_instructions():
    a, b = ncu.parse_details(DETAILS)
    assert a == {"kernel": "entry", "ms": 1.0, "grid": 2048, "registers": 168, "instructions": 345122664}
    assert b["ms"] == pytest.approx(0.92659) and b["instructions"] == 286318404


def test_details_page_in_another_layout_or_unit_is_an_error():
    with pytest.raises(ValueError, match="expected ID, Metric Name"):
        ncu.parse_details('"Kernel","Value"\n"a","1"\n')
    with pytest.raises(ValueError, match="Duration in 'cycle'"):
        ncu.parse_details(_details(['"0","1","e","(1)","S","Duration","cycle","5"']))


def test_kernels_are_labelled_by_call_and_the_backwards_by_grid():
    details = [{"grid": 2048}, {"grid": 512}, {"grid": 2048}, {"grid": 2048}, {"grid": 512}]
    launches = [
        {"label": "forward, checks", "kernels": {"": 2048}},
        {"label": "backward, checks", "kernels": {"dq": 2048, "dk/dv": 512}},  # dk/dv ran first
        {"label": "backward, no checks", "kernels": {"dq": 2048, "dk/dv": 512}},
    ]
    labels = ncu.label_kernels(details, launches)
    assert labels == [
        "forward, checks",
        "backward, checks: dk/dv",
        "backward, checks: dq",
        "backward, no checks: dq",
        "backward, no checks: dk/dv",
    ]
    with pytest.raises(ValueError, match="launched 1 kernels; expected 2"):
        ncu.label_kernels(details[:2], launches[:2] + launches[1:2])
    with pytest.raises(ValueError, match="a grid of 999 blocks"):
        ncu.label_kernels([{"grid": 2048}, {"grid": 999}], launches[1:2])
    # H == KV: the two backward kernels share a grid, so they are numbered in launch order.
    same = [{"label": "backward, checks", "kernels": {"dq": 512, "dk/dv": 512}}]
    assert ncu.label_kernels([{"grid": 512}] * 2, same) == [
        "backward, checks: kernel 1",
        "backward, checks: kernel 2",
    ]


def test_rows_add_what_the_checks_add_per_kernel():
    sass = ncu.parse_sass(SASS)
    details = [{"ms": 1.0, "instructions": 345e6}, {"ms": 0.9, "instructions": 286e6}]
    rows = ncu.rows_from(details, sass, ["forward, checks", "forward, no checks"])
    assert [r["kernel"] for r in rows] == [
        "forward, checks",
        "forward, no checks",
        "forward, what the checks add",
    ]
    add = rows[2]
    assert add["ms"] == pytest.approx(0.1) and add["instructions_m"] == pytest.approx(59.0)
    assert add["top_opcodes_m"]["LDC"] == pytest.approx(0.02)  # 24,576 more: the unchecked kernel has none
    assert rows[0]["hgmma_m"] == {"64x136x16": 4.26, "64x8x16": 4.26}
    text = ncu.format_rows(rows).splitlines()
    assert len(text) == 6 and text[0].startswith("forward, checks") and "345.0 M instructions" in text[0]
    assert "LDC +0.0" in text[5]  # the additions are signed


def test_without_ncu_it_says_so(monkeypatch):
    monkeypatch.setattr(ncu, "find_ncu", lambda: None)
    with pytest.raises(SystemExit, match="no ncu"):
        ncu.main([])
