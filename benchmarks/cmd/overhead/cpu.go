package main

import (
	"os"
	"strconv"
	"strings"
	"time"
)

// userHZ is the unit of /proc/PID/stat's CPU times (USER_HZ, 100 on every Linux ABI in use).
const userHZ = 100

// cpuTime returns the CPU time (user and system, all threads) that process pid has used, from
// /proc/PID/stat (pid 0: this process); ok is false where there is no such file.
func cpuTime(pid int) (d time.Duration, ok bool) {
	name := "/proc/self/stat"
	if pid != 0 {
		name = "/proc/" + strconv.Itoa(pid) + "/stat"
	}
	b, err := os.ReadFile(name)
	if err != nil {
		return 0, false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')') // the command name may hold spaces and parentheses
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(s[i+1:]) // f[0] is field 3 (state): utime is field 14, stime 15
	if len(f) < 13 {
		return 0, false
	}
	ut, err1 := strconv.ParseUint(f[11], 10, 64)
	st, err2 := strconv.ParseUint(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, false
	}
	return time.Duration(ut+st) * time.Second / userHZ, true
}

// cpuMeter measures the CPU time a set of processes use over an interval. The zero value
// measures nothing.
type cpuMeter struct {
	pids  []int // 0 is this process
	start []time.Duration
	ok    bool
}

func newCPUMeter(pids []int) *cpuMeter { return &cpuMeter{pids: pids} }

// begin takes the start readings.
func (m *cpuMeter) begin() {
	m.start = m.start[:0]
	m.ok = true
	for _, p := range m.pids {
		d, ok := cpuTime(p)
		m.ok = m.ok && ok
		m.start = append(m.start, d)
	}
}

// end returns the CPU time each process used since begin; nil when some reading failed.
func (m *cpuMeter) end() []time.Duration {
	out := make([]time.Duration, len(m.pids))
	for i, p := range m.pids {
		d, ok := cpuTime(p)
		if !ok || !m.ok {
			return nil
		}
		out[i] = d - m.start[i]
	}
	return out
}
