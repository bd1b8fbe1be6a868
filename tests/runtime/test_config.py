"""The PAGEDVK_* variables: parsed in one place, a bad value refused by name before anything is submitted."""

import pytest

from support import PROBLEM, program, run_python
from pagedvk import config


@pytest.mark.parametrize("value", ["abc", "-1", "0", "inf", "nan", "1e30", ""])
def test_bad_timeout_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("PAGEDVK_TIMEOUT", value)
    if value == "":
        assert config.timeout_ns() == 60 * 10**9   # empty means unset
        return
    with pytest.raises(ValueError, match=r"PAGEDVK_TIMEOUT must be a number of seconds in \(0, "):
        config.timeout_ns()


def test_timeout_in_nanoseconds_fits_a_uint64(monkeypatch):
    monkeypatch.setenv("PAGEDVK_TIMEOUT", f"{config.MAX_TIMEOUT_S!r}")
    assert 0 < config.timeout_ns() < 2**64
    monkeypatch.setenv("PAGEDVK_TIMEOUT", " 2.5 ")
    assert config.timeout_ns() == 2_500_000_000


def test_bad_timeout_then_good_call_then_clean_exit():
    # Before the fix the bad value raised `could not convert string to float` after the work was
    # submitted; the untracked work then made the next call (or the exit) segfault.
    result = run_python(program(PROBLEM, """
        import os
        attend()   # the device and its pipeline exist before the bad value
        for bad in ("abc", "-1", "inf", "1e30"):
            os.environ["PAGEDVK_TIMEOUT"] = bad
            try:
                pagedvk.paged_attention(q, k, v, bt, sl)
            except ValueError as e:
                assert "PAGEDVK_TIMEOUT" in str(e), e
            else:
                raise AssertionError("accepted PAGEDVK_TIMEOUT=" + bad)
        os.environ["PAGEDVK_TIMEOUT"] = "30"
        assert right(attend())
        print("ok")
        """))
    assert result.returncode == 0 and "ok" in result.stdout, (result.returncode, result.stdout + result.stderr)


def test_bad_variable_at_startup_is_refused_before_a_device_opens():
    result = run_python("""
        import numpy as np, pagedvk
        try:
            pagedvk.zeros(4)
        except ValueError as e:
            print("refused:", e)
        """, PAGEDVK_VALIDATION="maybe")
    assert result.returncode == 0 and "refused: PAGEDVK_VALIDATION must be one of" in result.stdout, \
        result.stdout + result.stderr


@pytest.mark.parametrize("value, expected", [("WGSL", "wgsl"), (" glsl ", "glsl"), ("", "glsl")])
def test_backend_is_case_insensitive(monkeypatch, value, expected):
    monkeypatch.setenv("PAGEDVK_BACKEND", value)
    assert config.backend() == expected


def test_bad_backend_names_the_variable(monkeypatch):
    monkeypatch.setenv("PAGEDVK_BACKEND", "metal")
    with pytest.raises(ValueError, match="PAGEDVK_BACKEND must be one of glsl, wgsl"):
        config.backend()
    with pytest.raises(ValueError, match="backend must be one of glsl, wgsl"):
        config.backend("cuda")


@pytest.mark.parametrize("value, expected", [("1", True), ("TRUE", True), ("yes", True), ("0", False),
                                             ("False", False), ("no", False), ("", False)])
def test_validation_flag_values(monkeypatch, value, expected):
    monkeypatch.setenv("PAGEDVK_VALIDATION", value)
    assert config.validation() is expected


def test_bad_validation_flag_names_the_variable(monkeypatch):
    monkeypatch.setenv("PAGEDVK_VALIDATION", "on")
    with pytest.raises(ValueError, match="PAGEDVK_VALIDATION must be one of 1, true, yes, 0, false, no"):
        config.validation()


def test_device_variable_blank_is_unset(monkeypatch):
    monkeypatch.setenv("PAGEDVK_DEVICE", "  ")
    assert config.device() is None
    monkeypatch.setenv("PAGEDVK_DEVICE", " 0 ")
    assert config.device() == "0"


@pytest.mark.parametrize("value", ["abc", "-1", "inf", "nan", "2e6"])
def test_bad_spin_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("PAGEDVK_SPIN_US", value)
    with pytest.raises(ValueError, match=r"PAGEDVK_SPIN_US must be a number of microseconds in \[0, "):
        config.spin_ns(cpu_device=False)


@pytest.mark.parametrize("value", ["abc", "0", "-3", "1.5", "1025"])
def test_bad_batch_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("PAGEDVK_BATCH", value)
    with pytest.raises(ValueError, match=r"PAGEDVK_BATCH must be an int in \[1, 1024\] \(command buffers per "):
        config.batch()
    with pytest.raises(ValueError, match="PAGEDVK_BATCH"):
        config.check_all()


def test_batch_default_and_blank(monkeypatch):
    monkeypatch.delenv("PAGEDVK_BATCH", raising=False)
    assert config.batch() == config.DEFAULT_BATCH
    monkeypatch.setenv("PAGEDVK_BATCH", " ")
    assert config.batch() == config.DEFAULT_BATCH
    monkeypatch.setenv("PAGEDVK_BATCH", " 7 ")
    assert config.batch() == 7


def test_spin_defaults_to_polling_on_gpus_only(monkeypatch):
    monkeypatch.delenv("PAGEDVK_SPIN_US", raising=False)
    assert config.spin_ns(cpu_device=True) == 0
    assert config.spin_ns(cpu_device=False) == int(config.DEFAULT_SPIN_US * 1000)
    monkeypatch.setenv("PAGEDVK_SPIN_US", " 250 ")
    assert config.spin_ns(cpu_device=True) == 250_000
