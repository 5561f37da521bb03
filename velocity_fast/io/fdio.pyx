"""The gateway's socket I/O on an epoll of its own, watched by the event loop as one reader.

uvloop reaches a Protocol through libuv: each read is two callbacks into Python (a
buffer to fill, then the bytes), and each callback takes the GIL again, which uvloop
released to poll. Measured under load that is four GIL round trips a request, about
1,700 instructions, before the bytes; and each ``transport.write`` is a Python call into
uvloop's stream machinery. Here the client and engine sockets are registered with one
epoll instance per loop; the loop watches that instance's descriptor like any other
reader, and when it is ready ``Poller`` takes every ready socket in one pass, under the
GIL it already holds: ``recv`` into one buffer, the Protocol's ``data_received``; a
write is a ``send`` from C, the rest buffered until the socket takes it.

``FdTransport`` is an asyncio Transport (the methods the server and the engine pool
use, with asyncio's semantics: write buffer limits and ``pause_writing``, pause and
resume reading, ``write_eof``, ``close`` after what waits was written, ``abort``,
``connection_lost`` from the loop's ready queue, errors in Protocol callbacks to the
loop's exception handler). ``Server`` accepts on listening sockets; ``open_connection``
connects. Timers, tasks and every other descriptor stay the loop's.

Linux only (epoll); ``VELOCITY_IO=asyncio`` in the environment keeps the loop's own
transports (``enabled()``).
"""

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.errno cimport EAGAIN, EINTR, errno
from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport strerror
from posix.unistd cimport close
from velocity_fast.lowlevel.clock cimport event_begin, event_end

import errno as _errno
import logging
import os
import socket
import weakref

log = logging.getLogger("velocity.server")


cdef extern from "<sys/epoll.h>" nogil:
    ctypedef union epoll_data_t:
        void* ptr
        int fd
        uint32_t u32
        uint64_t u64

    struct epoll_event:
        uint32_t events
        epoll_data_t data

    int epoll_create1(int flags)
    int epoll_ctl(int epfd, int op, int fd, epoll_event* event)
    int epoll_wait(int epfd, epoll_event* events, int maxevents, int timeout)

    enum:
        EPOLL_CLOEXEC
        EPOLL_CTL_ADD
        EPOLL_CTL_MOD
        EPOLL_CTL_DEL
        EPOLLIN
        EPOLLOUT
        EPOLLERR
        EPOLLHUP


cdef extern from "<sys/socket.h>" nogil:
    int shutdown(int fd, int how)
    enum:
        MSG_NOSIGNAL
        SHUT_WR


cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void* iov_base
        size_t iov_len


# recv, send and writev as plain system calls: no cancellation-point wrapper (sockcalls.h).
cdef extern from "sockcalls.h" nogil:
    ssize_t recv "sock_recv"(int fd, void* buf, size_t n, int flags)
    ssize_t send "sock_send"(int fd, const void* buf, size_t n, int flags)
    ssize_t writev "sock_writev"(int fd, const iovec* iov, int iovcnt)


cdef enum:
    READ_SIZE = 262144    # one recv: what a socket holds is taken in one pass, as uvloop's 256 KiB
    MAX_EVENTS = 256      # sockets taken per pass; the rest are ready again at the next
    MAX_IOV = 64          # pieces per writev
    HIGH_DEFAULT = 65536  # asyncio's write buffer limits


def enabled():
    """True where this I/O is used: Linux (epoll), unless VELOCITY_IO=asyncio."""
    return _has_epoll and os.environ.get("VELOCITY_IO", "epoll") != "asyncio"


try:
    import select as _select
    _has_epoll = hasattr(_select, "epoll")
except ImportError:  # pragma: no cover
    _has_epoll = False


cdef inline bint _again(int err) noexcept nogil:
    return err == EAGAIN or err == EINTR  # EWOULDBLOCK is EAGAIN on Linux


cdef object _os_error(int err):
    return OSError(err, strerror(err).decode("utf-8", "replace"))


