//go:build unix

package main

import "syscall"

// canSendSIGTERM tells whether sendSIGTERM works on this system.
const canSendSIGTERM = true

// sendSIGTERM sends SIGTERM to the test process, as an orchestrator stopping the proxy would.
func sendSIGTERM() error { return syscall.Kill(syscall.Getpid(), syscall.SIGTERM) }
