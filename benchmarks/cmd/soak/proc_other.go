//go:build !linux

package main

import (
	"errors"
	"syscall"
)

func childSysProcAttr() *syscall.SysProcAttr { return nil }

// procStats needs /proc: the soak measures the proxy's memory and files on Linux only.
func procStats(int) (int64, int, error) {
	return 0, 0, errors.New("soak: RSS and open files are read from /proc (Linux)")
}
