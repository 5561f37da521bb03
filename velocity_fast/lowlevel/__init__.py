"""cimport-only helpers of the compiled modules: the monotonic clock, numbers and text to
bytes, msgspec slot reads. Nothing here imports anything of the package."""
