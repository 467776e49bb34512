"""Planning a call without KV groups: requests and chunks, program and trace identities, table widths, the
writer-before-reader order, padded waves (``plan``), packed steps (``packed``) and ``prepare_prefill``.
"""
