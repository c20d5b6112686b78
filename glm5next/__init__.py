"""glm5next: low-latency decoding of GLM-5.3-Flash on NVIDIA Hopper."""

__version__ = "0.1.0"


def __getattr__(name):
    # The engine pulls in the whole model; import it only when asked for.
    if name in ("LLM", "SamplingParams"):
        from .runtime import engine

        return getattr(engine, name)
    raise AttributeError(name)
