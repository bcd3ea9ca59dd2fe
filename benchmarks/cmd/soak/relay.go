package main

import (
	"io"
	"net"
	"sync"
)

// relay forwards TCP connections from a loopback port of its own to target, so that the path
// can be cut as a network would cut it: cut closes every connection and refuses new ones until
// restore. Safe for concurrent use.
type relay struct {
	ln     net.Listener
	target string

	mu    sync.Mutex
	cut   bool
	conns map[net.Conn]struct{}
}

// newRelay listens on a free loopback port and forwards to target until Close.
func newRelay(target string) (*relay, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	r := &relay{ln: ln, target: target, conns: map[net.Conn]struct{}{}}
	go r.serve()
	return r, nil
}

// addr is the relay's address, host:port.
func (r *relay) addr() string { return r.ln.Addr().String() }

func (r *relay) serve() {
	for {
		c, err := r.ln.Accept()
		if err != nil {
			return
		}
		go r.forward(c)
	}
}

// track adds c to the open connections; false (c closed) while the relay is cut.
func (r *relay) track(c net.Conn) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cut {
		c.Close()
		return false
	}
	r.conns[c] = struct{}{}
	return true
}

func (r *relay) untrack(c net.Conn) {
	r.mu.Lock()
	delete(r.conns, c)
	r.mu.Unlock()
	c.Close()
}

func (r *relay) forward(c net.Conn) {
	if !r.track(c) {
		return
	}
	defer r.untrack(c)
	up, err := net.Dial("tcp", r.target)
	if err != nil {
		return
	}
	if !r.track(up) {
		return
	}
	defer r.untrack(up)
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(up, c); done <- struct{}{} }()
	go func() { _, _ = io.Copy(c, up); done <- struct{}{} }()
	<-done // either side ending ends both
}

// setCut cuts the relay (every connection closed, new ones refused) or restores it.
func (r *relay) setCut(cut bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cut = cut
	if cut {
		for c := range r.conns {
			c.Close()
			delete(r.conns, c)
		}
	}
}

// Close stops the relay and closes its connections.
func (r *relay) Close() {
	r.ln.Close()
	r.setCut(true)
}
