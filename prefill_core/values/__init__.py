"""The core's foundation values: errors, exact integer helpers, the layout, the policy, sampling parameters,
table views, dtypes, lanes, execution modes and the one serialisation converter. Imports nothing above it.
"""
