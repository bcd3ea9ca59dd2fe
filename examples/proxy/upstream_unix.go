//go:build unix

package main

import (
	"net"
	"syscall"
)

// peerClosed reports whether the peer of an idle connection closed it, or sent something
// unasked (a 408, say): either way it cannot carry a request. It costs one non-blocking read
// system call. (A read through net.Conn with a deadline in the past would not do: the runtime
// fails it before any system call.)
func peerClosed(c net.Conn) bool {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return true
	}
	alive := false
	err = rc.Read(func(fd uintptr) bool {
		var b [1]byte
		// Go's sockets are non-blocking: EAGAIN means alive and quiet, 0 bytes means EOF, data
		// means an unasked answer (consumed: the connection is closed anyway).
		_, err := syscall.Read(int(fd), b[:])
		alive = err == syscall.EAGAIN || err == syscall.EINTR
		return true
	})
	return err != nil || !alive
}
