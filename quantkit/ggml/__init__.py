"""GGML types: every codec quantkit encodes and decodes, and the one catalogue of their facts.

  catalogue  each type's row (codec module, block size and bytes from gguf-py, bits per weight,
             imatrix need, row-width fallback) and each --gguf-type's mix (llama ftype id, bits
             per weight, per-tensor rules): what methods, formats, engines and plan read
  mix        plan_types: the type of every tensor of a file (llama_tensor_get_type)
  codec      encode / decode a tensor of any type: finds the type's codec through its row
  legacy, k_quants, iq4, iq3, iq2, iq1, floats
             one module per type family: its torch and numba encoders and torch decoders,
             listed in CODECS
  common, compiled, grid, jit
             shared torch math, shared numba kernels, the IQ lattice tables, numba setup

A new GGML type is its codec module (or a codec in an existing family) and a catalogue row.
This package imports nothing from quantkit's methods, formats or pipeline: they read it.
"""
