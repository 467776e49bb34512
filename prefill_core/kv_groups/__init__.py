"""Models whose layers fall into KV groups (sliding windows, Gemma 3, hybrids): the attention layout, vLLM's
grouping and KV buffers, the window rule, the group table rules and the grouped plans, padded and packed.
"""
