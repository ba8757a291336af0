"""quantkit: quantize LLMs (RTN, GPTQ, AWQ, FP8, GGUF), evaluate and compare the artifacts."""

__version__ = "0.1.0"
