"""Flow-matching table, warped and diagonal step lists, validation, and pre-sampled block noise."""

from __future__ import annotations

import math

import pytest
import torch

from sdvg.errors import ConfigError
from sdvg.sampling import config as config_module
from sdvg.sampling.config import SamplerConfig
from sdvg.sampling.scheduler import (
    FlowMatchScheduler,
    block_seed,
    build_step_schedule,
    distinct_step_lists,
    renoise,
    sample_block_noise,
    to_x0,
)


@pytest.fixture(scope="module")
def sched() -> FlowMatchScheduler:
    return FlowMatchScheduler()


def test_table(sched):
    ts = sched.timesteps
    assert ts.dtype == torch.float64 and ts.numel() == 1000
    assert ts[0].item() == 1000.0
    assert ts[-1].item() == pytest.approx(4.98, abs=0.01)
    assert bool((ts[1:] < ts[:-1]).all())


def test_sigma_and_snap(sched):
    assert sched.sigma_of(0) == 0.0 and sched.snap(0) == 0.0
    assert sched.sigma_of(1000) == 1.0
    assert sched.sigma_of(937.5) == pytest.approx(0.9375)
    assert sched.snap(937.4) == pytest.approx(937.5)
    assert sched.snap(2000) == 1000.0
    assert sched.snap(0.1) == pytest.approx(sched.timesteps[-1].item())


def test_warp(sched):
    assert sched.warp([1000, 750, 500, 250]) == pytest.approx([1000.0, 937.5, 833.3333333, 625.0])
    assert sched.warp([100]) == pytest.approx([357.142857])
    assert sched.warp([0]) == [0.0]
    with pytest.raises(ConfigError):
        sched.warp([1001])


def test_constant_and_raw(sched):
    sf = [1000.0, 937.5, 833.3333333, 625.0]
    rows = build_step_schedule("constant", 3, sched)
    assert len(rows) == 3 and all(r == pytest.approx(sf) for r in rows)
    assert build_step_schedule(" 1000, 750,500,250 ", 2, sched)[1] == pytest.approx(sf)


def test_diagonal(sched):
    rows = build_step_schedule("diagonal", 5, sched)
    assert [len(r) for r in rows] == [4, 3, 2, 2, 2]
    assert rows[0] == pytest.approx([1000, 933, 733, 357.142857], abs=0.5)
    assert rows[1] == pytest.approx([1000, 933, 357.142857], abs=0.5)
    assert rows[2] == pytest.approx([1000, 357.142857], abs=1e-4)
    table = set(sched.timesteps.tolist())
    assert all(v in table for r in rows for v in r)


def test_diagonal_1_is_the_diagonals_first_list_then_one_step(sched):
    rows = build_step_schedule("diagonal-1", 4, sched)
    assert rows[0] == build_step_schedule("diagonal", 1, sched)[0]
    assert rows[1:] == [[1000.0]] * 3  # one step from noise: the x0 prediction given the cache
    assert build_step_schedule("Diagonal-1", 1, sched) == rows[:1]


def test_json_and_lists(sched):
    rows = build_step_schedule("[[1000, 500], [900]]", 3, sched)
    assert len(rows) == 3 and len(rows[0]) == 2 and rows[1] == rows[2]
    assert rows[1][0] == pytest.approx(900.0, abs=0.2)
    assert build_step_schedule([[1000, 625]], 2, sched) == [[1000.0, 625.0], [1000.0, 625.0]]
    assert build_step_schedule([1000, 625], 1, sched) == [[1000.0, 625.0]]


@pytest.mark.parametrize(
    "spec",
    ["", "nope", "1000,nan", "1000,inf", "500,750", "1000,1000", "0", "1000,0,500", "1200,500", "[[1000, -1]]", "[[]]", [],
     [[1000, float("nan")]], "[[1000, 999.9]]", "[1000,"],
)
def test_validation(sched, spec):
    with pytest.raises(ConfigError):
        build_step_schedule(spec, 2, sched)


