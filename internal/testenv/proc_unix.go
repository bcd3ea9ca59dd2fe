//go:build unix

package testenv

import (
	"os"
	"syscall"
)

// resumeProcess sends SIGCONT to p, which a test may have stopped with SIGSTOP.
func resumeProcess(p *os.Process) { _ = p.Signal(syscall.SIGCONT) }
