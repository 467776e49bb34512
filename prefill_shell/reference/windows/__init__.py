"""Models whose layers fall into KV groups (sliding windows, hybrids): ``HybridLlama``, windowed attention in
padded and packed steps, and the pools the groups share.
"""
