"""The caller's batch and every rule it must keep: ``PrefillBatch``, the rule table (``rules``), how each
rule finds the first row that breaks it (``rule_finds``), the checks of a planning call (``validate``) and the
option values the front ends share (``options``).
"""
