"""tests/sanitize_gpu.py's case lists, on any machine: every case's arguments bind to its test's
signature. A case that did not (the forward's flag cases lacked their config) failed only on a GPU,
under compute-sanitizer."""

import inspect

import pytest
import sanitize_gpu


@pytest.mark.parametrize(
    "cases",
    [
        lambda: sanitize_gpu.flash_cases(),
        lambda: sanitize_gpu.flash_cases("redo"),
        lambda: sanitize_gpu.redo_cases(),
        lambda: sanitize_gpu.checks_cases(),
        lambda: sanitize_gpu.bounds_cases(),
        lambda: sanitize_gpu.handler_cases(None),
    ],
    ids=["flash", "flash-redo", "redo", "checks", "bounds", "handlers"],
)
def test_every_case_binds_to_its_test(cases):
    listed = cases()
    assert listed
    for fn, args in listed:
        inspect.signature(fn).bind(*args)  # raises TypeError where a case's arguments do not fit
