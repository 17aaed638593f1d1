"""Runtime: artifact loading, execution, scheduling, sampling and detokenization."""
