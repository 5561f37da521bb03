"""The time of the I/O event being handled (compiled: only C callers)."""
