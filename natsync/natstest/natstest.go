// Package natstest runs a real NATS server with JetStream inside a test process (the server of
// github.com/nats-io/nats-server/v2), on a loopback port of its own, for the tests of kvroute's
// NATS packages and of gateways built on them (the reference proxy's), which stop and restart it.
package natstest

import (
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// Server is a NATS server with JetStream, stopped when its test ends.
type Server struct {
	t     testing.TB
	port  int
	store string
	srv   *server.Server
}

// Start starts a NATS server with JetStream (its store in a directory of the test's) on a free
// loopback port.
func Start(t testing.TB) *Server {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("natstest: no free port: %v", err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	_ = l.Close()
	s := &Server{t: t, port: port, store: t.TempDir()}
	s.Restart()
	t.Cleanup(s.Stop)
	return s
}

// URL is the server's client URL (nats://127.0.0.1:port); it stays the same across Restart.
func (s *Server) URL() string { return fmt.Sprintf("nats://127.0.0.1:%d", s.port) }

// Stop shuts the server down (what it stored stays in its store directory). Idempotent.
func (s *Server) Stop() {
	if s.srv == nil {
		return
	}
	s.srv.Shutdown()
	s.srv.WaitForShutdown()
	s.srv = nil
}

// Restart starts the server again on the same port and store (after Stop; a running server is
// stopped first), and waits until it accepts clients.
func (s *Server) Restart() {
	s.t.Helper()
	s.Stop()
	opts := &server.Options{
		Host:      "127.0.0.1",
		Port:      s.port,
		JetStream: true,
		StoreDir:  s.store,
		NoLog:     true,
		NoSigs:    true,
	}
	srv, err := server.NewServer(opts)
	if err != nil {
		s.t.Fatalf("natstest: %v", err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		srv.Shutdown()
		s.t.Fatalf("natstest: the server on port %d did not become ready in 10 s", s.port)
	}
	s.srv = srv
}
