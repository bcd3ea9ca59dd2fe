//go:build !unix

package main

import "errors"

// canSendSIGTERM tells whether sendSIGTERM works on this system: a process cannot send itself
// SIGTERM here (os.Process.Signal supports only Kill on Windows).
const canSendSIGTERM = false

func sendSIGTERM() error { return errors.ErrUnsupported }