def test_num_blocks_validated(sched):
    with pytest.raises(ConfigError):
        build_step_schedule("constant", 0, sched)


def test_the_checks_read_each_distinct_list_once_whatever_the_block_count(sched, monkeypatch):
    """validate() checks the schedule from its distinct lists: a 10-million-block run is refused for its size at
    once, not after building ten million lists; expanded, they are build_step_schedule's rows."""
    for spec in ("diagonal", "constant", "[[1000, 500], [900]]"):
        lists = distinct_step_lists(spec, 10_000_000, sched)
        assert len(lists) <= 3
        rows = build_step_schedule(spec, 6, sched)
        assert rows == [lists[min(b, len(lists) - 1)] for b in range(6)]
    with pytest.raises(ConfigError, match="per-block lists"):
        distinct_step_lists([[1000], [900], [800]], 2, sched)
    def expand(*_a):
        raise AssertionError("validate() expanded the per-block schedule")

    monkeypatch.setattr(config_module, "build_step_schedule", expand)  # ~20 s at 10 million blocks, before
    SamplerConfig(num_blocks=10_000_000, width=64, height=64, keep_output=False).validate()


def test_noise_determinism_and_independence():
    shape = (1, 16, 3, 8, 8)
    a = sample_block_noise(7, 2, shape, 4, device="cpu", dtype=torch.float32)
    b = sample_block_noise(7, 2, shape, 4, device="cpu", dtype=torch.float32)
    assert len(a.renoise) == 3
    assert torch.equal(a.initial, b.initial) and all(torch.equal(x, y) for x, y in zip(a.renoise, b.renoise, strict=True))
    # a block's noise does not depend on how much noise other blocks drew
    torch.manual_seed(0)
    sample_block_noise(7, 1, shape, 9)
    c = sample_block_noise(7, 2, shape, 2)
    assert torch.equal(c.initial, a.initial) and torch.equal(c.renoise[0], a.renoise[0])
    other = sample_block_noise(7, 3, shape, 4)
    assert not torch.equal(other.initial, a.initial)
    assert not torch.equal(sample_block_noise(8, 2, shape, 1).initial, a.initial)
    assert all(not torch.equal(a.initial, r) for r in a.renoise)
    assert 0 <= block_seed(7, 2) < 2**63 and block_seed(7, 2) != block_seed(2, 7)
    half = sample_block_noise(7, 2, shape, 4, dtype=torch.bfloat16)
    assert half.initial.dtype == torch.bfloat16 and torch.equal(half.initial, a.initial.bfloat16())
    with pytest.raises(ConfigError):
        sample_block_noise(7, 2, shape, 0)


def test_x0_and_renoise():
    x = torch.randn(2, 3, dtype=torch.bfloat16)
    v = torch.randn(2, 3, dtype=torch.bfloat16)
    x0 = to_x0(x, v, 0.5)
    assert x0.dtype == torch.bfloat16
    assert torch.equal(x0, (x.float() - 0.5 * v.float()).bfloat16())
    eps = torch.randn(2, 3)
    y = renoise(x0.float(), eps, 0.25)
    assert torch.allclose(y, 0.75 * x0.float() + 0.25 * eps)
    assert math.isclose(float(renoise(torch.ones(1), torch.zeros(1), 0.0)), 1.0)


def test_predicted_step_noise_is_an_euler_step_of_the_flow_ode():
    """Re-noising the x0 prediction with the predicted noise is exactly x_t + (σ' − σ)·v (step_noise='predicted')."""
    from sdvg.sampling.scheduler import renoise, to_eps, to_x0

    gen = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 16, 3, 4, 4, generator=gen), torch.randn(2, 16, 3, 4, 4, generator=gen)
    s, s_next = 0.8, 0.55
    stepped = renoise(to_x0(x, v, s), to_eps(x, v, s), s_next)
    assert torch.allclose(stepped, x + (s_next - s) * v, atol=1e-6)
