package respcache

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"sync/atomic"
	"syscall"
)

// Error types: the keys of StoreStats.Errors and RedisStats.Errors and the values of the stores'
// errors metrics' "type" attribute.
const (
	ErrorTypeConnection = "connection" // refused, reset, closed, DNS, server not ready, ErrUnavailable
	ErrorTypeTimeout    = "timeout"    // a deadline: the store's own (command or operation timeout) or a net timeout
	ErrorTypeOther      = "other"      // everything else: a server error reply, a bad response
)

// ErrorTypeOf sorts a store's error into an error type, for StoreStats.Errors and metrics. It
// returns "" for nil and for the caller's cancellation (an error wrapping context.Canceled), which
// is never the store's fault and is not counted; ErrorTypeTimeout for an error wrapping
// context.DeadlineExceeded or os.ErrDeadlineExceeded, or a net.Error whose Timeout is true;
// ErrorTypeConnection for an error wrapping ErrUnavailable, io.EOF, io.ErrUnexpectedEOF,
// net.ErrClosed, a connection refused, reset, aborted or unreachable errno, a broken pipe, a
// *net.OpError or a *net.DNSError; ErrorTypeOther for anything else.
//
// A store whose client library has errors of its own meaning "unreachable" or "not ready" (a
// server reply such as Redis' LOADING, an HTTP 503) checks them after "" and ErrorTypeTimeout and
// before the rest, as redisstore and s3store do. It is a pure function, safe for concurrent use.
func ErrorTypeOf(err error) string {
	if err == nil || errors.Is(err, context.Canceled) {
		return ""
	}
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, os.ErrDeadlineExceeded) {
		return ErrorTypeTimeout
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return ErrorTypeTimeout
	}
	if errors.Is(err, ErrUnavailable) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, net.ErrClosed) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, syscall.ECONNABORTED) || errors.Is(err, syscall.EPIPE) ||
		errors.Is(err, syscall.EHOSTUNREACH) || errors.Is(err, syscall.ENETUNREACH) {
		return ErrorTypeConnection
	}
	var oe *net.OpError
	var de *net.DNSError
	if errors.As(err, &oe) || errors.As(err, &de) {
		return ErrorTypeConnection
	}
	return ErrorTypeOther
}

// ErrorCounts counts a store's errors by type, for StoreStats.Errors. The zero value is ready to
// use; all methods are safe for concurrent use. It must not be copied after first use.
type ErrorCounts struct {
	connection, timeout, other atomic.Uint64
}

// Add counts one error of type typ (ErrorTypeConnection, ErrorTypeTimeout or ErrorTypeOther).
// Any other value, "" included, is ignored, so that Add(ErrorTypeOf(err)) counts exactly the
// errors that are the store's.
func (c *ErrorCounts) Add(typ string) {
	switch typ {
	case ErrorTypeConnection:
		c.connection.Add(1)
	case ErrorTypeTimeout:
		c.timeout.Add(1)
	case ErrorTypeOther:
		c.other.Add(1)
	}
}

// Snapshot returns the counts as StoreStats.Errors: a new map holding every type, zeros included.
func (c *ErrorCounts) Snapshot() map[string]uint64 {
	return map[string]uint64{
		ErrorTypeConnection: c.connection.Load(),
		ErrorTypeTimeout:    c.timeout.Load(),
		ErrorTypeOther:      c.other.Load(),
	}
}
