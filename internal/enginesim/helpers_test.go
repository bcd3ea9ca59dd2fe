package enginesim

import (
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// newTestEngine returns an engine closed at the end of the test, with a fixed hash seed and no
// sleeping unless cfg says otherwise.
func newTestEngine(t testing.TB, cfg Config) *Engine {
	t.Helper()
	if cfg.HashSeed == 0 {
		cfg.HashSeed = 42
	}
	e, err := New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = e.Close() })
	return e
}

// eventually polls cond every 5 ms for up to 5 s.
func eventually(t testing.TB, cond func() bool, msg string, args ...any) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out: "+msg, args...)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// settleGoroutines waits until the goroutine count is back at base (plus slack).
func settleGoroutines(t testing.TB, base, slack int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		n := runtime.NumGoroutine()
		if n <= base+slack {
			return
		}
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			buf = buf[:runtime.Stack(buf, true)]
			t.Fatalf("goroutines: %d, want ≤ %d\n%s", n, base+slack, buf)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
