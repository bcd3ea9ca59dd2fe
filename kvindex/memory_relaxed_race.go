//go:build race

package kvindex

import "sync/atomic"

// storeWord is an atomic store under the race detector (see memory_relaxed.go).
func storeWord(p *atomic.Uint64, v uint64) { p.Store(v) }
