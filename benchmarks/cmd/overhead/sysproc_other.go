//go:build !linux

package main

import "syscall"

// childSysProcAttr is nil where there is no Pdeathsig: children are killed on exit, on error and
// on SIGINT or SIGTERM, but not if this process is killed outright.
func childSysProcAttr() *syscall.SysProcAttr { return nil }