cdef class Protocol:
    """A Protocol whose ``data_received`` the poller calls as C: ``received`` (the
    server's and the engine pool's connections override it; data_received calls it)."""

    cdef received(self, bytes data):
        self.data_received(data)

    cdef received_buf(self, const char* buf, Py_ssize_t n):
        """n bytes read into the poller's buffer (``buf``): ``received`` with them as
        bytes, unless the protocol takes what it needs from the buffer itself. The
        buffer is the next read's: nothing may keep a pointer into it."""
        self.received(PyBytes_FromStringAndSize(buf, n))

    cdef char* recv_target(self, Py_ssize_t* room) noexcept:
        """Where the next read should land, and how much room it has, when the protocol
        already owns the buffer the bytes are for (a request body that spans reads);
        NULL: the next read goes to ``received`` as bytes, at most ``room`` of them when
        the protocol sets it (0: READ_SIZE)."""
        return NULL

    cdef int received_into(self, Py_ssize_t n) except -1:
        """n bytes were read into what ``recv_target`` gave."""
        return 0


cdef class Poller:
    """One epoll instance for a loop, its descriptor a reader of the loop."""

    def __cinit__(self):
        self._epfd = -1
        self._buf = NULL
        self._events = NULL

    def __init__(self, loop):
        self._loop = loop
        # Registered transports: epoll holds only their address. One closed in a pass
        # (whose events may still be in the batch) stays alive through its scheduled
        # connection_lost until the pass is over.
        self._live = set()
        self._buf = <char*>malloc(READ_SIZE)
        self._events = malloc(MAX_EVENTS * sizeof(epoll_event))
        if self._buf == NULL or self._events == NULL:
            raise MemoryError()
        self._epfd = epoll_create1(EPOLL_CLOEXEC)
        if self._epfd < 0:
            raise _os_error(errno)
        loop.add_reader(self._epfd, self._ready)

    def __dealloc__(self):
        if self._epfd >= 0:
            close(self._epfd)
        free(self._buf)
        free(self._events)

    @property
    def transports(self):
        """How many transports are open on this poller."""
        return len(self._live)

    def _ready(self):
        cdef epoll_event* events = <epoll_event*>self._events
        cdef int n, i
        cdef uint32_t ev
        cdef FdTransport t
        n = epoll_wait(self._epfd, events, MAX_EVENTS, 0)
        if n < 0:
            if _again(errno):
                return
            raise _os_error(errno)
        for i in range(n):
            t = <FdTransport>events[i].data.ptr
            ev = events[i].events
            if t._fd < 0:
                continue  # closed earlier in this pass
            if t._mask & EPOLLOUT and ev & (EPOLLOUT | EPOLLERR | EPOLLHUP):
                t._writable()
                if t._fd < 0:
                    continue
            if t._mask & EPOLLIN and ev & (EPOLLIN | EPOLLERR | EPOLLHUP):
                t._readable()


