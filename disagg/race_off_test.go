//go:build !race

package disagg

// raceEnabled is true under -race, whose instrumentation allocates: allocation assertions skip.
const raceEnabled = false
