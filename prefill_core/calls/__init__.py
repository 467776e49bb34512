"""A whole call and a lane's warm-up: ``plan_call`` (the one choice of a call's plan), ``replays_call`` and
``can_trace``, the warm-up manifest and what a warm-up costs.
"""
