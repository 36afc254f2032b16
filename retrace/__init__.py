"""retrace: deployment toolchain for ReTrace speculative decoding of Qwen3 models."""

__version__ = "0.1.0"
