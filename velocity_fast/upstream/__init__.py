"""Engine connections: keep-alive pools, the engine answer's parser and relay, cancellation by
closing. ``connection`` (compiled), ``pool`` (compiled), ``errors``."""
