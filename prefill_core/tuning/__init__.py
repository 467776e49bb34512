"""Tuning a length ladder to a workload: prompt-length histograms and the ladder tuner."""
