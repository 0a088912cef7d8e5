"""PD disaggregation: the prefill and decode roles the engine composes in, and the handoff between
them."""
