"""Paged KV pools in tt-metal's layout."""
