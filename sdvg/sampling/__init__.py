"""The speculative block sampler (SPEC §1): its settings, the block denoiser and cache regimes, the scheduler,
verification and routing, the prompt timeline and given frames, results, the run meter and the model-call events."""

from ..facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "compat": "DEFAULT_PROFILE PROFILES Compat add_compat_args compat_from_args profile",
    "conditioning_frames": "InitBlocks VideoToVideo check_strength",
    "config": "SamplerConfig",
    "footprint": "run_memory",
    "prompt_schedule": "PromptSchedule check_prompt",
    "regimes": "FIRST_FRAME_SOURCES POSITIONS REGIMES CacheConfig",
    "results": "BlockEvent BlockRecord SDVGResult StepEvent",
    "router": "AGGREGATIONS MODES THRESHOLDS RouterConfig RouterMode parse_pattern runs_model",
    "sampler": "SpeculativeSampler",
    "scheduler": "SCHEDULES STEP_NOISES",
})
