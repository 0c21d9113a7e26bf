"""The run around the loop: the run directory's owner, signals, the reaper, the run log and the reports."""
