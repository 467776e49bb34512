"""Llama-shaped decoders (Llama, Mistral, Qwen2/3, SmolLM2): the architecture read from ``config.json``, RoPE
scalings, projections, the paged-KV model and its packed-step attention.
"""
