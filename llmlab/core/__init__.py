"""What every stage shares: typed configs, one-line user errors, atomic file writes, run records, devices."""
