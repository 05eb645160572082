"""pdserve: prefill/decode disaggregated LLM serving with push-based KV-cache transfer."""

__version__ = "0.1.0"