cdef class FdTransport:
    """An asyncio Transport for one connected, non-blocking socket (see the module doc)."""

    def __cinit__(self):
        self._fd = -1

    def __repr__(self):
        state = "closed" if self._lost else ("closing" if self.closing else "open")
        return f"<FdTransport fd={self._fd} {state}>"

    # -- registration ---------------------------------------------------------
    cdef int _update(self) except -1:
        """Register the events this transport waits for now: reading unless paused or
        closing, writing while bytes wait. No events: not registered at all (epoll
        would still report a hang-up, again and again)."""
        cdef uint32_t want = 0
        cdef epoll_event e
        cdef int op
        if self._fd < 0:
            return 0
        if self._reading:
            want |= EPOLLIN
        if self.wsize > 0:
            want |= EPOLLOUT
        if want == self._mask:
            return 0
        if self._mask == 0:
            op = EPOLL_CTL_ADD
        elif want == 0:
            op = EPOLL_CTL_DEL
        else:
            op = EPOLL_CTL_MOD
        e.events = want
        e.data.ptr = <void*>self
        if epoll_ctl(self._poller._epfd, op, self._fd, &e) < 0:
            raise _os_error(errno)
        self._mask = want
        return 0

    # -- input -------------------------------------------------------------------
    cdef int _readable(self) except -1:
        cdef ssize_t n
        cdef int err
        cdef char* target = NULL
        cdef Py_ssize_t room = 0
        cdef double prev
        if not self._reading:
            return 0
        if self._fast is not None:
            target = self._fast.recv_target(&room)
        if target != NULL:
            # Straight into the protocol's buffer (a request body): no bytes object, no
            # copy; at most what it still lacks, so the next request stays in the socket.
            n = recv(self._fd, target, <size_t>room, 0)
        else:
            n = recv(self._fd, self._poller._buf, <size_t>room if 0 < room < READ_SIZE else READ_SIZE, 0)
        if n > 0:
            prev = event_begin()
            try:
                if target != NULL:
                    self._fast.received_into(n)
                elif self._fast is not None:
                    self._fast.received_buf(self._poller._buf, n)
                else:
                    self._protocol.data_received(PyBytes_FromStringAndSize(self._poller._buf, n))
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                self._fatal(exc, "Fatal error: protocol.data_received() call failed.")
            finally:
                event_end(prev)
            return 0
        if n == 0:
            self._reading = False
            self._update()
            try:
                keep_open = self._protocol.eof_received()
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                self._fatal(exc, "Fatal error: protocol.eof_received() call failed.")
                return 0
            if not keep_open:
                self.close()
            return 0
        err = errno
        if not _again(err):
            self._fatal(_os_error(err), "Fatal read error on socket transport")
        return 0

    def pause_reading(self):
        if self.closing or not self._reading:
            return
        self._reading = False
        self._update()

    def resume_reading(self):
        if self.closing or self._reading:
            return
        self._reading = True
        self._update()

    def is_reading(self):
        return self._reading and not self.closing

    # -- output -------------------------------------------------------------------
    cdef int write_bytes(self, bytes data) except -1:
        """write() for bytes, as a C call: sent now if the socket takes it, else kept."""
        cdef Py_ssize_t n = PyBytes_GET_SIZE(data)
        cdef ssize_t k
        cdef int err
        if n == 0 or self._lost:
            return 0
        if self._eof_pending or self._eof_sent:
            raise RuntimeError("Cannot call write() after write_eof()")
        if self.wsize == 0:
            k = send(self._fd, PyBytes_AS_STRING(data), n, MSG_NOSIGNAL)
            if k == n:
                return 0
            if k < 0:
                err = errno
                if not _again(err):
                    self._fatal(_os_error(err), "Fatal write error on socket transport")
                    return 0
                k = 0
            self._wbuf.append(data)
            self._woff = k
            self.wsize = n - k
            self._update()
        else:
            self._wbuf.append(data)
            self.wsize += n
        self._maybe_pause()
        return 0

    cdef int write_list(self, list pieces) except -1:
        """writelines() for a list of bytes: one writev for what the socket takes."""
        cdef Py_ssize_t total = 0
        cdef bint was_empty
        if self._lost:
            return 0
        if self._eof_pending or self._eof_sent:
            raise RuntimeError("Cannot call write() after write_eof()")
        was_empty = self.wsize == 0
        for piece in pieces:
            if not isinstance(piece, bytes):
                piece = bytes(piece)
            if PyBytes_GET_SIZE(piece):
                self._wbuf.append(piece)
                total += PyBytes_GET_SIZE(piece)
        if total == 0:
            return 0
        self.wsize += total
        if was_empty:
            self._woff = 0
            self._sent()
            if self._lost:
                return 0
            self._update()
        self._maybe_pause()
        return 0

    cdef int _sent(self) except -1:
        """writev what waits, as much as the socket takes; drop what it took."""
        cdef iovec iov[MAX_IOV]
        cdef int cnt = 0, err
        cdef ssize_t k
        cdef Py_ssize_t off = self._woff, size, done = 0
        cdef list buf = self._wbuf
        for piece in buf:
            if cnt == MAX_IOV:
                break
            iov[cnt].iov_base = PyBytes_AS_STRING(piece) + off
            iov[cnt].iov_len = PyBytes_GET_SIZE(piece) - off
            off = 0
            cnt += 1
        k = writev(self._fd, iov, cnt)
        if k < 0:
            err = errno
            if not _again(err):
                self._fatal(_os_error(err), "Fatal write error on socket transport")
            return 0
        self.wsize -= k
        k += self._woff
        while done < len(buf):
            size = PyBytes_GET_SIZE(buf[done])
            if k < size:
                break
            k -= size
            done += 1
        if done:
            del buf[:done]
        self._woff = k
        return 0

    cdef int _writable(self) except -1:
        self._sent()
        if self._lost:
            return 0
        if self._protocol_paused and self.wsize <= self._low:
            self._flow(False)
        if self.wsize == 0:
            self._update()
            if self._eof_pending:
                self._eof_pending = False
                self._eof_sent = True
                shutdown(self._fd, SHUT_WR)
            if self.closing:
                self._force_close(None)
        return 0

    cdef _maybe_pause(self):
        if not self._protocol_paused and self.wsize > self._high:
            self._flow(True)

    cdef _flow(self, bint pause):
        """The protocol's pause_writing (``pause``) or resume_writing; what it raises
        goes to the loop's exception handler, as asyncio's transports do."""
        self._protocol_paused = pause
        try:
            if pause:
                self._protocol.pause_writing()
            else:
                self._protocol.resume_writing()
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._loop.call_exception_handler({
                "message": f"protocol.{'pause' if pause else 'resume'}_writing() failed",
                "exception": exc, "transport": self, "protocol": self._protocol})

    def write(self, data):
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data argument must be a bytes-like object, not {type(data).__name__!r}")
        self.write_bytes(data if type(data) is bytes else bytes(data))

    def writelines(self, list_of_data):
        self.write_list(list(list_of_data))

    def write_eof(self):
        if self.closing or self._eof_pending or self._eof_sent:
            return
        if self.wsize:
            self._eof_pending = True
        else:
            self._eof_sent = True
            shutdown(self._fd, SHUT_WR)

    def can_write_eof(self):
        return True

    def get_write_buffer_size(self):
        return self.wsize

    def get_write_buffer_limits(self):
        return (self._low, self._high)

    def set_write_buffer_limits(self, high=None, low=None):
        if high is None:
            high = HIGH_DEFAULT if low is None else 4 * low
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high = high
        self._low = low
        self._maybe_pause()

    # -- closing -----------------------------------------------------------------
    def is_closing(self):
        return self.closing

    def close(self):
        """Close once what waits has been written; connection_lost(None) follows."""
        if self.closing:
            return
        self.closing = True
        self._reading = False
        if self.wsize == 0:
            self._force_close(None)
        else:
            self._update()

    def abort(self):
        """Close now, dropping what waits."""
        self._force_close(None)

    cdef _fatal(self, exc, str message):
        if not isinstance(exc, OSError):
            self._loop.call_exception_handler({
                "message": message, "exception": exc, "transport": self, "protocol": self._protocol})
        elif self._loop.get_debug():
            log.debug("%r: %s", self, message, exc_info=True)
        self._force_close(exc)

    cdef _force_close(self, exc):
        if self._lost:
            return
        self._lost = True
        self.closing = True
        self._reading = False
        self._wbuf = []
        self.wsize = 0
        self._update()
        self._fd = -1  # events of this pass for it are skipped; the socket closes after connection_lost
        self._poller._live.discard(self)
        # The handle keeps this transport alive past the pass that may still hold its address.
        self._loop.call_soon(self._call_connection_lost, exc)

    def _call_connection_lost(self, exc):
        try:
            if self._protocol is not None:
                self._protocol.connection_lost(exc)
        finally:
            self._sock.close()
            self._protocol = None
            self._fast = None

    # -- the rest of asyncio's Transport ---------------------------------------
    def get_extra_info(self, name, default=None):
        if name == "peername":
            if self._peername is None:
                try:
                    self._peername = self._sock.getpeername()
                except OSError:
                    return default
            return self._peername
        if name == "sockname":
            try:
                return self._sock.getsockname()
            except OSError:
                return default
        if name == "socket":
            return self._sock
        return default

    def get_protocol(self):
        return self._protocol

    def set_protocol(self, protocol):
        self._protocol = protocol
        self._fast = protocol if isinstance(protocol, Protocol) else None


