package discovery

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"strings"
	"sync"
	"testing"

	"golang.org/x/net/dns/dnsmessage"
)

// dnsServer is a small authoritative DNS server on 127.0.0.1 (UDP) for the tests: it answers A
// and AAAA queries for its names from a table the test changes between queries, NXDOMAIN for
// names it does not know, and SERVFAIL while failing is set.
type dnsServer struct {
	conn *net.UDPConn

	mu      sync.Mutex
	records map[string][]netip.Addr // fully qualified, lower-case name → addresses
	failing bool
	queries int
}

// newDNSServer starts a server; it stops at the end of the test.
func newDNSServer(t *testing.T) *dnsServer {
	t.Helper()
	conn, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	s := &dnsServer{conn: conn, records: map[string][]netip.Addr{}}
	done := make(chan struct{})
	go func() {
		defer close(done)
		s.serve()
	}()
	t.Cleanup(func() {
		conn.Close()
		<-done
	})
	return s
}

// set makes name resolve to addrs (none: NOERROR with an empty answer); name may omit the final
// dot.
func (s *dnsServer) set(name string, addrs ...string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	list := make([]netip.Addr, 0, len(addrs))
	for _, a := range addrs {
		list = append(list, netip.MustParseAddr(a))
	}
	s.records[fqdn(name)] = list
}

// unset makes name unknown: NXDOMAIN.
func (s *dnsServer) unset(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.records, fqdn(name))
}

// fail makes every answer SERVFAIL (true) or normal again (false).
func (s *dnsServer) fail(on bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.failing = on
}

// Queries returns the number of queries answered.
func (s *dnsServer) Queries() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.queries
}

func fqdn(name string) string { return strings.ToLower(strings.TrimSuffix(name, ".")) + "." }

// resolver returns a pure-Go resolver that sends every query to s.
func (s *dnsServer) resolver() *net.Resolver {
	addr := s.conn.LocalAddr().String()
	return &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "udp", addr)
	}}
}

func (s *dnsServer) serve() {
	buf := make([]byte, 1500)
	for {
		n, from, err := s.conn.ReadFromUDP(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		if out, ok := s.answer(buf[:n]); ok {
			_, _ = s.conn.WriteToUDP(out, from)
		}
	}
}

// answer builds the response to one query; ok is false for a message that is no query.
func (s *dnsServer) answer(query []byte) (out []byte, ok bool) {
	var p dnsmessage.Parser
	h, err := p.Start(query)
	if err != nil || h.Response {
		return nil, false
	}
	q, err := p.Question()
	if err != nil {
		return nil, false
	}
	s.mu.Lock()
	s.queries++
	failing := s.failing
	addrs, known := s.records[strings.ToLower(q.Name.String())]
	s.mu.Unlock()

	rh := dnsmessage.Header{ID: h.ID, Response: true, Authoritative: true, RecursionDesired: h.RecursionDesired,
		RecursionAvailable: true}
	switch {
	case failing:
		rh.RCode = dnsmessage.RCodeServerFailure
	case !known:
		rh.RCode = dnsmessage.RCodeNameError
	}
	b := dnsmessage.NewBuilder(make([]byte, 0, 512), rh)
	b.EnableCompression()
	if b.StartQuestions() != nil || b.Question(q) != nil || b.StartAnswers() != nil {
		return nil, false
	}
	if !failing && known {
		rr := dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET, TTL: 5}
		for _, a := range addrs {
			switch {
			case q.Type == dnsmessage.TypeA && a.Is4():
				if b.AResource(rr, dnsmessage.AResource{A: a.As4()}) != nil {
					return nil, false
				}
			case q.Type == dnsmessage.TypeAAAA && a.Is6():
				if b.AAAAResource(rr, dnsmessage.AAAAResource{AAAA: a.As16()}) != nil {
					return nil, false
				}
			}
		}
	}
	out, err = b.Finish()
	return out, err == nil
}
