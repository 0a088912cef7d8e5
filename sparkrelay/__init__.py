"""sparkrelay: DSpark speculative decoding under prefill/decode disaggregation."""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy, so that importing a torch-free module (the scheduler, the block manager) does not load
    # torch.
    if name == "LLM":
        from sparkrelay.llm import LLM

        return LLM
    if name == "SamplingParams":
        from sparkrelay.scheduler.request import SamplingParams

        return SamplingParams
    raise AttributeError(name)
