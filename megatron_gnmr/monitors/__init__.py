"""Mechanism monitors: attention update spectra, MoE router statistics, alarms."""
