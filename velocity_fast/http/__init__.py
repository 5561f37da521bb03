"""HTTP/1.1 messages: the parsed request (``message``), the one-call scanners (``http1``) and the
error contract (``errors``). No sockets here: the server and the upstream layers use these."""
