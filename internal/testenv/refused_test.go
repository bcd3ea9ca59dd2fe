package testenv

import (
	"errors"
	"net"
	"runtime"
	"syscall"
	"testing"
	"time"
)

func TestRefusedAddr(t *testing.T) {
	addr := RefusedAddr(t)
	for range 3 {
		c, err := net.DialTimeout("tcp", addr, 2*time.Second)
		if err == nil {
			c.Close()
			t.Fatalf("dial %s succeeded, want connection refused", addr)
		}
		if runtime.GOOS != "windows" && !errors.Is(err, syscall.ECONNREFUSED) {
			t.Fatalf("dial %s: %v, want connection refused", addr, err)
		}
	}
	// Servers started afterwards on port 0 are never given the port.
	for range 200 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		got := ln.Addr().String()
		ln.Close()
		if got == addr {
			t.Fatalf("a listener was given the refused address %s", addr)
		}
	}
}
