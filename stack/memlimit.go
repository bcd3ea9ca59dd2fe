package stack

import (
	"bytes"
	"log/slog"
	"math"
	"os"
	"runtime/debug"
	"strconv"

	"github.com/kvroute/kvroute/config"
)

// MemoryLimit is the soft memory limit server.memory_limit asks of cfg: 0 for none. "auto" is
// 90 % of the cgroup's memory limit (cgroupLimit, e.g. CgroupMemoryLimit) when the process has
// one, else twice server.max_inflight_body_bytes plus 256 MiB: the request bodies, what parsing
// them holds and the garbage they leave, and room for the rest of the gateway. from says which.
func MemoryLimit(cfg *config.Config, cgroupLimit func() int64) (limit int64, from string) {
	v, auto, err := config.ParseMemoryLimit(cfg.Server.MemoryLimit)
	switch {
	case err != nil: // Validate refused it already
		return 0, "invalid"
	case !auto:
		return v, "server.memory_limit"
	}
	if cg := cgroupLimit(); cg > 0 {
		return cg / 10 * 9, "auto: 90% of the cgroup's memory limit"
	}
	return 2*cfg.Server.MaxInflightBodyBytes + autoMemoryHeadroom, "auto: 2 × server.max_inflight_body_bytes + 256 MiB"
}

// autoMemoryHeadroom is what the automatic memory limit allows beyond the request bodies.
const autoMemoryHeadroom = 256 << 20

// ApplyMemoryLimit sets the Go runtime's soft memory limit (debug.SetMemoryLimit) from cfg's
// server.memory_limit (call it at start and on each reload), unless the GOMEMLIMIT environment
// variable is set: the operator's variable wins, as the runtime applied it at start. It logs the
// limit and where it came from.
func ApplyMemoryLimit(cfg *config.Config, log *slog.Logger) {
	if env := os.Getenv("GOMEMLIMIT"); env != "" {
		log.Info("memory limit from GOMEMLIMIT; server.memory_limit is not applied", "GOMEMLIMIT", env)
		return
	}
	limit, from := MemoryLimit(cfg, CgroupMemoryLimit)
	if limit <= 0 {
		debug.SetMemoryLimit(math.MaxInt64) // the runtime's "no limit"
		log.Info("no soft memory limit", "server.memory_limit", cfg.Server.MemoryLimit)
		return
	}
	debug.SetMemoryLimit(limit)
	log.Info("soft memory limit", "bytes", limit, "from", from)
}

// CgroupMemoryLimit returns the memory limit of the process's cgroup in bytes (cgroup v2's
// memory.max, else v1's memory.limit_in_bytes, as mounted in a container), or 0 when there is
// none or it cannot be read.
func CgroupMemoryLimit() int64 {
	for _, path := range []string{"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"} {
		b, err := os.ReadFile(path)
		if err != nil {
			continue
		}
		return parseCgroupLimit(b)
	}
	return 0
}

// parseCgroupLimit reads a cgroup memory limit file: "max" (v2) or a value of 2^60 bytes or more
// (v1's "unlimited", a page-rounded 2^63−1) mean no limit, 0.
func parseCgroupLimit(b []byte) int64 {
	s := string(bytes.TrimSpace(b))
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n <= 0 || n >= 1<<60 {
		return 0
	}
	return n
}