cpdef FdTransport attach(Poller poller, sock, protocol, peername=None):
    """A transport for ``sock`` (connected; made non-blocking here) with ``protocol``:
    registered for reading, then ``protocol.connection_made`` called."""
    cdef FdTransport t = FdTransport.__new__(FdTransport)
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t._sock = sock
    t._fd = sock.fileno()
    t._poller = poller
    t._loop = poller._loop
    t._protocol = protocol
    t._fast = protocol if isinstance(protocol, Protocol) else None
    t._peername = peername
    t._wbuf = []
    t._high = HIGH_DEFAULT
    t._low = HIGH_DEFAULT // 4
    t._reading = True
    poller._live.add(t)
    t._update()
    try:
        protocol.connection_made(t)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        t._fatal(exc, "Fatal error: protocol.connection_made() call failed.")
    return t


# By the loop's id, weakly: the loop holds its poller (a reader), the poller its loop; a
# strong map would keep every loop the process ever ran, and its epoll descriptor.
_pollers = weakref.WeakValueDictionary()


cpdef Poller poller_for(loop):
    """The loop's poller (one per loop, shared by every server and engine connection on it)."""
    p = _pollers.get(id(loop))
    if p is None or (<Poller>p)._loop is not loop:
        p = Poller(loop)
        _pollers[id(loop)] = p
    return p


