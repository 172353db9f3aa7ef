"""What a run measures: profiler traces and live memory."""
