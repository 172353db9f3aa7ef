"""Pipelines: schedules and their replay, stage profiles, the stage-slicing DP."""