async def open_connection(loop, protocol_factory, host, port):
    """asyncio's create_connection on this I/O: (transport, protocol) once connected."""
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    if not infos:
        raise OSError(f"getaddrinfo({host!r}) returned empty list")
    error = None
    for family, type_, proto, _, address in infos:
        sock = socket.socket(family, type_, proto)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        except BaseException:
            sock.close()
            raise
        protocol = protocol_factory()
        return attach(poller_for(loop), sock, protocol), protocol
    raise error


_ACCEPT_ERRORS = (_errno.EMFILE, _errno.ENFILE, _errno.ENOBUFS, _errno.ENOMEM)


class Server:
    """asyncio's Server for listening sockets on this I/O: ``sockets``, ``close()``,
    ``wait_closed()``. Accepting is the loop's (a reader per listening socket); the
    connections are the poller's."""

    def __init__(self, loop, protocol_factory, sockets, backlog):
        self._loop = loop
        self._factory = protocol_factory
        self._poller = poller_for(loop)
        self._sockets = list(sockets)
        self._backlog = backlog
        for sock in self._sockets:
            sock.setblocking(False)
            sock.listen(backlog)
            loop.add_reader(sock.fileno(), self._accept, sock)

    @property
    def sockets(self):
        return tuple(self._sockets)

    def is_serving(self):
        return bool(self._sockets)

    def _accept(self, sock):
        for _ in range(self._backlog):
            try:
                conn, addr = sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                if exc.errno not in _ACCEPT_ERRORS:
                    raise
                # Out of descriptors or memory: stop accepting for a while, as asyncio does.
                self._loop.call_exception_handler({
                    "message": "socket.accept() out of system resource",
                    "exception": exc, "socket": sock})
                self._loop.remove_reader(sock.fileno())
                self._loop.call_later(1.0, self._resume, sock)
                return
            attach(self._poller, conn, self._factory(), addr)

    def _resume(self, sock):
        if sock in self._sockets:
            self._loop.add_reader(sock.fileno(), self._accept, sock)

    def close(self):
        """Stop listening; open connections are their protocols' to close."""
        sockets, self._sockets = self._sockets, []
        for sock in sockets:
            self._loop.remove_reader(sock.fileno())
            sock.close()

    async def wait_closed(self):
        return


def listen(host, port, *, backlog=2048, reuse_port=False):
    """Listening sockets for host:port as asyncio's create_server binds them: every
    address the host resolves to (all interfaces for "" or None), SO_REUSEADDR,
    IPV6_V6ONLY on IPv6, SO_REUSEPORT if asked."""
    if host == "":
        host = None
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets = []
    seen = set()
    try:
        for family, type_, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, type_, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                raise OSError(exc.errno, f"error while attempting to bind on address {address!r}: "
                              f"{exc.strerror.lower()}") from None
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets
