"""Cache-regime policies: layouts, length limits, and the cost rules the estimate and the bench rely on, checked
against what real runs do."""

from __future__ import annotations

import pytest

from sdvg.errors import ConfigError
from sdvg.sampling.regimes import CacheConfig, CacheLayout, CacheRegime, GlobalCache, NoisyCache, RecomputeCache
from sdvg.sampling.router import RouterConfig
from sdvg.sampling.sampler import SamplerConfig, SpeculativeSampler

PROMPT = "a red fox running through snow"


def test_each_regime_has_its_policy_and_layout():
    assert isinstance(CacheConfig("global").policy(), GlobalCache)
    assert isinstance(CacheConfig("recompute").policy(), RecomputeCache)
    assert isinstance(CacheConfig("noisy").policy(), NoisyCache)
    assert CacheConfig("global").policy().layout(21) == CacheLayout(21)
    assert CacheConfig("recompute").policy().layout(21) == CacheLayout(6)  # 3 context + 3 block frames
    noisy = CacheConfig("noisy", window_frames=9, sink_frames=3).policy()
    assert noisy.layout(9) == CacheLayout(9) and noisy.layout(21) == CacheLayout(9, rolling=True, sink_frames=3)


def test_only_absolute_positions_run_out_of_rope_positions():
    with pytest.raises(ConfigError, match="recompute or noisy"):
        CacheConfig("global").policy().check_length(1026, 1024)
    with pytest.raises(ConfigError, match="window-relative positions"):
        CacheConfig("noisy").policy().check_length(1026, 1024)  # absolute positions (the default)
    CacheConfig("recompute").policy().check_length(10_000, 1024)
    CacheConfig("noisy", positions="window").policy().check_length(10_000, 1024)
    with pytest.raises(ConfigError, match="smaller window"):
        CacheConfig("noisy", window_frames=30, positions="window").policy().check_length(10_000, 24)


def test_a_dit_config_bounds_the_size_and_the_length_in_one_check():
    """One rule for the sampler and the CLI's header check: tokens per axis and frame positions vs RoPE."""
    dit = {"patch_size": (1, 2, 2), "rope_max_seq_len": 4}
    SamplerConfig(width=64, height=32, num_blocks=1).check_dit_fits(dit)  # 8×4 latent → 4×2 tokens, 3 frames
    with pytest.raises(ConfigError, match="RoPE range"):
        SamplerConfig(width=80, height=32, num_blocks=1).check_dit_fits(dit)  # 5 tokens across
    with pytest.raises(ConfigError, match="RoPE"):
        SamplerConfig(width=64, height=32, num_blocks=2, cache=CacheConfig("global")).check_dit_fits(dit)  # 6 frames
    SamplerConfig(width=64, height=32, num_blocks=2).check_dit_fits({"patch_size": (1, 2, 2)})  # Wan's 1024


def test_first_frame_option_belongs_to_the_recompute_regime():
    assert CacheConfig("recompute").policy().reencodes_first_frame
    assert not CacheConfig("recompute", first_frame="latent").policy().reencodes_first_frame
    assert not CacheConfig("noisy").policy().reencodes_first_frame
    assert [CacheConfig("recompute").policy().context_encodes(b) for b in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ConfigError, match="first_frame"):
        CacheConfig("recompute", first_frame="pixel")
    with pytest.raises(ConfigError, match="whole number"):
        CacheConfig("noisy", window_frames=12.5)


@pytest.mark.parametrize("regime", [r.value for r in CacheRegime])
def test_target_only_cost_rule_matches_the_forwards_a_run_makes(tiny_models, regime):
    """The policy's per-block cache forwards (the time estimate's and the bench's rule) are what the run spends."""
    config = SamplerConfig(num_blocks=4, width=64, height=64, cache=CacheConfig(regime), schedule="diagonal")
    result = SpeculativeSampler(tiny_models, RouterConfig(mode="target-only"), config).run(PROMPT)
    policy = config.cache.policy()
    for record in result.blocks:
        assert record.forwards["target"] == record.steps + policy.target_only_cache_forwards(record.block)
