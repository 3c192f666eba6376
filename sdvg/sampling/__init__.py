"""The speculative block sampler (SPEC §1): its settings, the block denoiser and cache regimes, the scheduler,
verification and routing, the prompt timeline and given frames, results, the run meter and the model-call events."""
