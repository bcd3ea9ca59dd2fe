//go:build !unix

package testenv

import (
	"net"
	"testing"
)

// RefusedAddr returns a loopback TCP address ("127.0.0.1:port") that refuses connections: a port
// that was listened on and closed. Where sockets can be bound without listening (unix) the port
// stays reserved for the test; here a server started later on port 0 may be given it.
func RefusedAddr(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("refused address: %v", err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	return addr
}
