package kvroutecaddy

import (
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// FuzzUnmarshalCaddyfile feeds the kvroute directive arbitrary tokens: it must answer with an
// error or a handler, never panic, and a handler it accepts must map onto kvroute's configuration
// (or be refused there) without panicking either.
func FuzzUnmarshalCaddyfile(f *testing.F) {
	for _, s := range []string{
		"kvroute a:1 b:2",
		"kvroute {\n\tbackend a:1 {\n\t\tweight 2\n\t\tzmq tcp://a:5557 tcp://a:5558\n\t}\n}",
		"kvroute a:1 {\n\tkv_index redis redis://r:6379 {\n\t\tentry_ttl 5m\n\t}\n\ttokenizer estimate\n}",
		"kvroute a:1 {\n\tresponse_cache {\n\t\tttl 1m\n\t}\n\tprefix_routing off\n}",
		"kvroute http://a {\n\tmax_body_size 1KiB\n\tselection_strategy random\n}",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		var h Handler
		if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(in)); err != nil {
			return
		}
		if _, err := h.poolKey(); err != nil {
			t.Fatalf("poolKey of %q: %v", in, err)
		}
		_, _ = h.config()
	})
}
