//go:build unix

package kvindex

import (
	"syscall"
	"time"
)

// cpuClock reads the process's CPU time (user + system). On a shared machine, CPU time per
// operation is a steadier measure than wall time, which also counts time spent descheduled.
func cpuClock() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
