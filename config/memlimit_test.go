package config

import (
	"strings"
	"testing"
)

func TestParseMemoryLimit(t *testing.T) {
	for _, c := range []struct {
		in    string
		limit int64
		auto  bool
		bad   bool
	}{
		{in: "", auto: true},
		{in: "auto", auto: true},
		{in: "AUTO", auto: true},
		{in: "off"},
		{in: "Off"},
		{in: "0"},
		{in: "536870912", limit: 536870912},
		{in: "536870912B", limit: 536870912},
		{in: "512MiB", limit: 512 << 20},
		{in: "512 mib", limit: 512 << 20},
		{in: "1.5GiB", limit: 3 << 29},
		{in: "2048KiB", limit: 2 << 20},
		{in: "1TiB", limit: 1 << 40},
		{in: "1MiB", limit: 1 << 20},
		{in: "1048575", bad: true}, // below 1 MiB
		{in: "0B", bad: true},
		{in: "-1", bad: true},
		{in: "-1MiB", bad: true},
		{in: "512MB", bad: true}, // SI units are not GOMEMLIMIT's
		{in: "512M", bad: true},
		{in: "lots", bad: true},
		{in: "1.5", bad: true}, // a fraction of a byte
		{in: "10000000TiB", bad: true},
		{in: "99999999999999999999", bad: true},
	} {
		limit, auto, err := ParseMemoryLimit(c.in)
		if (err != nil) != c.bad || limit != c.limit || auto != c.auto {
			t.Errorf("ParseMemoryLimit(%q) = %d, %v, %v; want %d, %v, error %v", c.in, limit, auto, err, c.limit, c.auto, c.bad)
		}
	}
}

// server.memory_limit: "auto" by default, a size or a byte count as YAML writes them, and a bad
// value is a validation error naming the field.
func TestMemoryLimitConfig(t *testing.T) {
	cfg, err := Parse([]byte(minimalBackends), env(nil))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Server.MemoryLimit != MemoryLimitAuto {
		t.Errorf("default server.memory_limit %q, want %q", cfg.Server.MemoryLimit, MemoryLimitAuto)
	}
	for in, want := range map[string]int64{"384MiB": 384 << 20, "402653184": 402653184, "off": 0, "0": 0} {
		cfg, err := Parse([]byte("server:\n  memory_limit: "+in+"\n"+minimalBackends), env(nil))
		if err != nil {
			t.Fatalf("memory_limit %s: %v", in, err)
		}
		if got, auto, err := ParseMemoryLimit(cfg.Server.MemoryLimit); err != nil || auto || got != want {
			t.Errorf("memory_limit %s: read back %q = %d, %v, %v; want %d", in, cfg.Server.MemoryLimit, got, auto, err, want)
		}
	}
	for _, in := range []string{"512MB", "100", "-1GiB", "[1]"} {
		_, err := Parse([]byte("server:\n  memory_limit: "+in+"\n"+minimalBackends), env(nil))
		if err == nil || !strings.Contains(err.Error(), "server.memory_limit") {
			t.Errorf("memory_limit %s: err %v, want one naming server.memory_limit", in, err)
		}
	}
}
