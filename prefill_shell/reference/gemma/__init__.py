"""Gemma 3's text decoder: its configuration as transformers reads it, and the model over per-group pools."""
