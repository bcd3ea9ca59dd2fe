package s3store

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"

	"github.com/minio/minio-go/v7"

	"github.com/kvroute/kvroute/respcache"
	"github.com/kvroute/kvroute/respcache/internal/storeutil"
)

// TestObjectNameVectors pins the key → object-name mapping: changing it orphans every object
// stored under the old names.
func TestObjectNameVectors(t *testing.T) {
	s := &Store{cfg: Config{KeyPrefix: "p/"}}
	for _, tc := range []struct{ key, want string }{
		{"", "p/%"},
		{"0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef", "p/0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"},
		{"Az09-_", "p/Az09-_"},
		{"a/b", "p/a%2Fb"},
		{"..", "p/%2E%2E"},
		{"%", "p/%25"},
		{"~", "p/%7E"},
		{"é", "p/%C3%A9"},
		{"\x00", "p/%00"},
		{strings.Repeat("/", 66), "p/" + strings.Repeat("%2F", 66)},                                      // 198 bytes escaped: kept
		{strings.Repeat("/", 67), "p/~3eb1349aab9dc074e2028d6801ffe27e5de46b30e87a4e66e5fbb0b764f514e1"}, // 201: hashed
		{strings.Repeat("a", 200), "p/" + strings.Repeat("a", 200)},
		{strings.Repeat("a", 201), "p/~a92efd82109373e58f9a2056dee01e807e216ce6075f7051207c0a9f7d666e50"},
	} {
		if got := s.objectName(tc.key); got != tc.want {
			t.Errorf("objectName(%.20q) = %q, want %q", tc.key, got, tc.want)
		}
	}
}

// TestObjectNameInjective: distinct keys never share an object name.
func TestObjectNameInjective(t *testing.T) {
	s := &Store{cfg: Config{KeyPrefix: "p/"}}
	seen := map[string]string{}
	keys := []string{"", "%", "%25", "~", "a", "A", "a/b", "a%2Fb", "..", ".", "%2E", strings.Repeat("b", 300)}
	for i := range 256 {
		keys = append(keys, string([]byte{byte(i)}), "x"+string([]byte{byte(i)}))
	}
	for _, k := range keys {
		name := s.objectName(k)
		if prev, ok := seen[name]; ok && prev != k {
			t.Fatalf("keys %q and %q both map to %q", prev, k, name)
		}
		seen[name] = k
	}
}

func FuzzObjectName(f *testing.F) {
	for _, k := range []string{"", "a/b", "..", "%41", strings.Repeat("z", 250)} {
		f.Add(k, "x")
	}
	s := &Store{cfg: Config{KeyPrefix: "p/"}}
	f.Fuzz(func(t *testing.T, a, b string) {
		na, nb := s.objectName(a), s.objectName(b)
		if a != b && na == nb {
			t.Fatalf("%q and %q collide on %q", a, b, na)
		}
		rest := strings.TrimPrefix(na, "p/")
		if strings.ContainsAny(rest, "/.") || len(rest) > 201 || rest == "" {
			t.Fatalf("objectName(%q) = %q: not one flat, short, non-empty name", a, na)
		}
	})
}

// TestErrorType checks S3's error responses on top of respcache.ErrorTypeOf: a gateway or server
// that cannot serve now (502, 503, 504) is an outage, any other status is not.
func TestErrorType(t *testing.T) {
	opErr := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	for _, tc := range []struct {
		name string
		err  error
		want string
	}{
		{"canceled", fmt.Errorf("x: %w", context.Canceled), ""},
		{"deadline", context.DeadlineExceeded, respcache.ErrorTypeTimeout},
		{"os_deadline", os.ErrDeadlineExceeded, respcache.ErrorTypeTimeout},
		{"refused", opErr, respcache.ErrorTypeConnection},
		{"eof", io.EOF, respcache.ErrorTypeConnection},
		{"unavailable", fmt.Errorf("%w: circuit", respcache.ErrUnavailable), respcache.ErrorTypeConnection},
		{"s3_502", minio.ErrorResponse{StatusCode: 502, Code: "BadGateway"}, respcache.ErrorTypeConnection},
		{"s3_503", minio.ErrorResponse{StatusCode: 503, Code: "SlowDown"}, respcache.ErrorTypeConnection},
		{"s3_503_redacted", storeutil.Redact(minio.ErrorResponse{StatusCode: 503, Code: "SlowDown"}, storeutil.Secrets("k")), respcache.ErrorTypeConnection},
		{"s3_504", minio.ErrorResponse{StatusCode: 504}, respcache.ErrorTypeConnection},
		{"s3_403", minio.ErrorResponse{StatusCode: 403, Code: "AccessDenied"}, respcache.ErrorTypeOther},
		{"s3_no_status", minio.ErrorResponse{Code: "Weird"}, respcache.ErrorTypeOther},
		{"other", errors.New("boom"), respcache.ErrorTypeOther},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := errorType(tc.err); got != tc.want {
				t.Errorf("errorType(%v) = %q, want %q", tc.err, got, tc.want)
			}
		})
	}
}
