//go:build !linux

package main

import (
	"errors"
	"os/exec"
	"runtime"
)

// peakRSS needs /proc/PID/status: Linux only.
func peakRSS(int) (int64, error) {
	return 0, errors.New("bodymem measures peak RSS from /proc/PID/status: Linux only")
}

func cpuModel() string { return runtime.GOARCH }

func setDeathSignal(*exec.Cmd) {}
