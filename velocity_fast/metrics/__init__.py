"""Prometheus metrics: the registry and exposition (``registry``) and the compiled counter and
histogram children the request path increments (``values``)."""
