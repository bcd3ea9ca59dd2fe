package config

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

// MemoryLimitAuto is server.memory_limit's default: the gateway derives the limit (see
// ServerConfig.MemoryLimit).
const MemoryLimitAuto = "auto"

// ParseMemoryLimit reads a server.memory_limit value. "auto" (and "", the unset value) gives
// auto true; "off" and "0" give 0 (no limit); otherwise v is a byte count ("536870912") or a
// number, fractional or not, followed by one of the units B, KiB, MiB, GiB or TiB ("512MiB",
// "1.5 GiB"), GOMEMLIMIT's units, and the result is that many bytes, rounded down. A limit
// must be at least 1 MiB (a smaller one would have the collector run without pause): smaller
// values, negative ones, other units and values above 2^63−1 bytes are errors. Case is
// ignored in the keywords and units.
func ParseMemoryLimit(v string) (limit int64, auto bool, err error) {
	s := strings.TrimSpace(v)
	switch strings.ToLower(s) {
	case "", MemoryLimitAuto:
		return 0, true, nil
	case "off", "0":
		return 0, false, nil
	}
	num := strings.TrimRightFunc(s, func(r rune) bool { return r < '0' || r > '9' })
	unit := strings.ToLower(strings.TrimSpace(s[len(num):]))
	// num ends at the last digit; what precedes the unit may still hold a fraction.
	var mult float64
	switch unit {
	case "", "b":
		mult = 1
	case "kib":
		mult = 1 << 10
	case "mib":
		mult = 1 << 20
	case "gib":
		mult = 1 << 30
	case "tib":
		mult = 1 << 40
	default:
		return 0, false, fmt.Errorf("%q: unknown unit %q; want a byte count or one of B, KiB, MiB, GiB, TiB (or off, auto)", v, s[len(num):])
	}
	if unit == "" || unit == "b" {
		n, err := strconv.ParseInt(num, 10, 64)
		if err != nil {
			return 0, false, fmt.Errorf("%q: want a whole number of bytes, a size such as 512MiB, off or auto", v)
		}
		limit = n
	} else {
		f, err := strconv.ParseFloat(num, 64)
		if err != nil || f < 0 || math.IsInf(f, 0) || math.IsNaN(f) {
			return 0, false, fmt.Errorf("%q: want a size such as 512MiB, off or auto", v)
		}
		if f*mult >= math.MaxInt64 {
			return 0, false, fmt.Errorf("%q: above 2^63-1 bytes", v)
		}
		limit = int64(f * mult)
	}
	if limit < minMemoryLimit {
		return 0, false, fmt.Errorf("%q: below 1 MiB (write off or 0 for no limit)", v)
	}
	return limit, false, nil
}

// minMemoryLimit is the smallest server.memory_limit accepted.
const minMemoryLimit = 1 << 20
