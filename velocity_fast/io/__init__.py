"""Socket I/O on the gateway's own epoll (``fdio``): transports with asyncio's semantics."""
