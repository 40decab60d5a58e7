"""The serving engine: sequences, scheduler policies, model runner, sampler, metrics."""
