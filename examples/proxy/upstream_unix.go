//go:build unix

package main

import (
	"net"
	"syscall"
)

// peerProbe tells whether the peer of an idle connection closed it, or sent something unasked
// (a 408, say): either way it cannot carry a request. A check costs one non-blocking read system
// call. (A read through net.Conn with a deadline in the past would not do: the runtime fails it
// before any system call.) The raw connection and the read callback are bound once, by init: per
// check they would cost two allocations. Not safe for concurrent use.
type peerProbe struct {
	raw   bool            // the connection is a syscall.Conn
	rc    syscall.RawConn // when raw and err is nil
	err   error           // SyscallConn's
	alive bool            // the last read's verdict
	read  func(fd uintptr) bool
}

// init binds p to c.
func (p *peerProbe) init(c net.Conn) {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return
	}
	p.raw = true
	p.rc, p.err = sc.SyscallConn()
	p.read = func(fd uintptr) bool {
		var b [1]byte
		// Go's sockets are non-blocking: EAGAIN means alive and quiet, 0 bytes means EOF, data
		// means an unasked answer (consumed: the connection is closed anyway).
		_, err := syscall.Read(int(fd), b[:])
		p.alive = err == syscall.EAGAIN || err == syscall.EINTR
		return true
	}
}

// closed reports whether the peer closed the connection or sent something unasked; false when
// the connection has no file descriptor to probe.
func (p *peerProbe) closed() bool {
	if !p.raw {
		return false
	}
	if p.err != nil {
		return true
	}
	p.alive = false
	err := p.rc.Read(p.read)
	return err != nil || !p.alive
}
