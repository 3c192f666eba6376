"""Device strings and CPU thread counts from the user: only devices SDVG runs on, only thread counts the machine
can take; every refusal names the valid choices."""

from __future__ import annotations

import pytest
import torch

from sdvg import devices
from sdvg.devices import parse_dtype, resolve_device, set_cpu_threads
from sdvg.errors import ConfigError

CHOICES = "Use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'."


@pytest.mark.parametrize("spec, expected", [
    ("meta", "The device 'meta' for the DiT is PyTorch's 'meta' device, which holds shapes but no values"),
    (" META ", "is PyTorch's 'meta' device"),
    (torch.device("meta"), "The device 'meta' for the DiT is PyTorch's 'meta' device"),
    ("xla", "The device 'xla' for the DiT is of type 'xla', which SDVG does not run on"),
    ("hpu:0", "The device 'hpu:0' for the DiT is of type 'hpu', which SDVG does not run on"),
    (torch.device("xpu"), "is of type 'xpu', which SDVG does not run on"),
    ("tpu:0", "Unknown device 'tpu:0' for the DiT"),
    ("foo", "Unknown device 'foo' for the DiT"),
    ("cuda:x", "Unknown device 'cuda:x' for the DiT"),
])  # fmt: skip
def test_devices_sdvg_does_not_run_on_are_refused_naming_the_choices(spec, expected):
    with pytest.raises(ConfigError) as err:
        resolve_device(spec, what="DiT")
    assert expected in str(err.value) and CHOICES in str(err.value), str(err.value)


def test_cpu_and_auto_resolve():
    assert resolve_device("cpu") == torch.device("cpu") == resolve_device(" CPU ")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    assert resolve_device(None).type in devices.DEVICE_TYPES and resolve_device("auto").type in devices.DEVICE_TYPES


@pytest.fixture()
def two_cores(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(devices.os, "cpu_count", lambda: 2)
    yield
    torch.set_num_threads(before)


def test_threads_up_to_four_per_core_are_accepted(two_cores):
    assert devices.max_cpu_threads() == 8
    for n in (1, 3, 8):
        assert set_cpu_threads(n) == n == torch.get_num_threads()


@pytest.mark.parametrize("n", [9, 64, 100000])
def test_more_threads_than_the_machine_can_take_are_refused(two_cores, n):
    before = torch.get_num_threads()
    with pytest.raises(ConfigError) as err:
        set_cpu_threads(n)
    msg = str(err.value)
    assert f"--threads {n} is more than this machine can use: it has 2 CPU core(s)" in msg, msg
    assert "at most 8 threads (4 per core)" in msg and "Use a number from 1 to 8" in msg, msg
    assert torch.get_num_threads() == before


def test_unknown_core_count_counts_as_one(monkeypatch):
    monkeypatch.setattr(devices.os, "cpu_count", lambda: None)
    assert devices.max_cpu_threads() == 4
    with pytest.raises(ConfigError, match="it has 1 CPU core"):
        set_cpu_threads(5)


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "4"])
def test_threads_that_are_not_a_whole_number_from_one_are_refused(bad):
    with pytest.raises(ConfigError, match=r"--threads must be a whole number ≥ 1, got "):
        set_cpu_threads(bad)


@pytest.mark.parametrize("spec", [0, 1, 1.5, ["cuda:0"]])
def test_a_device_that_is_not_a_string_is_named(spec):
    with pytest.raises(ConfigError, match="must be a string such as 'cuda:0'"):
        resolve_device(spec, what="DiTs")


@pytest.mark.parametrize("name", [16, 0.5, torch.float32.itemsize])
def test_a_dtype_that_is_not_a_name_is_named(name):
    with pytest.raises(ConfigError, match="must be a name such as 'bf16'"):
        parse_dtype(name, default=torch.float32)
