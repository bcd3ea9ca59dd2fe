package kvroute

import (
	"math"
	"math/bits"
	"sync/atomic"
)

// hllPrecision is the HyperLogLog precision: 2^12 registers, a standard error of 1.04/√4096 ≈ 1.6 %.
const hllPrecision = 12

// hyperLogLog approximates the number of distinct 64-bit hashes it has seen (Flajolet et al. 2007,
// with linear counting for small cardinalities). Safe for concurrent use: each register is raised
// with a CAS, so Add never blocks and costs one atomic load once the register is warm.
type hyperLogLog struct {
	reg [1 << hllPrecision]atomic.Uint32
}

// add records one hash. The hash must be well mixed (xxh3 output is).
func (h *hyperLogLog) add(x uint64) {
	idx := x >> (64 - hllPrecision)
	rest := x<<hllPrecision | 1<<(hllPrecision-1) // sentinel bit bounds the rank
	rank := uint32(bits.LeadingZeros64(rest)) + 1
	r := &h.reg[idx]
	for {
		cur := r.Load()
		if rank <= cur || r.CompareAndSwap(cur, rank) {
			return
		}
	}
}

// estimate returns the approximate number of distinct hashes added.
func (h *hyperLogLog) estimate() uint64 {
	const m = float64(1 << hllPrecision)
	sum, zeros := 0.0, 0
	for i := range h.reg {
		v := h.reg[i].Load()
		if v == 0 {
			zeros++
		}
		sum += math.Ldexp(1, -int(v))
	}
	alpha := 0.7213 / (1 + 1.079/m)
	e := alpha * m * m / sum
	if e <= 2.5*m && zeros > 0 {
		e = m * math.Log(m/float64(zeros))
	}
	return uint64(e + 0.5)
}
