"""Choosing tokens: `SamplingParams` and keyed sampling (sampler.py), penalties, log-probabilities,
stop rules and a plain step's next token."""
