//go:build !unix

package kvindex

import "time"

// cpuClock returns 0 where the process's CPU time is not read: the benchmarks then report no
// cpu-ns/op.
func cpuClock() time.Duration { return 0 }
