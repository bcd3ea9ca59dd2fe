package stack

import (
	"strings"
	"testing"
)

// A default replica id keeps the host name's letters, digits, - and _, at most 40 of them.
func TestNatsIDPart(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"gw-1.example.com", "gw-1examplecom"},
		{"node_7", "node_7"},
		{"...", "kvroute"},
		{"", "kvroute"},
		{strings.Repeat("a", 50), strings.Repeat("a", 40)},
	} {
		if got := natsIDPart(tc.in); got != tc.want {
			t.Errorf("natsIDPart(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}
