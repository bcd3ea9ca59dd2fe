package testenv

import (
	"bytes"
	"strings"
	"sync"
)

// LogBuffer is a log destination safe for concurrent writers (a slog handler's, a child
// process's stderr), read back by tests.
type LogBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

// Write appends p.
func (b *LogBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// String returns what was written.
func (b *LogBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// Count returns how many times s occurs in what was written.
func (b *LogBuffer) Count(s string) int { return strings.Count(b.String(), s) }
