"""Getting models in: Hugging Face folders (one loader for every folder), GGUF files, sentence-transformers and
sequence-classification folders, the pinned real model, tokenizers and prompts.
"""
