"""sglang-vc: SGLang with lossless compressed-KV decoding and tiered KV management."""

__version__ = "0.1.0"
