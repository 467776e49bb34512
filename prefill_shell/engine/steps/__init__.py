"""The runtime's private step collaborators, one concept a module.

``inputs``/``packed_inputs`` stage host values and refresh device inputs,
``prepared_batch`` holds a prepared call, ``step_loop`` runs a request's
steps eagerly, ``trace`` captures and replays sampling-free bodies,
``postprocess`` turns the final hidden rows into logits or samples,
``prompt_logprobs`` scores prompt positions step by step, ``assembler``
reads results back in the caller's row order and releases them, and
``partial_writes`` reports which KV blocks an interrupted call wrote.
Only ``prefill_shell.engine`` imports these.
"""
