//go:build !race

package scorer

// raceEnabled is true under -race, whose instrumentation allocates: allocation assertions skip.
const raceEnabled = false
