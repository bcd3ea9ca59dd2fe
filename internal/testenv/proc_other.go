//go:build !unix

package testenv

import "os"

// resumeProcess does nothing: without SIGSTOP no test stops a process here.
func resumeProcess(*os.Process) {}
