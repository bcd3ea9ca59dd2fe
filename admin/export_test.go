package admin

import "time"

// SetDumpTimeout makes DumpHandler's deadline d until the returned function restores it.
func SetDumpTimeout(d time.Duration) (restore func()) {
	old := dumpTimeout
	dumpTimeout = d
	return func() { dumpTimeout = old }
}
