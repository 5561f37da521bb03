/*
 * The socket calls of the gateway's own poller (velocity_fast/io/fdio.pyx), made as plain
 * system calls.
 *
 * glibc's recv, send and writev are thread cancellation points: in a process with more
 * than one thread each call switches asynchronous cancellation on and back off around
 * the system call (__pthread_enable_asynccancel / __pthread_disable_asynccancel), about
 * 1 % of the gateway's CPU per small request under load in `perf`. The gateway never
 * cancels a thread, so these go straight to the kernel through syscall(2): the same
 * arguments, the same return value and errno.
 */
#ifndef SOCKCALLS_H
#define SOCKCALLS_H

#include <stddef.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

static inline ssize_t sock_recv(int fd, void *buf, size_t n, int flags) {
    return (ssize_t)syscall(SYS_recvfrom, fd, buf, n, flags, NULL, NULL);
}

static inline ssize_t sock_send(int fd, const void *buf, size_t n, int flags) {
    return (ssize_t)syscall(SYS_sendto, fd, buf, n, flags, NULL, 0);
}

static inline ssize_t sock_writev(int fd, const struct iovec *iov, int iovcnt) {
    return (ssize_t)syscall(SYS_writev, fd, iov, iovcnt);
}

#endif
