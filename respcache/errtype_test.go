package respcache_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"testing"

	"github.com/kvroute/kvroute/respcache"
)

// timeoutErr is a net.Error that timed out.
type timeoutErr struct{}

func (timeoutErr) Error() string   { return "i/o timeout" }
func (timeoutErr) Timeout() bool   { return true }
func (timeoutErr) Temporary() bool { return true }

func TestErrorTypeOf(t *testing.T) {
	opErr := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	for _, tc := range []struct {
		name string
		err  error
		want string
	}{
		{"nil", nil, ""},
		{"canceled", fmt.Errorf("x: %w", context.Canceled), ""},
		{"deadline", context.DeadlineExceeded, respcache.ErrorTypeTimeout},
		{"os_deadline", os.ErrDeadlineExceeded, respcache.ErrorTypeTimeout},
		{"net_timeout", fmt.Errorf("read: %w", timeoutErr{}), respcache.ErrorTypeTimeout},
		{"refused", opErr, respcache.ErrorTypeConnection},
		{"reset", fmt.Errorf("read: %w", syscall.ECONNRESET), respcache.ErrorTypeConnection},
		{"eof", io.EOF, respcache.ErrorTypeConnection},
		{"unexpected_eof", io.ErrUnexpectedEOF, respcache.ErrorTypeConnection},
		{"closed", net.ErrClosed, respcache.ErrorTypeConnection},
		{"dns", &net.DNSError{Err: "no such host", Name: "cache.invalid"}, respcache.ErrorTypeConnection},
		{"unavailable", fmt.Errorf("%w: circuit", respcache.ErrUnavailable), respcache.ErrorTypeConnection},
		{"other", errors.New("boom"), respcache.ErrorTypeOther},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := respcache.ErrorTypeOf(tc.err); got != tc.want {
				t.Errorf("ErrorTypeOf(%v) = %q, want %q", tc.err, got, tc.want)
			}
		})
	}
}

func TestErrorCounts(t *testing.T) {
	var c respcache.ErrorCounts
	want := map[string]uint64{respcache.ErrorTypeConnection: 0, respcache.ErrorTypeTimeout: 0, respcache.ErrorTypeOther: 0}
	if got := c.Snapshot(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("zero value: Snapshot() = %v, want %v", got, want)
	}
	for _, typ := range []string{respcache.ErrorTypeConnection, respcache.ErrorTypeConnection, respcache.ErrorTypeTimeout,
		respcache.ErrorTypeOther, "", "canceled"} {
		c.Add(typ)
	}
	want = map[string]uint64{respcache.ErrorTypeConnection: 2, respcache.ErrorTypeTimeout: 1, respcache.ErrorTypeOther: 1}
	if got := c.Snapshot(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("Snapshot() = %v, want %v", got, want)
	}
}
