package storeutil

import (
	"log/slog"

	"github.com/kvroute/kvroute/respcache"
)

// ErrorType is respcache.ErrorTypeOf with a client library's own errors, checked where
// ErrorTypeOf's documentation says: it returns "" for nil and for the caller's cancellation and
// respcache.ErrorTypeTimeout for a deadline, as ErrorTypeOf does; otherwise client(err) when that
// is not "", else ErrorTypeOf(err). client sorts the errors only its library knows (a server
// reply, an HTTP status) and returns "" for any other. ErrorType is safe for concurrent use when
// client is.
func ErrorType(err error, client func(error) string) string {
	typ := respcache.ErrorTypeOf(err)
	switch typ {
	case "", respcache.ErrorTypeTimeout:
		return typ
	}
	if c := client(err); c != "" {
		return c
	}
	return typ
}

// Unavailable reports whether an error type means the store's server cannot be reached
// (respcache.ErrorTypeConnection or respcache.ErrorTypeTimeout).
func Unavailable(typ string) bool {
	return typ == respcache.ErrorTypeConnection || typ == respcache.ErrorTypeTimeout
}

// Logger returns l, or a logger that discards everything when l is nil.
func Logger(l *slog.Logger) *slog.Logger {
	if l != nil {
		return l
	}
	return slog.New(slog.DiscardHandler)
}
