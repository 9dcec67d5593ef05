"""policyd: an Envoy ext_proc service that routes LLM inference requests by policy."""

__version__ = "0.1.0"
