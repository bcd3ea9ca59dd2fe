package stack

import (
	"testing"

	"github.com/kvroute/kvroute/config"
)

// "auto": 90 % of the cgroup's limit when there is one, else twice the body budget plus 256 MiB.
func TestMemoryLimitAuto(t *testing.T) {
	cfg := &config.Config{}
	cfg.ApplyDefaults()
	noCgroup := func() int64 { return 0 }
	if got, _ := MemoryLimit(cfg, noCgroup); got != 2*128<<20+256<<20 {
		t.Errorf("auto without a cgroup limit: %d, want %d", got, 2*128<<20+256<<20)
	}
	if got, _ := MemoryLimit(cfg, func() int64 { return 1000 << 20 }); got != 900<<20 {
		t.Errorf("auto under a 1000 MiB cgroup: %d, want %d", got, 900<<20)
	}
	cfg.Server.MemoryLimit = "64MiB"
	if got, from := MemoryLimit(cfg, func() int64 { return 1000 << 20 }); got != 64<<20 || from != "server.memory_limit" {
		t.Errorf("explicit: %d from %s", got, from)
	}
	for in, want := range map[string]int64{"max\n": 0, "9223372036854771712\n": 0, "1073741824\n": 1 << 30, "": 0, "x": 0} {
		if got := parseCgroupLimit([]byte(in)); got != want {
			t.Errorf("parseCgroupLimit(%q) = %d, want %d", in, got, want)
		}
	}
}
