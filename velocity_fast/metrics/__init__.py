"""Prometheus metrics: the registry and exposition (``registry``), several processes' texts
merged by each metric's declared rule (``merge``) and the compiled counter and histogram
children the request path increments (``values``)."""
