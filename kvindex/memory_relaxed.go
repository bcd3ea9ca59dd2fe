//go:build !race

package kvindex

import (
	"sync/atomic"
	"unsafe"
)

// storeWord writes v to *p with a plain store. Table writers hold the shard's mutex and bracket
// their writes with the shard's sequence counter, whose atomic increments order the writes
// (they are full barriers on amd64 and acquire-release on arm64); seqlock readers load every word
// atomically and discard what they read when the sequence moved. The Go memory model guarantees
// that a word-sized read racing with a write observes a value some write stored, which is all a
// discarded read needs. An atomic store (XCHG on amd64) costs about 20 cycles more; a slot write
// stores seven words. Race-detector builds use atomic stores (memory_relaxed_race.go).
func storeWord(p *atomic.Uint64, v uint64) { *(*uint64)(unsafe.Pointer(p)) = v }
