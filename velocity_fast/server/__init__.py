"""The HTTP/1.1 server shared by the sim engine and the gateway (docs/design.md, "Layers").

It knows nothing of engines, bands or routing: a handler gets a Request and a
Responder and answers. ``connection``: the client connection and its Responder
(compiled); ``http_server``: the listening server; ``limits``, ``errors``, ``run``;
``reserve``: a port held for the processes that listen on it.
"""
